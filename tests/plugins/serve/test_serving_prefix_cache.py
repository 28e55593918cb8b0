"""``nxdplug serve``'s prefix caching, on by default as vLLM's: a chat's later turns find the
shared system prompt in the cache (OpenAI's ``usage.prompt_tokens_details.cached_tokens``,
vLLM's metrics), and get HF transformers' greedy replies; another ``cache_salt`` finds nothing.
Where the block layout it needs would make the config invalid, the server starts without it
and says why."""

from __future__ import annotations

import pytest

from nxdplug.cli.main import build_parser
from nxdplug.cli.options import neuron_config_kwargs
from nxdplug.plugins.serve.cli import SERVE_DEFAULTS, _serving_config

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from tests.plugins.serve.test_serving import (  # noqa: E402
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
    options = ("--seq-len", "256", "--batch-size", "4")  # prefix caching: the default
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


def serving_config(checkpoint, *options: str):  # noqa: F811
    args = build_parser().parse_args(["serve", "--model-path", str(checkpoint), *options])
    return _serving_config(args, SERVE_DEFAULTS | neuron_config_kwargs(args))


@pytest.mark.parametrize(
    ("options", "prefix_caching", "blocks"),
    [
        ((), True, True),
        (("--no-enable-prefix-caching",), False, False),
        (("--neuron-config", "is_prefix_caching=false"), False, True),
        (("--neuron-config", "is_block_kv_layout=false"), False, False),
        (("--enable-chunked-prefill",), True, True),
    ],
)
def test_prefix_caching_is_on_unless_a_setting_says(
    checkpoint,  # noqa: F811
    options,
    prefix_caching,
    blocks,
) -> None:
    neuron_config = serving_config(checkpoint, "--seq-len", "256", *options).neuron_config
    assert getattr(neuron_config, "is_prefix_caching", False) is prefix_caching
    assert getattr(neuron_config, "is_block_kv_layout", False) is blocks


def test_a_config_the_block_layout_refuses_starts_without_it(checkpoint, capsys) -> None:  # noqa: F811
    """seq_len 200 is no multiple of the 32-position blocks: the lines serve, and the start-up
    log says why prefix caching is off; asked for by name, it is refused."""
    neuron_config = serving_config(checkpoint, "--seq-len", "200").neuron_config
    assert not getattr(neuron_config, "is_block_kv_layout", False)
    assert (
        "not turning on is_block_kv_layout=True, is_prefix_caching=True by default: "
        "pa_block_size=32 does not divide the cache widths [200]" in capsys.readouterr().err
    )
    assert serving_config(checkpoint, "--seq-len", "200", "--log-level", "warning")
    assert capsys.readouterr().err == ""
