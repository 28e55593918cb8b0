"""NeuronBaseForCausalLM behaviour: routing, buckets, padding, batches, cache state, errors."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nxdplug import HuggingFaceGenerationAdapter, NeuronConfig, from_pretrained
from nxdplug.contrib_models.llama.modeling_llama import NeuronLlamaForCausalLM
from nxdplug.errors import NotSupportedError, NxdPlugError
from nxdplug.testing import check_accuracy


@pytest.fixture(scope="module")
def llama_path(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def hf_llama(llama_path):
    return AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()


def make_app(path, **options):
    settings = {"batch_size": 2, "seq_len": 64, "max_context_length": 32, "torch_dtype": "float32"}
    app = from_pretrained(path, NeuronConfig(**(settings | options)))
    app.to_cpu()
    return app


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def right_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask


ROWS = [[5, 17, 42, 9, 300, 77, 12], [8, 250, 31, 99]]


def capture_shapes(app):
    """Record (input_ids, attention_mask) shapes of every call of the shared model."""
    shapes = []
    app.context_encoding_model.model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(
            (tuple(args[0].input_ids.shape), tuple(args[0].attention_mask.shape))
        ),
        with_kwargs=True,
    )
    return shapes


def test_application_attributes_follow_the_reference(llama_path) -> None:
    app = from_pretrained(llama_path, NeuronConfig(torch_dtype="float32", seq_len=64))
    assert isinstance(app, NeuronLlamaForCausalLM)
    assert [w.tag for w in app.models] == ["context_encoding_model", "token_generation_model"]
    assert app.model_path == str(llama_path)
    assert app.neuron_config is app.config.neuron_config
    assert (app.is_compiled, app.is_loaded_to_neuron, app.kv_cache_populated) == (
        False,
        False,
        False,
    )
    assert app.backend_name is None
    app.to_cpu()
    assert app.backend_name == "eager"


def test_smallest_bucket_that_fits_is_used(llama_path, hf_llama) -> None:
    app = make_app(
        llama_path,
        enable_bucketing=True,
        context_encoding_buckets=[8, 16, 32],
        token_generation_buckets=[16, 32, 64],
    )
    shapes = capture_shapes(app)
    ids, mask = left_padded(ROWS)
    report = check_accuracy(app, hf_llama, ids, mask, max_new_tokens=12)
    assert report.passed, report.summary()
    # The prompt (7 tokens) runs in the 8 bucket; generation reads 16, then 32 cache positions.
    assert shapes[0] == ((2, 8), (2, 8))
    assert {s for s in shapes[1:]} == {((2, 1), (2, 16)), ((2, 1), (2, 32))}


def test_batch_smaller_than_the_compiled_batch(llama_path, hf_llama) -> None:
    app = make_app(llama_path, batch_size=4)
    ids, mask = left_padded(ROWS)
    report = check_accuracy(app, hf_llama, ids, mask, max_new_tokens=10)
    assert report.passed, report.summary()


def test_batch_larger_than_the_compiled_batch_is_refused(llama_path) -> None:
    app = make_app(llama_path, batch_size=1)
    ids, mask = left_padded(ROWS)
    with pytest.raises(NxdPlugError, match=r"the KV cache holds 1 \(max_batch_size\)"):
        app(input_ids=ids, attention_mask=mask)


THREE_ROWS = [*ROWS, [61, 7, 7, 400, 2]]


@pytest.mark.parametrize(("rows", "ctx_batch_size"), [(2, 1), (3, 1), (3, 2)])
def test_a_batch_larger_than_ctx_batch_size_is_encoded_in_sub_batches(
    llama_path, rows, ctx_batch_size
) -> None:
    """Sub-batches of ctx_batch_size rows, as NxD Inference encodes them: the logits and the
    tokens of encoding each row in a call of its own (3 rows by 2: the last sub-batch repeats
    row 1, there being no free cache row to pad with)."""
    app = make_app(llama_path, batch_size=rows, ctx_batch_size=ctx_batch_size)
    shapes = capture_shapes(app)
    ids, mask = left_padded(THREE_ROWS[:rows])
    logits = app(input_ids=ids, attention_mask=mask).logits
    assert [shape[0][0] for shape in shapes] == [ctx_batch_size] * -(-rows // ctx_batch_size)
    alone = make_app(llama_path, batch_size=1)
    for row, prompt in enumerate(THREE_ROWS[:rows]):
        alone.reset()
        expected = alone(input_ids=torch.tensor([prompt])).logits
        torch.testing.assert_close(logits[row : row + 1], expected, atol=1e-5, rtol=1e-5)
    tokens = HuggingFaceGenerationAdapter(app).generate(
        ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None
    )
    whole = make_app(llama_path, batch_size=rows)
    expected = HuggingFaceGenerationAdapter(whole).generate(
        ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None
    )
    assert torch.equal(tokens, expected)
    for row, prompt in enumerate(THREE_ROWS[:rows]):
        alone.reset()
        one = HuggingFaceGenerationAdapter(alone).generate(
            torch.tensor([prompt]), max_new_tokens=8, eos_token_id=None
        )
        assert torch.equal(tokens[row, -8:], one[0, -8:])


def test_prompt_longer_than_the_largest_bucket_is_a_clear_error(llama_path) -> None:
    app = make_app(llama_path, max_context_length=8)
    ids, mask = left_padded([list(range(1, 12))])
    with pytest.raises(NxdPlugError, match=r"needs 11 positions .* largest .* bucket is 8"):
        app(input_ids=ids, attention_mask=mask)


def test_generation_past_seq_len_is_a_clear_error(llama_path) -> None:
    app = make_app(llama_path)
    ids, mask = left_padded(ROWS)
    adapter = HuggingFaceGenerationAdapter(app)
    with pytest.raises(NxdPlugError, match="seq_len=64"):
        adapter.generate(ids, attention_mask=mask, max_new_tokens=60)


def test_right_and_left_padding_give_the_same_tokens(llama_path, hf_llama) -> None:
    app = make_app(llama_path, padding_side="right")
    adapter = HuggingFaceGenerationAdapter(app)
    left = adapter.generate(
        *left_padded(ROWS)[:1], attention_mask=left_padded(ROWS)[1], max_new_tokens=8
    )
    ids, mask = right_padded(ROWS)
    right = adapter.generate(ids, attention_mask=mask, max_new_tokens=8)
    assert torch.equal(left[:, -8:], right[:, -8:])


def test_reset_and_cache_state(llama_path) -> None:
    app = make_app(llama_path)
    ids, mask = left_padded(ROWS)
    first = app(input_ids=ids, attention_mask=mask).logits
    assert app.kv_cache_populated
    cache = app.context_encoding_model.model.kv_mgr
    assert any(buffer.abs().sum() > 0 for buffer in cache.buffers())
    app.reset_kv_cache()
    assert not app.kv_cache_populated
    assert all(buffer.abs().sum() == 0 for buffer in cache.buffers())
    again = app(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(first, again)
    app.reset()
    assert not app.kv_cache_populated


def test_continuous_batching_routes_rows_by_seq_ids(llama_path, hf_llama) -> None:
    """Two sequences prefilled one at a time into cache rows 1 and 0, then decoded together."""
    app = make_app(
        llama_path,
        is_continuous_batching=True,
        batch_size=2,
        ctx_batch_size=1,
        tkg_batch_size=2,
    )
    first, second = torch.tensor([ROWS[0]]), torch.tensor([ROWS[1]])
    app(input_ids=first, seq_ids=torch.tensor([1]))
    app(input_ids=second, seq_ids=torch.tensor([0]))
    next_tokens = torch.tensor([[3], [4]])  # row 0 is cache row 0 (second), row 1 is first
    positions = torch.tensor([[len(ROWS[1])], [len(ROWS[0])]])
    logits = app(
        input_ids=next_tokens, position_ids=positions, seq_ids=torch.tensor([0, 1])
    ).logits[:, -1]

    with torch.inference_mode():
        expected_second = hf_llama(torch.tensor([ROWS[1] + [3]])).logits[0, -1]
        expected_first = hf_llama(torch.tensor([ROWS[0] + [4]])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected_second, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], expected_first, atol=1e-4, rtol=1e-4)


def test_input_capture_hook_sees_every_call(llama_path) -> None:
    app = make_app(llama_path)
    calls = []
    adapter = HuggingFaceGenerationAdapter(
        app, input_capture_hook=lambda model, inputs: calls.append(inputs[0].shape)
    )
    ids, mask = left_padded(ROWS)
    adapter.generate(ids, attention_mask=mask, max_new_tokens=5)
    assert calls == [ids.shape] + [torch.Size([2, 1])] * 4


def test_unsupported_forward_arguments_are_refused(llama_path) -> None:
    app = make_app(llama_path)
    with pytest.raises(NotSupportedError, match="inputs_embeds"):
        app(input_ids=torch.tensor([[1, 2]]), inputs_embeds=torch.zeros(1, 2, 64))


def test_state_dict_prefix_and_conversion(llama_path) -> None:
    app = from_pretrained(llama_path, NeuronConfig(torch_dtype="float32", fused_qkv=True))
    state_dict = app.get_state_dict(llama_path, app.config)
    assert "embed_tokens.weight" in state_dict and "model.embed_tokens.weight" not in state_dict
    assert "layers.0.self_attn.qkv_proj.weight" in state_dict
    assert not any(key.endswith("q_proj.weight") for key in state_dict)


TO_CPU_PEAK_SCRIPT = """
import sys
from nxdplug import NeuronConfig, from_pretrained
def peak():
    status = open("/proc/self/status").read()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024
