"""The block KV-cache layout, prefix caching, chunked prefill and preemption, against HF.

Every greedy request must get the tokens HF's ``generate()`` gives its prompt alone, whether its
prompt starts from cached blocks (a hit ending on a block boundary or inside a block), is
encoded in chunks beside decoding requests, or is preempted and encoded again; afterwards every
block is free and no reference is left.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from nxdplug import (
    ChunkedPrefillConfig,
    HuggingFaceGenerationAdapter,
    NeuronConfig,
    OnDeviceSamplingConfig,
    from_pretrained,
)
from nxdplug.engine import Engine, SamplingSettings
from nxdplug.errors import ConfigError
from nxdplug.runtime.model_wrapper import ExtendWrapper

BLOCK = 8
SETTINGS = {
    "torch_dtype": "float32",
    "is_continuous_batching": True,
    "batch_size": 4,
    "seq_len": 64,
    "max_context_length": 32,
    "is_block_kv_layout": True,
    "pa_block_size": BLOCK,
}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama", seed=1, initializer_range=0.15)


@pytest.fixture(scope="module")
def hf(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint).eval()


@pytest.fixture(scope="module")
def solo(hf):
    """HF's greedy tokens for a prompt alone (no EOS stop), remembered."""
    seen: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def tokens(prompt: list[int], count: int) -> list[int]:
        key = (tuple(prompt), count)
        if key not in seen:
            with torch.inference_mode():
                out = hf.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=count,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            seen[key] = out[0, len(prompt) :].tolist()
        return seen[key]

    return tokens


def random_tokens(count: int, generator: torch.Generator) -> list[int]:
    return torch.randint(3, 500, (count,), generator=generator).tolist()


def app_for(checkpoint, **settings):
    app = from_pretrained(checkpoint, NeuronConfig(**(SETTINGS | settings)))
    app.to_cpu()
    return app


def run(engine: Engine, requests, arrive_every: int = 0) -> dict[str, list[int]]:
    """Serve ``requests`` ((prompt, max_tokens, extra settings) each), one arriving every
    ``arrive_every`` steps (all at once for 0); the tokens by request id, in arrival order."""
    queue, order, tokens, steps = list(requests), [], {}, 0
    while queue or engine.has_unfinished():
        while queue and (arrive_every == 0 or steps % arrive_every == 0):
            prompt, count, salt = queue.pop(0)
            order.append(engine.add_request(prompt, SamplingSettings(count, 0), cache_salt=salt))
            if arrive_every:
                break
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
        steps += 1
    return {request: tokens[request] for request in order}


def assert_all_free(engine: Engine) -> None:
    usage = engine.lines.usage()
    assert engine.lines.in_use == 0 and usage.used == 0 and usage.references == 0


def test_generate_over_blocks_gives_hf_greedy(checkpoint, solo) -> None:
    """Without an engine each row uses its own line of blocks (left padding compacted)."""
    generator = torch.Generator().manual_seed(0)
    prompts = [random_tokens(n, generator) for n in (3, 9, 17, 5)]
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = (ids != 0).long()
    app = app_for(checkpoint)
    out = HuggingFaceGenerationAdapter(app).generate(
        ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None
    )
    assert out[:, longest:].tolist() == [solo(p, 12) for p in prompts]


def test_engine_lends_blocks_as_requests_grow(checkpoint, solo) -> None:
    generator = torch.Generator().manual_seed(1)
    requests = [(random_tokens(n, generator), m, None) for n, m in ((3, 20), (12, 9), (7, 30))]
    engine = Engine(app_for(checkpoint), eos_token_ids=[])
    lent = []
    for prompt, count, _ in requests:
        engine.add_request(prompt, SamplingSettings(count, 0))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
        lent.append(engine.lines.pool.in_use)
    assert list(tokens.values()) == [solo(p, m) for p, m, _ in requests]
    # The first step holds the prompts' blocks (1 + 2 + 1 of 8 positions), later steps more as
    # the requests grow: most after 9 tokens each (12, 21 and 16 positions: 2 + 3 + 2 blocks),
    # when the second ends and gives its 3 back; whole lines would have held 3 x 8.
    assert lent[0] == 4 and max(lent) == 7
    assert_all_free(engine)


