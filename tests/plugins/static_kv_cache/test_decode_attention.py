"""The static cache's decode attention (``plugins/static_kv_cache/decode_attention.cpp``) against
the model's own attention over the gathered lines (``grouped_attention``): head sizes of the
vector path and of the portable loop, grouped query heads, several queries a row, masks with
holes and rows that see no key, lines in any order; the paged twin against the same attention
over the blocks gathered through the block tables; and the cache computing it in place."""

from __future__ import annotations

import pytest
import torch

from nxdplug.errors import NxdPlugError
from nxdplug.modules.attention import NeuronAttentionBase, grouped_attention
from nxdplug.modules.kv_cache import CacheLayout, CacheSlot
from nxdplug.plugins.static_kv_cache import cache as static_cache
from nxdplug.plugins.static_kv_cache.cache import KERNEL_MAX_QUERIES, StaticKVCache
from nxdplug.plugins.static_kv_cache.kernel import decode_attention_op, paged_decode_attention_op
from tests.fresh_process import cpu_has, run_and_load

TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1e-2}


@pytest.fixture(scope="module")
def kernel():
    op = decode_attention_op()
    assert op is not None, "the decode attention kernel did not build (see the warning)"
    return op


def operands(batch, heads, kv_heads, queries, dim, keys, dtype, seed=0):
    """q, K and V caches of 6 lines x 160 positions, the batch's lines (in no order), and a
    causal mask whose rows start at different positions (left padding)."""
    generator = torch.Generator().manual_seed(seed)
    positions = 160
    q = torch.randn(batch, heads, queries, dim, generator=generator).to(dtype)
    k_cache = torch.randn(6, kv_heads, positions, dim, generator=generator).to(dtype)
    v_cache = torch.randn(6, kv_heads, positions, dim, generator=generator).to(dtype)
    seq_ids = torch.randperm(6, generator=generator)[:batch]
    last = torch.randint(queries - 1, keys, (batch,), generator=generator)
    first = torch.randint(0, 4, (batch,), generator=generator)
    key_positions = torch.arange(keys)
    query_positions = last[:, None] - queries + 1 + torch.arange(queries)
    mask = (key_positions <= query_positions[:, :, None]) & (key_positions >= first[:, None, None])
    return q, k_cache, v_cache, seq_ids, mask[:, None]


def reference(q, k_cache, v_cache, seq_ids, mask):
    keys = mask.shape[-1]
    return grouped_attention(q, k_cache[seq_ids, :, :keys], v_cache[seq_ids, :, :keys], mask)


