"""The written-out grouped attention (short steps) against PyTorch's fused attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nxdplug.modules.attention import attention_mask_4d, grouped_attention, repeat_kv


def fused_reference(q, k, v, mask):
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask
    )


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("queries", [1, 5])
def test_matches_fused_attention_with_grouped_heads(heads: int, kv_heads: int, queries: int):
    generator = torch.Generator().manual_seed(heads * 10 + queries)
    batch, keys, dim = 2, 12, 16
    q = torch.randn(batch, heads, queries, dim, generator=generator)
    k = torch.randn(batch, kv_heads, keys, dim, generator=generator)
    v = torch.randn(batch, kv_heads, keys, dim, generator=generator)
    key_mask = torch.ones(batch, keys, dtype=torch.long)
    key_mask[1, :3] = 0  # a left-padded row
    positions = torch.arange(keys - queries, keys).expand(batch, queries)
    mask = attention_mask_4d(key_mask, positions, sliding_window=None)

    written_out = grouped_attention(q, k, v, mask)
    torch.testing.assert_close(written_out, fused_reference(q, k, v, mask))


def test_a_query_that_sees_no_key_stays_finite():
    q, k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    mask = torch.zeros(1, 1, 1, 4, dtype=torch.bool)
    out = grouped_attention(q, k, v, mask)
    torch.testing.assert_close(out, v.mean(dim=2, keepdim=True).expand(1, 2, 1, 8))


def test_bfloat16_stays_within_bfloat16_tolerance_of_float32():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 1, 64, generator=generator)
    k = torch.randn(1, 2, 256, 64, generator=generator)
    v = torch.randn(1, 2, 256, 64, generator=generator)
    mask = torch.ones(1, 1, 1, 256, dtype=torch.bool)
    exact = grouped_attention(q, k, v, mask)
    low = grouped_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), exact, atol=2e-2, rtol=2e-2)


def test_long_prompts_of_different_lengths_give_hf_logits_and_tokens(tiny_checkpoint):
    """Prompts longer than the static cache's kernel takes (128 positions) go through PyTorch's
    fused kernel with causal masking; a shorter row's padding comes after its tokens, so both
    rows are HF's."""
    from transformers import AutoModelForCausalLM

    from nxdplug import HuggingFaceGenerationAdapter, NeuronConfig, from_pretrained

    path = tiny_checkpoint("llama", seed=3, initializer_range=0.15)
    lengths = (100, 150)
    settings = dict(torch_dtype="float32", batch_size=2, max_context_length=160, seq_len=176)
    app = from_pretrained(path, NeuronConfig(**settings))
    app.to_cpu()
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=generator) for n in lengths]
    ids = torch.zeros(2, max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left padding, as HF generates batches
        ids[row, -len(prompt) :], mask[row, -len(prompt) :] = prompt, 1
    with torch.inference_mode():
        ours = app(input_ids=ids, attention_mask=mask).logits[:, -1]
        for row, prompt in enumerate(prompts):
            theirs = hf(prompt[None]).logits[0, -1]
            torch.testing.assert_close(ours[row], theirs, atol=1e-4, rtol=1e-4)
            expected = hf.generate(prompt[None], max_new_tokens=8, do_sample=False)
            tokens = HuggingFaceGenerationAdapter(app).generate(
                prompt[None], max_new_tokens=8, do_sample=False
            )
            assert tokens.tolist() == expected.tolist()
            assert len(set(expected[0, len(prompt) :].tolist())) > 1  # the path varies