def test_prefix_hits_on_a_block_boundary_and_inside_a_block(checkpoint, solo) -> None:
    """A prompt sharing 20 tokens with a finished one finds its 2 full blocks (16 tokens);
    one sharing all 24 of a 3-block prompt and more finds 3; the last token of a prompt is
    never taken from the cache (its logits are needed), so 24 tokens alone find 2 blocks."""
    generator = torch.Generator().manual_seed(2)
    base = random_tokens(24, generator)
    requests = [
        (base, 6, None),
        (base[:20] + random_tokens(5, generator), 6, None),
        (base + random_tokens(3, generator), 6, None),
        (list(base), 6, None),
        (base[:16], 6, None),
    ]
    engine = Engine(app_for(checkpoint, is_prefix_caching=True), eos_token_ids=[])
    cached = {}
    for prompt, count, _ in requests:
        request_id = engine.add_request(prompt, SamplingSettings(count, 0))
        tokens = []
        while engine.has_unfinished():
            for output in engine.step():
                tokens += output.token_ids
                cached[request_id] = output.cached_tokens
        assert tokens == solo(prompt, count)
    assert list(cached.values()) == [0, 16, 24, 16, 8]
    usage = engine.lines.usage()
    assert (usage.prefix_queries, usage.prefix_hits) == (24 + 25 + 27 + 24 + 16, 64)
    assert_all_free(engine)


def test_an_evicted_prefix_is_encoded_again(checkpoint, solo) -> None:
    """A pool of 8 blocks: a prompt's 2 cached blocks are evicted (least recently used) by
    later requests that need the whole pool, and the prompt, asked again, is encoded whole."""
    generator = torch.Generator().manual_seed(10)
    prompt = random_tokens(20, generator)
    others = [random_tokens(30, generator) for _ in range(2)]
    engine = Engine(app_for(checkpoint, pa_num_blocks=8, is_prefix_caching=True), eos_token_ids=[])
    found = []
    for tokens_in, count in [(prompt, 4), (prompt, 4), *((o, 34) for o in others), (prompt, 4)]:
        engine.add_request(tokens_in, SamplingSettings(count, 0))
        tokens = []
        while engine.has_unfinished():
            for output in engine.step():
                tokens += output.token_ids
        assert tokens == solo(tokens_in, count)
        found.append(output.cached_tokens)
    assert found == [0, 16, 0, 0, 0]
    assert_all_free(engine)


def test_salts_never_share_blocks(checkpoint, solo) -> None:
    """The same prompt under another cache_salt (a tenant) or none finds nothing cached."""
    generator = torch.Generator().manual_seed(3)
    prompt = random_tokens(20, generator)
    engine = Engine(app_for(checkpoint, is_prefix_caching=True), eos_token_ids=[])
    found = []
    for salt in ("tenant-a", "tenant-b", None, "tenant-a"):
        request_id = engine.add_request(prompt, SamplingSettings(4, 0), cache_salt=salt)
        while engine.has_unfinished():
            for output in engine.step():
                if output.finished:
                    found.append(output.cached_tokens)
                    assert output.request_id == request_id
    assert found == [0, 0, 0, 16]
    assert_all_free(engine)