app = from_pretrained(sys.argv[1], NeuronConfig(torch_dtype="float32", seq_len=16))
before = peak()
app.to_cpu()
print(peak() - before)
"""


def test_to_cpu_holds_the_weights_once(tmp_path) -> None:
    """Building the model allocates no parameters of its own: peak growth is one copy."""
    import subprocess
    import sys

    from safetensors.torch import save_file
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
    )
    config.save_pretrained(tmp_path)
    shapes = {"model.embed_tokens.weight": (32000, 1024), "lm_head.weight": (32000, 1024)}
    shapes["model.norm.weight"] = (1024,)
    for i in range(4):
        prefix = f"model.layers.{i}."
        shapes |= {
            prefix + "self_attn.q_proj.weight": (1024, 1024),
            prefix + "self_attn.k_proj.weight": (256, 1024),
            prefix + "self_attn.v_proj.weight": (256, 1024),
            prefix + "self_attn.o_proj.weight": (1024, 1024),
            prefix + "mlp.gate_proj.weight": (2816, 1024),
            prefix + "mlp.up_proj.weight": (2816, 1024),
            prefix + "mlp.down_proj.weight": (1024, 2816),
            prefix + "input_layernorm.weight": (1024,),
            prefix + "post_attention_layernorm.weight": (1024,),
        }
    save_file({k: torch.full(v, 0.01) for k, v in shapes.items()}, tmp_path / "model.safetensors")
    weight_bytes = sum(torch.Size(v).numel() * 4 for v in shapes.values())
    result = subprocess.run(
        [sys.executable, "-c", TO_CPU_PEAK_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    growth = int(result.stdout)
    assert growth < 1.2 * weight_bytes, f"to_cpu peaked at {growth / weight_bytes:.2f} copies"


def test_sub_models_export_with_fixed_shapes(llama_path) -> None:
    """Each phase traces with torch.export (no data-dependent Python control flow), the KV cache
    is mutated state of the graph, and token generation reads what context encoding wrote."""
    app = make_app(llama_path)
    model = app.context_encoding_model.model
    generator = torch.Generator().manual_seed(0)
    cte = app.context_encoding_model.input_generator()[0]
    cte = cte.replace(input_ids=torch.randint(1, 500, cte.input_ids.shape, generator=generator))
    tkg = app.token_generation_model.input_generator()[0]
    tkg = tkg.replace(
        input_ids=torch.randint(1, 500, tkg.input_ids.shape, generator=generator),
        position_ids=torch.full_like(tkg.position_ids, 32),  # after a full 32-token prompt
    )
    tkg.attention_mask[:, 33:] = 0

    context_graph = torch.export.export(model, (cte,), strict=False).module()
    token_graph = torch.export.export(model, (tkg,), strict=False).module()
    model.kv_mgr.reset()
    expected = [model(cte), model(tkg)]

    first = context_graph(cte)
    cache = {name: b for name, b in context_graph.named_buffers() if name.startswith("kv_mgr.")}
    assert any(b.abs().sum() > 0 for b in cache.values()), "the graph did not write the cache"
    for name, buffer in token_graph.named_buffers():
        if name in cache:
            buffer.copy_(cache[name])
    second = token_graph(tkg)
    assert torch.equal(first, expected[0])
    assert torch.equal(second, expected[1])


def test_generation_records_no_autograd_history(llama_path) -> None:
    app = make_app(llama_path)
    ids, mask = left_padded(ROWS)
    HuggingFaceGenerationAdapter(app).generate(ids, attention_mask=mask, max_new_tokens=4)
    app(input_ids=ids, attention_mask=mask)  # forward called directly, outside no_grad
    model = app.context_encoding_model.model
    assert not any(p.requires_grad for p in model.parameters())
    assert not any(b.requires_grad for b in model.kv_mgr.buffers())
