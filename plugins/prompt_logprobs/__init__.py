"""Prompt log-probabilities (``enable_prompt_logprobs``): a context-encoding phase that also
scores every prompt token, for vLLM's ``prompt_logprobs`` and OpenAI's ``echo`` with
``logprobs``."""