@pytest.mark.parametrize("attention", ["kernel", "gather"])
def test_preemption_recomputes_and_frees_every_block(
    checkpoint, solo, attention, monkeypatch
) -> None:
    """A pool of one sequence's blocks (8 of 8 positions) for 4 requests of up to 40
    positions: requests are preempted, encode their tokens again (past the context-encoding
    length: in chunks over the cached ones), and still get their solo tokens; attending with
    the paged kernel, or over the blocks gathered for the model's attention."""
    monkeypatch.setenv("NXDPLUG_DECODE_ATTENTION", attention)
    generator = torch.Generator().manual_seed(4)
    requests = [(random_tokens(n, generator), 24, None) for n in (10, 16, 5, 12)]
    engine = Engine(
        app_for(checkpoint, pa_num_blocks=64 // BLOCK, is_prefix_caching=True), eos_token_ids=[]
    )
    tokens = run(engine, requests)
    assert list(tokens.values()) == [solo(p, m) for p, m, _ in requests]
    assert engine.num_preemptions > 0
    assert_all_free(engine)


def test_chunked_prefill_spends_a_token_budget_beside_decoding(checkpoint, solo) -> None:
    """With a budget of 6 tokens a step, prompts are encoded in chunks that straddle block
    boundaries while earlier requests decode; no step encodes more than the budget."""
    generator = torch.Generator().manual_seed(5)
    requests = [(random_tokens(n, generator), 8, None) for n in (30, 13, 22, 4, 17)]
    app = app_for(checkpoint, is_chunked_prefill=True, max_num_batched_tokens=6)
    encoded = []

    class Runner:
        def run(self, step):
            if not (step.num_new == 1).all() or step.num_cached.eq(0).any():
                encoded.append(int(step.num_new.sum()))
            return app.run(step)

    engine = Engine(app, eos_token_ids=[], runner=Runner())
    tokens = run(engine, requests, arrive_every=2)
    assert list(tokens.values()) == [solo(p, m) for p, m, _ in requests]
    assert max(encoded) <= 6 and len(encoded) >= sum(len(p) for p, _, _ in requests) // 6
    assert_all_free(engine)


def test_only_a_steps_first_chunk_is_cut_by_the_budget(checkpoint, solo) -> None:
    """Prompts that each fit a step's budget are encoded whole: the one that does not fit
    what an earlier prompt left of the budget waits for the next step rather than being cut
    (a cut chunk and its rest would cost two padded calls)."""
    generator = torch.Generator().manual_seed(9)
    requests = [(random_tokens(5, generator), 6, None) for _ in range(4)]
    app = app_for(checkpoint, is_chunked_prefill=True, max_num_batched_tokens=8)
    encoded_rows = []

    class Runner:
        def run(self, step):
            if not (step.num_new == 1).all() or step.num_cached.eq(0).any():
                encoded_rows.extend(step.num_new.tolist())
            return app.run(step)

    engine = Engine(app, eos_token_ids=[], runner=Runner())
    tokens = run(engine, requests)
    assert list(tokens.values()) == [solo(p, m) for p, m, _ in requests]
    assert encoded_rows == [5, 5, 5, 5]
    assert_all_free(engine)


def test_randomized_requests_with_every_feature_get_their_solo_tokens(checkpoint, solo) -> None:
    """A bounded stress run: 300 requests from a fixed seed, prompts drawn from 4 shared
    prefixes and salts, arriving at random while others run, over a pool small enough to
    evict cached blocks and preempt running requests."""
    rng = random.Random(6)
    generator = torch.Generator().manual_seed(6)
    prefixes = [random_tokens(rng.randint(6, 20), generator) for _ in range(4)]
    requests = []
    for _ in range(300):
        prompt = rng.choice(prefixes)[: rng.randint(1, 20)] + random_tokens(
            rng.randint(0, 10), generator
        )
        requests.append((prompt, rng.randint(1, 20), rng.choice([None, "x"])))
    app = app_for(
        checkpoint,
        pa_num_blocks=12,
        is_prefix_caching=True,
        is_chunked_prefill=True,
        max_num_batched_tokens=10,
    )
    engine = Engine(app, eos_token_ids=[])
    tokens = run(engine, requests, arrive_every=1)
    assert list(tokens.values()) == [solo(p, m) for p, m, _ in requests]
    usage = engine.lines.usage()
    assert engine.num_preemptions > 0 and usage.prefix_hits > 0
    assert_all_free(engine)


def test_nxd_inferences_chunked_prefill_config_switches_it_on(checkpoint, solo) -> None:
    """``chunked_prefill_config`` is chunked prefill (its max_num_seqs: rows a chunk call
    encodes); a budget of 5 tokens a step splits the prompts over several steps."""
    generator = torch.Generator().manual_seed(7)
    requests = [(random_tokens(n, generator), 6, None) for n in (19, 11, 26)]
    app = app_for(
        checkpoint,
        chunked_prefill_config=ChunkedPrefillConfig(max_num_seqs=2),
        max_num_batched_tokens=5,
    )
    assert {w.batch_size for w in app.models if isinstance(w, ExtendWrapper)} == {2}
    engine = Engine(app, eos_token_ids=[])
    assert engine.batched_tokens == 5
    tokens = run(engine, requests)
    assert list(tokens.values()) == [solo(p, m) for p, m, _ in requests]
    assert_all_free(engine)


def test_on_device_sampling_in_async_mode_over_blocks(checkpoint, solo) -> None:
    """The model chooses the tokens (greedy rows of dynamic on-device sampling) and each decode
    step starts before the host handles the last one, while prompts find cached blocks, are
    encoded in chunks and requests are preempted."""
    generator = torch.Generator().manual_seed(8)
    shared = random_tokens(17, generator)
    requests = [(shared + random_tokens(n, generator), 12, None) for n in (2, 9, 4, 13)]
    app = app_for(
        checkpoint,
        on_device_sampling_config=OnDeviceSamplingConfig(dynamic=True, global_topk=32),
        async_mode=True,
        pa_num_blocks=10,
        is_prefix_caching=True,
        is_chunked_prefill=True,
        max_num_batched_tokens=7,
    )
    engine = Engine(app, eos_token_ids=[])
    tokens = run(engine, requests, arrive_every=3)
    engine.close()
    assert list(tokens.values()) == [solo(p, m) for p, m, _ in requests]
    assert engine.num_preemptions > 0 and engine.lines.usage().prefix_hits > 0
    assert_all_free(engine)


PLAIN_LINES = {
    k: v for k, v in SETTINGS.items() if k not in ("is_block_kv_layout", "pa_block_size")
}
COMPILED = {
    "is_prefix_caching": True,
    "is_chunked_prefill": True,
    "max_num_batched_tokens": 12,
    "pa_num_blocks": 10,
    "enable_bucketing": True,
    "context_encoding_buckets": [32],
    "token_generation_buckets": [64],
}


def test_compiled_graphs_take_block_tables(checkpoint, solo, tmp_path) -> None:
    """The same serving over compiled graphs (context encoding, token generation, one
    extension phase and a speculation phase, one bucket each): the block tables are a graph
    input, the blocks the graphs' state. Served with n-gram speculation, then with the
    target as its own draft (every proposal kept)."""
    generator = torch.Generator().manual_seed(9)
    shared = random_tokens(20, generator)
    requests = [(shared + random_tokens(n, generator), 10, None) for n in (1, 6, 0, 11)]
    app = from_pretrained(checkpoint, NeuronConfig(**(SETTINGS | COMPILED), speculation_length=3))
    app.compile(tmp_path, quiet=True)
    app.load(tmp_path, quiet=True)
    assert app.backend_name == "inductor"
    draft = from_pretrained(checkpoint, NeuronConfig(**PLAIN_LINES))
    draft.to_cpu()
    preemptions = []
    for config, proposer in [({"method": "ngram"}, None), ({"method": "draft_model"}, draft)]:
        engine = Engine(app, eos_token_ids=[], speculative_config=config, draft_model=proposer)
        tokens = run(engine, requests, arrive_every=2)
        assert list(tokens.values()) == [solo(p, m) for p, m, _ in requests]
        assert engine.lines.usage().prefix_hits > 0
        assert_all_free(engine)
        preemptions.append(engine.num_preemptions)
    assert preemptions[0] > 0  # few n-gram proposals: as tight as without speculation
    metrics = engine.speculation.metrics
    assert metrics.draft_tokens > 0 and metrics.accepted_tokens == metrics.draft_tokens


def test_extension_phases_follow_the_context_buckets(checkpoint) -> None:
    app = from_pretrained(
        checkpoint,
        NeuronConfig(
            **SETTINGS,
            is_prefix_caching=True,
            enable_bucketing=True,
            context_encoding_buckets=[16, 32],
            token_generation_buckets=[32, 64],
        ),
    )
    sizes = [(w.new_tokens, w.buckets) for w in app.models if isinstance(w, ExtendWrapper)]
    assert sizes == [(16, [32, 64]), (32, [32, 64])]
    chunked = NeuronConfig(
        **SETTINGS,
        is_chunked_prefill=True,
        max_num_batched_tokens=12,
        enable_bucketing=True,
        context_encoding_buckets=[8, 16, 32],
    )
    app = from_pretrained(checkpoint, chunked)
    sizes = [w.new_tokens for w in app.models if isinstance(w, ExtendWrapper)]
    assert sizes == [8, 16]  # no chunk is larger than the budget of 12


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"pa_num_blocks": 7},
            "pa_num_blocks=7 cannot hold one request of seq_len=64 positions .* raise "
            "pa_num_blocks to at least 8",
        ),
        (
            {"pa_block_size": 24},
            r"pa_block_size=24 does not divide the cache widths \[64\]",
        ),
        (
            {"is_block_kv_layout": False, "is_chunked_prefill": True},
            "is_chunked_prefill need the block KV-cache layout .* is_block_kv_layout=True",
        ),
        ({"kv_cache_quant": True}, "'block'.*'fp8'|'fp8'.*'block'"),
        (
            {"is_chunked_prefill": True, "max_num_batched_tokens": 3},
            "max_num_batched_tokens=3 is below max_batch_size=4",
        ),
        (
            {"chunked_prefill_config": {"tkg_model_enabled": False}},
            "tkg_model_enabled=False is not supported",
        ),
    ],
)
def test_bad_settings_are_one_clear_error_at_start_up(checkpoint, settings, message) -> None:
    with pytest.raises(ConfigError, match=message):
        from_pretrained(checkpoint, NeuronConfig(**(SETTINGS | settings)))
