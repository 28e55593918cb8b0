"""``nxdplug serve --enable-prefix-caching``: a chat's later turns find the shared system prompt
in the cache (OpenAI's ``usage.prompt_tokens_details.cached_tokens``, vLLM's metrics), and get
HF transformers' greedy replies; another ``cache_salt`` finds nothing."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from test_serving import (  # noqa: E402
    MODEL,
    chat_prompt_ids,
    checkpoint,  # noqa: F401 (a fixture)
    greedy,  # noqa: F401 (a fixture)
    hf_model,  # noqa: F401 (a fixture)
    metric,
    running_server,
    tokenizer,  # noqa: F401 (a fixture)
    wait_until_idle,
)

BLOCK = 16
SYSTEM = "You answer questions about Python modules, briefly and with one example each. " * 3


def common_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


def test_later_turns_find_the_system_prompt_cached(checkpoint, tokenizer, greedy) -> None:  # noqa: F811
    options = ("--seq-len", "256", "--batch-size", "4", "--enable-prefix-caching")
    with running_server(checkpoint, *options, "--block-size", str(BLOCK)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        first = None
        expected_hits, queried = 0, 0
        for question, salt in [("os", None), ("sys", None), ("re", None), ("os", "tenant-b")]:
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"What is {question} for?"},
            ]
            prompt_ids = chat_prompt_ids(tokenizer, messages)
            extra = {"ignore_eos": True} | ({"cache_salt": salt} if salt else {})
            reply = client.chat.completions.create(
                model=MODEL, messages=messages, max_completion_tokens=8, temperature=0,
                extra_body=extra,
            )  # fmt: skip
            assert reply.choices[0].message.content == greedy(prompt_ids, 8)
            cached = reply.usage.prompt_tokens_details.cached_tokens
            if first is None or salt is not None:
                assert cached == 0
            else:  # the full blocks of the shared prefix (never the prompt's last token)
                shared = min(common_prefix(first, prompt_ids), len(prompt_ids) - 1)
                assert cached == shared // BLOCK * BLOCK > 0
            first = first or prompt_ids
            expected_hits += cached
            queried += len(prompt_ids)
        wait_until_idle(base)
        assert metric(base, "nxdplug:prefix_cache_hits_total") == expected_hits
        assert metric(base, "nxdplug:prefix_cache_queries_total") == queried
        assert metric(base, "nxdplug:kv_cache_usage_perc") == 0
        assert metric(base, "nxdplug:num_preemptions_total") == 0