def assert_matches(out, expected, dtype):
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "queries", "dim", "keys"),
    [
        (12, 4, 1, 64, 128),  # the ~120M Llama decoding
        (4, 4, 1, 16, 37),
        (8, 2, 5, 128, 160),  # speculation: 5 queries a row, the mask as wide as the cache
        (6, 3, 3, 32, 50),
        (4, 1, 2, 256, 21),
        (4, 2, 1, 8, 30),  # head sizes the vector path does not take: the portable loop
        (6, 2, 4, 24, 70),
    ],
)
def test_the_kernel_is_the_models_attention_over_the_gathered_lines(
    kernel, dtype, heads, kv_heads, queries, dim, keys
) -> None:
    q, k_cache, v_cache, seq_ids, mask = operands(4, heads, kv_heads, queries, dim, keys, dtype)
    out = kernel(q, k_cache, v_cache, seq_ids, mask, dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert_matches(out, reference(q, k_cache, v_cache, seq_ids, mask), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_holes_in_the_mask_and_a_query_seeing_nothing(kernel, dtype) -> None:
    """A tree of speculated tokens sees some positions and not others; a query that may see no
    key gets the mean of the mask's positions, as the model's softmax over equal scores does."""
    q, k_cache, v_cache, seq_ids, _ = operands(3, 4, 2, 4, 64, 40, dtype, seed=1)
    mask = torch.rand(3, 1, 4, 40, generator=torch.Generator().manual_seed(2)) < 0.3
    mask[1, 0, 2] = False
    out = kernel(q, k_cache, v_cache, seq_ids, mask, 0.125)
    expected = reference(q, k_cache, v_cache, seq_ids, mask)
    assert_matches(out, expected, dtype)
    mean = v_cache[seq_ids[1], :, :40].float().mean(dim=1)  # [kv_heads, dim]
    torch.testing.assert_close(out[1, :, 2].float(), mean.repeat_interleave(2, 0), **_loose(dtype))


def _loose(dtype):
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    return {"rtol": tolerance, "atol": tolerance}


def test_rows_sharing_a_line_read_the_same_keys(kernel) -> None:
    q, k_cache, v_cache, _, mask = operands(3, 4, 2, 1, 64, 30, torch.float32)
    seq_ids = torch.tensor([4, 4, 1])
    out = kernel(q, k_cache, v_cache, seq_ids, mask, 0.125)
    assert_matches(out, reference(q, k_cache, v_cache, seq_ids, mask), torch.float32)


def test_bad_operands_are_refused(kernel) -> None:
    q, k_cache, v_cache, seq_ids, mask = operands(2, 4, 2, 1, 16, 20, torch.float32)
    with pytest.raises(RuntimeError, match="must have one dtype"):
        kernel(q.bfloat16(), k_cache, v_cache, seq_ids, mask, 0.25)
    with pytest.raises(RuntimeError, match=r"seq_ids\[1\] = 6 is not a cache line"):
        kernel(q, k_cache, v_cache, torch.tensor([0, 6]), mask, 0.25)
    with pytest.raises(RuntimeError, match="keys <= positions"):
        kernel(q, k_cache, v_cache, seq_ids, torch.ones(2, 1, 1, 161, dtype=torch.bool), 0.25)
    with pytest.raises(RuntimeError, match="divide into the K/V heads"):
        kernel(q[:, :3], k_cache, v_cache, seq_ids, mask, 0.25)
    with pytest.raises(RuntimeError, match="contiguous caches"):
        kernel(q, k_cache.transpose(2, 3), v_cache.transpose(2, 3), seq_ids, mask, 0.25)


@pytest.fixture(scope="module")
def paged_kernel():
    op = paged_decode_attention_op()
    assert op is not None, "the paged decode attention kernel did not build (see the warning)"
    return op


def paged_operands(heads, kv_heads, queries, dim, keys, block_size, dtype, seed=0):
    """operands()' q and mask for 4 rows, K and V blocks, and block tables: blocks in random
    order, rows 0 and 1 sharing their first blocks, a column past the mask's width holding no
    block (not read), the table a column slice of a wider tensor (not contiguous)."""
    q, _, _, _, mask = operands(4, heads, kv_heads, queries, dim, keys, dtype, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    covered = -(-keys // block_size)
    blocks = 4 * covered + 3
    k_blocks = torch.randn(blocks, kv_heads, block_size, dim, generator=generator).to(dtype)
    v_blocks = torch.randn(blocks, kv_heads, block_size, dim, generator=generator).to(dtype)
    wide = torch.full((4, covered + 2), -1, dtype=torch.long)
    wide[:, 1 : covered + 1] = torch.randperm(blocks, generator=generator)[: 4 * covered].view(
        4, -1
    )
    wide[1, 1 : 1 + (covered + 1) // 2] = wide[0, 1 : 1 + (covered + 1) // 2]
    wide[:, -1] = blocks + 7
    return q, k_blocks, v_blocks, wide[:, 1:], mask


def paged_reference(q, k_blocks, v_blocks, block_tables, mask):
    keys = mask.shape[-1]
    covered = -(-keys // k_blocks.shape[2])

    def gathered(blocks):
        rows = blocks[block_tables[:, :covered]]  # [batch, covered, kv_heads, block_size, dim]
        batch, _, kv_heads, _, dim = rows.shape
        return rows.transpose(1, 2).reshape(batch, kv_heads, -1, dim)[:, :, :keys]

    return grouped_attention(q, gathered(k_blocks), gathered(v_blocks), mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "queries", "dim", "keys", "block_size"),
    [
        (12, 4, 1, 64, 128, 32),  # the ~120M Llama decoding, blocks of 32
        (12, 4, 1, 64, 100, 16),
        (8, 2, 5, 128, 160, 32),  # speculation: 5 queries a row
        (6, 3, 3, 32, 50, 16),
        (4, 1, 2, 256, 45, 16),
        (4, 4, 1, 16, 37, 8),  # blocks of fewer than 16: scored one key at a time
        (6, 2, 4, 64, 70, 24),  # 16 keys at a time, then 8 one by one, each block
        (4, 2, 1, 8, 30, 16),  # head sizes the vector path does not take: the portable loop
        (6, 2, 4, 24, 70, 8),
    ],
)
def test_the_paged_kernel_is_the_models_attention_over_the_gathered_blocks(
    paged_kernel, dtype, heads, kv_heads, queries, dim, keys, block_size
) -> None:
    inputs = paged_operands(heads, kv_heads, queries, dim, keys, block_size, dtype)
    out = paged_kernel(*inputs, dim**-0.5)
    assert out.dtype == dtype and out.shape == inputs[0].shape
    assert_matches(out, paged_reference(*inputs), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 32])
def test_paged_holes_in_the_mask_and_a_query_seeing_nothing(
    paged_kernel, dtype, block_size
) -> None:
    q, k_blocks, v_blocks, block_tables, _ = paged_operands(
        4, 2, 4, 64, 40, block_size, dtype, seed=1
    )
    mask = torch.rand(4, 1, 4, 40, generator=torch.Generator().manual_seed(2)) < 0.3
    mask[1, 0, 2] = False
    mask[3] = False  # a row that sees no key
    inputs = q, k_blocks, v_blocks, block_tables, mask
    out = paged_kernel(*inputs, 0.125)
    assert_matches(out, paged_reference(*inputs), dtype)
    for row, query in ((1, 2), (3, 0), (3, 3)):
        blocks = v_blocks[block_tables[row, : -(-40 // block_size)]]  # [n, kv_heads, bs, dim]
        mean = blocks.transpose(0, 1).flatten(1, 2)[:, :40].float().mean(dim=1)
        torch.testing.assert_close(
            out[row, :, query].float(), mean.repeat_interleave(2, 0), **_loose(dtype)
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32, 160])
def test_lines_cut_into_blocks_give_the_static_kernels_bits(
    kernel, paged_kernel, dtype, block_size
) -> None:
    """The static cache's lines as blocks of a multiple of 16 positions (or one block a line):
    the same keys scored 16 at a time and the same sums, so the same bits."""
    q, k_cache, v_cache, seq_ids, mask = operands(4, 8, 2, 3, 64, 150, dtype)
    lines, kv_heads, positions, dim = k_cache.shape
    per_line = positions // block_size

    def as_blocks(cache):
        cut = cache.view(lines, kv_heads, per_line, block_size, dim).transpose(1, 2)
        return cut.reshape(lines * per_line, kv_heads, block_size, dim)

    block_tables = seq_ids[:, None] * per_line + torch.arange(per_line)
    paged = paged_kernel(q, as_blocks(k_cache), as_blocks(v_cache), block_tables, mask, 0.125)
    assert torch.equal(paged, kernel(q, k_cache, v_cache, seq_ids, mask, 0.125))


def test_bad_paged_operands_are_refused(paged_kernel) -> None:
    q, k_blocks, v_blocks, block_tables, mask = paged_operands(4, 2, 1, 16, 40, 16, torch.float32)
    tables = block_tables.clone()
    tables[2, 1] = 15
    with pytest.raises(RuntimeError, match=r"block_tables\[2, 1\] = 15 is not a block"):
        paged_kernel(q, k_blocks, v_blocks, tables, mask, 0.25)
    tables = block_tables.clone()
    tables[0, 2] = -1
    with pytest.raises(RuntimeError, match=r"block_tables\[0, 2\] = -1 is not a block"):
        paged_kernel(q, k_blocks, v_blocks, tables, mask, 0.25)
    wide_mask = torch.ones(4, 1, 1, 65, dtype=torch.bool)
    with pytest.raises(RuntimeError, match=r"keys <= blocks_per_row \* block_size"):
        paged_kernel(q, k_blocks, v_blocks, block_tables, wide_mask, 0.25)
    with pytest.raises(RuntimeError, match="must have one dtype"):
        paged_kernel(q.bfloat16(), k_blocks, v_blocks, block_tables, mask, 0.25)
    with pytest.raises(RuntimeError, match=r"block_tables \[batch, blocks_per_row\] int64"):
        paged_kernel(q, k_blocks, v_blocks, block_tables.int(), mask, 0.25)
    with pytest.raises(RuntimeError, match="contiguous blocks"):
        kv = k_blocks.transpose(2, 3), v_blocks.transpose(2, 3)
        paged_kernel(q, *kv, block_tables, mask, 0.25)


FORCED_RUN = """
import sys
import torch
from nxdplug.plugins.static_kv_cache.kernel import decode_attention_op
from tests.plugins.static_kv_cache.test_decode_attention import forced_operands
torch.save(decode_attention_op()(*forced_operands(sys.argv[2]), 128**-0.5), sys.argv[1])
"""


def forced_operands(dtype_name: str):
    """bfloat16: queries of bf16 denormals (below 1.2e-38) and keys near bf16's largest values,
    whose products are ordinary floats: AVX512-BF16's pair products read such queries as zero,
    widening to float32 keeps them (as the model's attention does)."""
    q, k_cache, v_cache, seq_ids, mask = operands(4, 8, 2, 5, 128, 160, getattr(torch, dtype_name))
    if dtype_name == "bfloat16":
        q, k_cache = (q.float() * 1e-39).bfloat16(), (k_cache.float() * 5e37).bfloat16()
    return q, k_cache, v_cache, seq_ids, mask


@pytest.mark.parametrize(
    ("variable", "dtype", "cpu_flags"),
    [
        # the plain loop, for CPUs without AVX-512
        ("NXDPLUG_DECODE_ATTENTION_PORTABLE", torch.float32, ("avx512f", "avx512bw", "avx512vl")),
        # bf16 keys widened to float32, for CPUs with AVX-512 but not AVX512-BF16
        ("NXDPLUG_DECODE_ATTENTION_WIDEN_BF16", torch.bfloat16, ("avx512_bf16",)),
    ],
)
def test_the_paths_of_other_cpus_forced_on_this_one(
    kernel, tmp_path, variable, dtype, cpu_flags
) -> None:
    """Each variable in a fresh process: the model's attention, not this CPU's bits (which
    would mean that the forced path did not run; where this CPU lacks the flags it is the same
    path)."""
    name = str(dtype).removeprefix("torch.")
    forced = run_and_load(FORCED_RUN, tmp_path, name, **{variable: "1"})
    inputs = forced_operands(name)
    assert_matches(forced, reference(*inputs), dtype)
    assert not torch.equal(forced, kernel(*inputs, 128**-0.5)) or not cpu_has(*cpu_flags)


def slot_operands(dtype, queries=1):
    layout = CacheLayout(1, 4, 2, 32, 16, dtype)
    cache = StaticKVCache(layout)
    generator = torch.Generator().manual_seed(3)
    for buffer in cache.buffers():
        buffer.copy_(torch.randn(buffer.shape, generator=generator).to(dtype))
    seq_ids = torch.tensor([3, 0])
    positions = torch.tensor([[9], [4]]) + torch.arange(queries)
    q = torch.randn(2, 4, queries, 16, generator=generator).to(dtype)
    key = torch.randn(2, 2, queries, 16, generator=generator).to(dtype)
    keys = torch.arange(16)
    mask = (keys <= positions[:, :, None])[:, None]
    return cache, CacheSlot(cache, 0, positions, seq_ids, 16), q, key, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cache_stores_then_attends_in_place(dtype) -> None:
    """Decoding through the static cache: the same cache contents as update_and_read leaves,
    and the model's attention over the positions it would have read."""
    cache, slot, q, key, mask = slot_operands(dtype)
    twin = StaticKVCache(cache.layout)
    twin.k_0.copy_(cache.k_0)
    twin.v_0.copy_(cache.v_0)
    out = slot.store_and_attend(q, key, key * 2, mask)
    keys, values = CacheSlot(twin, 0, slot.position_ids, slot.seq_ids, 16).store_and_fetch(
        key, key * 2
    )
    assert torch.equal(cache.k_0, twin.k_0) and torch.equal(cache.v_0, twin.v_0)
    assert_matches(out, grouped_attention(q, keys, values, mask), dtype)


def test_what_the_kernel_does_not_take_is_left_to_the_model(monkeypatch) -> None:
    """More queries than KERNEL_MAX_QUERIES (prompts), float16, a query dtype other than the
    cache's, NXDPLUG_DECODE_ATTENTION=gather, a kernel that did not build: None, and nothing
    stored."""

    def assert_left(dtype, queries=1, q_dtype=None) -> None:
        cache, slot, q, key, mask = slot_operands(dtype, queries)
        before = cache.k_0.clone()
        assert slot.store_and_attend(q.to(q_dtype or dtype), key, key, mask) is None
        assert torch.equal(cache.k_0, before)

    assert_left(torch.float32, queries=KERNEL_MAX_QUERIES + 1)
    assert_left(torch.float16)
    assert_left(torch.bfloat16, q_dtype=torch.float32)
    monkeypatch.setenv(static_cache.SWITCH, "gather")
    assert_left(torch.float32)
    monkeypatch.delenv(static_cache.SWITCH)
    monkeypatch.setattr(static_cache, "decode_attention_op", lambda: None)
    assert_left(torch.float32)


def test_the_switch_takes_kernel_or_gather(monkeypatch) -> None:
    _, slot, q, key, mask = slot_operands(torch.float32)
    monkeypatch.setenv(static_cache.SWITCH, "kernel")
    assert slot.store_and_attend(q, key, key, mask) is not None
    monkeypatch.setenv(static_cache.SWITCH, "fast")
    with pytest.raises(NxdPlugError, match="NXDPLUG_DECODE_ATTENTION='fast': expected 'kernel'"):
        slot.store_and_attend(q, key, key, mask)


def test_a_model_that_weighs_keys_otherwise_keeps_its_attention() -> None:
    """gpt-oss adds learned sinks to the softmax: its layers never take the cache's kernel."""
    from nxdplug.contrib_models.gpt_oss.modeling_gpt_oss import NeuronGptOssAttention

    plain = NeuronAttentionBase.attends_by_plain_softmax.fget
    assert not plain(object.__new__(NeuronGptOssAttention))
    assert plain(object.__new__(NeuronAttentionBase))


def test_a_llama_decodes_and_encodes_short_prompts_through_the_kernel(
    tiny_checkpoint, kernel, monkeypatch
) -> None:
    """Each decode step calls the kernel once a layer (HF parity of such models is checked in
    test_model_parity), and so does a prompt of up to KERNEL_MAX_QUERIES positions; a longer
    prompt does not."""
    from nxdplug import HuggingFaceGenerationAdapter, NeuronConfig, from_pretrained

    calls = []
    monkeypatch.setattr(
        static_cache,
        "decode_attention_op",
        lambda: lambda q, *rest: calls.append(q.shape[2]) or kernel(q, *rest),
    )
    checkpoint = tiny_checkpoint("llama", num_hidden_layers=2)
    longest = 2 * KERNEL_MAX_QUERIES
    buckets = {"context_encoding_buckets": [16, longest], "token_generation_buckets": [longest]}
    settings = {"batch_size": 1, "seq_len": longest, "torch_dtype": "float32"}
    app = from_pretrained(checkpoint, NeuronConfig(**settings, enable_bucketing=True, **buckets))
    app.to_cpu()
    adapter = HuggingFaceGenerationAdapter(app)
    for length, prompt_calls in ((KERNEL_MAX_QUERIES + 1, []), (10, [16] * 2)):
        calls.clear()
        prompt = torch.arange(3, 3 + length)[None]
        adapter.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4)
        assert calls == prompt_calls + [1] * 2 * 3, length


def test_a_folder_compiled_without_the_kernel_is_not_taken_for_one_with_it(
    tiny_checkpoint, tmp_path, monkeypatch
) -> None:
    """How decoding attends is part of a compiled folder's hash: graphs traced over gathered
    lines are refused, naming it, by a process that would trace them with the kernel."""
    from nxdplug import NeuronConfig, from_pretrained
    from nxdplug.compile.artefacts import Manifest

    checkpoint = tiny_checkpoint("llama", num_hidden_layers=1)
    config = NeuronConfig(batch_size=1, seq_len=16, torch_dtype="float32")
    monkeypatch.setenv(static_cache.SWITCH, "gather")
    from_pretrained(checkpoint, config).compile(tmp_path, quiet=True)
    variant = Manifest.read(tmp_path).versions["kv_cache"]
    assert variant == "decode attention over gathered lines (NXDPLUG_DECODE_ATTENTION=gather)"
    monkeypatch.delenv(static_cache.SWITCH)
    with pytest.raises(NxdPlugError, match=r"versions\.kv_cache"):
        from_pretrained(checkpoint, config).load(tmp_path, quiet=True)
