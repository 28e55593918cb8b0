"""Perplexity through an OpenAI-compatible server, as lm-evaluation-harness scores text: each
prompt is sent to ``/v1/completions`` with ``echo`` and ``logprobs``, and the log-probabilities
of its tokens after the first are summed. ``--compare-hf PATH`` scores the same token ids with
HF transformers (float32) and prints both.

    nxdplug serve --model-path M --enable-prompt-logprobs --torch-dtype float32 --port 8000 &
    python examples/served_perplexity.py --base-url http://127.0.0.1:8000/v1 --model M \\
        --prompts prompts.jsonl --compare-hf M

``--prompts``: JSON lines with ``input_ids`` (token ids) or ``text``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import openai


def read_prompts(path: Path) -> list[str | list[int]]:
    prompts = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            prompts.append(row["input_ids"] if "input_ids" in row else row["text"])
    return prompts


def served_logprobs(client: openai.OpenAI, model: str, prompt: str | list[int]) -> list[float]:
    """The log-probability of each prompt token after the ones before it, from the server."""
    reply = client.completions.create(
        model=model, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    logprobs = reply.choices[0].logprobs
    prompt_tokens = reply.usage.prompt_tokens
    return [lp for lp in logprobs.token_logprobs[1:prompt_tokens] if lp is not None]


def hf_logprobs(model_path: str, prompts: list[list[int]]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    scores: list[float] = []
    with torch.inference_mode():
        for ids in prompts:
            tokens = torch.tensor([ids])
            logprobs = model(tokens).logits[0, :-1].float().log_softmax(-1)
            scores += logprobs.gather(-1, tokens[0, 1:, None])[:, 0].tolist()
    return scores


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--prompts", type=Path, required=True, help="JSON lines")
    parser.add_argument("--compare-hf", metavar="PATH", help="HF checkpoint to score alike")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=0)
    prompts = read_prompts(args.prompts)
    served = [lp for p in prompts for lp in served_logprobs(client, args.model, p)]
    print(f"served: {len(served)} tokens, perplexity {perplexity(served):.4f}")
    if args.compare_hf:
        if any(isinstance(p, str) for p in prompts):
            raise SystemExit("--compare-hf needs prompts given as input_ids")
        reference = hf_logprobs(args.compare_hf, prompts)  # type: ignore[arg-type]
        largest = max(abs(a - b) for a, b in zip(served, reference, strict=True))
        print(f"HF transformers: perplexity {perplexity(reference):.4f}")
        print(f"largest difference of a token's logprob: {largest:.2e}")


if __name__ == "__main__":
    main()
