"""Multi-LoRA on a quantized base model (``quantized=True``, ``base_model_quantized=True``).

The oracle is PEFT's mixed batch on an HF model whose projection weights are replaced by the
quantized checkpoint's, dequantized as the quantization plugin does (``dequantize_weight`` in
float32): the same base numbers, so tokens must be equal and logits equal up to float32
rounding. The logits are also checked to be far from PEFT's on the float32 weights, so the base
model really is the quantized one.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from peft import PeftModel

from nxdplug import (
    HuggingFaceGenerationAdapter,
    LoraServingConfig,
    NeuronConfig,
    load_pretrained_config,
)
from nxdplug.contrib_models.llama.modeling_llama import (
    LlamaInferenceConfig,
    NeuronLlamaForCausalLM,
)
from nxdplug.errors import ConfigError
from nxdplug.modules.parallel_linear import ColumnParallelLinear, RowParallelLinear
from nxdplug.modules.step import StepInputs, running
from nxdplug.pipeline import config_problems
from nxdplug.plugins.lora.layers import LoraDelta, add_lora_delta
from nxdplug.plugins.lora.layout import Placement
from nxdplug.plugins.quantization.kernel import tile_rows
from nxdplug.plugins.quantization.layers import QuantizedWeight, hold_quantized
from nxdplug.plugins.quantization.methods import (
    QUANTIZED_DTYPES,
    dequantize_weight,
    quantize_weight,
)
from nxdplug.testing import end_rank_process
from tests.core.modules.test_tensor_parallel import become_launched_rank, free_port
from tests.plugins.lora.test_lora import (
    ADAPTERS,
    MASK,
    NEW_TOKENS,
    PROMPTS,
    ROWS,
    hf_model,
    save_adapters,
)

METHODS = [
    ("int8", "per_channel"),
    ("int8", "per_tensor"),
    ("f8e4m3", "per_channel"),
    ("f8e4m3", "per_tensor"),
]


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    checkpoint = tiny_checkpoint("llama", initializer_range=0.15)
    return checkpoint, save_adapters(checkpoint, tmp_path_factory.mktemp("adapters"), ADAPTERS)


def lora_config(paths, base_model_quantized=True) -> LoraServingConfig:
    return LoraServingConfig(
        max_loras=2,
        max_lora_rank=8,
        lora_ckpt_paths=paths,
        base_model_quantized=base_model_quantized,
    )


def quantized_config(checkpoint, paths, path: Path, dtype: str, granularity: str, **options):
    neuron_config = NeuronConfig(
        torch_dtype="float32",
        batch_size=3,
        seq_len=32,
        quantized=True,
        quantized_checkpoints_path=str(path),
        quantization_dtype=dtype,
        quantization_type=f"{granularity}_symmetric",
        lora_config=lora_config(paths),
        **options,
    )
    return LlamaInferenceConfig(neuron_config, load_config=load_pretrained_config(checkpoint))


def quantized_app(checkpoint, config) -> NeuronLlamaForCausalLM:
    NeuronLlamaForCausalLM.save_quantized_state_dict(checkpoint, config)
    return NeuronLlamaForCausalLM(checkpoint, config)


def dequantized_peft(checkpoint, paths, config, quantized=True) -> PeftModel:
    """PEFT with both adapters on the HF model, its base weights the dequantized checkpoint's
    (or, without ``quantized``, the float32 ones)."""
    model = hf_model(checkpoint)
    if quantized:
        state = NeuronLlamaForCausalLM.generate_quantized_state_dict(checkpoint, config)
        weights = {
            key: dequantize_weight(tensor, state[f"{key}_scale"].reshape(-1), torch.float32)
            if f"{key}_scale" in state
            else tensor
            for key, tensor in state.items()
            if not key.endswith("_scale")
        }
        model.load_state_dict(weights, strict=True)
    peft = PeftModel.from_pretrained(model, paths["code"], adapter_name="code")
    peft.load_adapter(paths["chat"], adapter_name="chat")
    return peft.eval()


NAMES = [row or "__base__" for row in ROWS]


def peft_tokens(oracle: PeftModel) -> torch.Tensor:
    with torch.no_grad():
        return oracle.generate(
            input_ids=PROMPTS,
            attention_mask=MASK,
            adapter_names=NAMES,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
        )


def peft_logits(oracle: PeftModel) -> torch.Tensor:
    with torch.no_grad():
        return oracle(input_ids=PROMPTS, attention_mask=MASK, adapter_names=NAMES).logits[:, -1]


def generate(app, rows=ROWS) -> torch.Tensor:
    return HuggingFaceGenerationAdapter(app).generate(
        PROMPTS, attention_mask=MASK, adapter_ids=rows, max_new_tokens=NEW_TOKENS
    )


@pytest.mark.parametrize(("dtype", "granularity"), METHODS)
def test_mixed_batch_on_quantized_base_equals_peft_on_dequantized_weights(
    adapters, tmp_path, dtype, granularity
) -> None:
    checkpoint, paths = adapters
    config = quantized_config(checkpoint, paths, tmp_path / "q", dtype, granularity)
    app = quantized_app(checkpoint, config)
    app.to_cpu()
    attention = app.loaded_model.layers[0].self_attn
    for projection in (attention.q_proj, attention.o_proj):
        assert isinstance(projection.weight_method, QuantizedWeight)
        assert [type(delta) for delta in projection.output_deltas] == [LoraDelta]
        assert projection.weight.dtype == QUANTIZED_DTYPES[dtype]
        assert projection.lora_a.dtype == torch.float32

    oracle = dequantized_peft(checkpoint, paths, config)
    ours = generate(app)
    assert torch.equal(ours, peft_tokens(oracle))
    base = generate(app, rows=None)
    assert torch.equal(base[2], ours[2])  # the row without an adapter is the quantized base's
    assert not torch.equal(base[0], ours[0]) and not torch.equal(base[1], ours[1])

    logits = app(input_ids=PROMPTS, attention_mask=MASK, adapter_ids=ROWS).logits[:, -1]
    torch.testing.assert_close(logits, peft_logits(oracle), atol=1e-4, rtol=1e-4)
    on_float32 = peft_logits(dequantized_peft(checkpoint, paths, config, quantized=False))
    assert (logits - on_float32).abs().max() > 1e-3  # the base weights are the quantized ones


def test_fused_qkv_on_quantized_base_equals_peft(adapters, tmp_path) -> None:
    """Per-tensor q/k/v scales become one per row of the fused projection; the fused adapters
    (A stacked, B block diagonal) sit on top."""
    checkpoint, paths = adapters
    config = quantized_config(
        checkpoint, paths, tmp_path / "q", "int8", "per_tensor", fused_qkv=True
    )
    app = quantized_app(checkpoint, config)
    app.to_cpu()
    assert isinstance(app.loaded_model.layers[0].self_attn.qkv_proj.weight_method, QuantizedWeight)
    assert torch.equal(generate(app), peft_tokens(dequantized_peft(checkpoint, paths, config)))


def test_compiled_graphs_on_quantized_base(adapters, tmp_path) -> None:
    checkpoint, paths = adapters
    config = quantized_config(checkpoint, paths, tmp_path / "q", "f8e4m3", "per_channel")
    app = quantized_app(checkpoint, config)
    app.compile(tmp_path / "compiled", quiet=True)
    app.load(tmp_path / "compiled", quiet=True)
    assert app.backend_name == "inductor"
    assert torch.equal(generate(app), peft_tokens(dequantized_peft(checkpoint, paths, config)))


@pytest.mark.parametrize("linear", [ColumnParallelLinear, RowParallelLinear])
@pytest.mark.parametrize("lora_first", [True, False])
@pytest.mark.parametrize("tokens", [1, 40])
def test_lora_adds_its_delta_over_an_int8_weight(linear, lora_first, tokens) -> None:
    """LoRA then quantization (the plugins' order today) or the other way, for a decoding step
    (the int8 matmul's few rows) and a prompt (the dequantized weight's GEMM): the int8 base
    product plus each row's adapter term, slot 0 adding nothing."""
    generator = torch.Generator().manual_seed(0)
    in_features, out_features, rank = 64, 12, 4
    quantized, scale = quantize_weight(
        torch.randn(out_features, in_features, generator=generator), torch.int8, True
    )
    a = torch.randn(3, rank, in_features, generator=generator).index_fill(0, torch.tensor(0), 0)
    b = torch.randn(3, out_features, rank, generator=generator).index_fill(0, torch.tensor(0), 0)
    lora_scale = torch.tensor([0.0, 0.5, 2.0])

    layer = linear(in_features, out_features)
    name = "q_proj" if linear is ColumnParallelLinear else "o_proj"
    where = Placement(row_parallel=linear is RowParallelLinear)
    lora = SimpleNamespace(max_lora_rank=rank)
    config = SimpleNamespace(neuron_config=SimpleNamespace(lora_config=lora))
    steps = [
        lambda: add_lora_delta(name, layer, where, 3, config),
        lambda: hold_quantized(layer, torch.int8, row_scales=True),
    ]
    for step in steps if lora_first else steps[::-1]:
        step()
    full = {"weight": tile_rows(quantized), "weight_scale": scale}
    layer.load_state_dict(
        layer.shard_state_dict(full | {"lora_a": a, "lora_b": b, "lora_scale": lora_scale})
    )

    x = torch.randn(3, tokens, in_features, generator=generator)
    slots = torch.tensor([1, 0, 2])
    step = StepInputs(*[torch.zeros(3, tokens)] * 3, slots, extra={"adapter_ids": slots})
    with running(step):
        out = layer(x)
    base = F.linear(x, dequantize_weight(quantized, scale, torch.float32))
    delta = (x @ a[slots].transpose(1, 2) @ b[slots].transpose(1, 2)) * lora_scale[
        slots, None, None
    ]
    torch.testing.assert_close(out, base + delta, atol=1e-4, rtol=1e-4)
    assert torch.equal(out[1], layer.weight_method.apply(layer, x, None)[1])  # slot 0: + 0


# (dtype, granularity, fused_qkv) of the two-rank runs: per-channel scales split with their
# rows; per-tensor q/k/v scales, one per row once fused, split part by part.
TWO_RANK_RUNS = [("int8", "per_channel", False), ("f8e4m3", "per_tensor", True)]


def _rank(rank: int, world: int, port: int, checkpoint: str, paths: dict, out: str) -> None:
    become_launched_rank(rank, world, port)
    for dtype, granularity, fused in TWO_RANK_RUNS:
        path = Path(out) / f"{dtype}-{granularity}"
        config = quantized_config(
            checkpoint, paths, path, dtype, granularity, fused_qkv=fused, tp_degree=world
        )
        app = NeuronLlamaForCausalLM(checkpoint, config)
        app.to_cpu()
        torch.save(generate(app), Path(out) / f"{dtype}-{granularity}-{rank}.pt")
        held = {k: (t.dtype, tuple(t.shape)) for k, t in app.weight_tensors().items()}
        torch.save(held, Path(out) / f"{dtype}-{granularity}-held-{rank}.pt")
    end_rank_process()


@pytest.mark.slow
def test_two_ranks_on_quantized_base_give_peft_tokens(adapters, tmp_path) -> None:
    checkpoint, paths = adapters
    expected = {}
    for dtype, granularity, fused in TWO_RANK_RUNS:
        path = tmp_path / f"{dtype}-{granularity}"
        config = quantized_config(checkpoint, paths, path, dtype, granularity, fused_qkv=fused)
        NeuronLlamaForCausalLM.save_quantized_state_dict(checkpoint, config)
        expected[dtype, granularity] = peft_tokens(dequantized_peft(checkpoint, paths, config))
    mp.spawn(
        _rank, args=(2, free_port(), str(checkpoint), paths, str(tmp_path)), nprocs=2, join=True
    )
    for (dtype, granularity), tokens in expected.items():
        for rank in range(2):
            ours = torch.load(tmp_path / f"{dtype}-{granularity}-{rank}.pt")
            assert torch.equal(ours, tokens), (dtype, granularity, rank)
    # hidden 64 split over two ranks: o_proj holds 32 input columns of 8 bits a rank; q/k/v
    # rows (64 + 32 + 32, fused) and their per-row scales are halved.
    held = torch.load(tmp_path / "f8e4m3-per_tensor-held-1.pt")
    assert held["layers.0.self_attn.o_proj.weight"] == (torch.float8_e4m3fn, (64, 32))
    assert held["layers.0.self_attn.qkv_proj.weight_scale"] == (torch.float32, (64,))
    held = torch.load(tmp_path / "int8-per_channel-held-0.pt")
    assert held["layers.0.self_attn.q_proj.weight_scale"] == (torch.float32, (32,))
    assert held["layers.0.self_attn.o_proj.lora_a"] == (torch.float32, (3, 8, 32))


def test_base_model_quantized_must_say_what_quantized_says(adapters, tmp_path) -> None:
    checkpoint, paths = adapters
    config = quantized_config(checkpoint, paths, tmp_path / "q", "int8", "per_channel")
    NeuronLlamaForCausalLM.save_quantized_state_dict(checkpoint, config)
    attributes = load_pretrained_config(checkpoint)

    def problems(**options) -> str:
        neuron_config = NeuronConfig(torch_dtype="float32", batch_size=3, seq_len=32, **options)
        return "\n".join(
            config_problems(LlamaInferenceConfig(neuron_config, load_config=attributes))
        )

    quantized = {"quantized": True, "quantized_checkpoints_path": str(tmp_path / "q")}
    assert problems(lora_config=lora_config(paths), **quantized) == ""
    assert problems(lora_config=lora_config(paths, base_model_quantized=False)) == ""
    unsaid = problems(lora_config=lora_config(paths, base_model_quantized=False), **quantized)
    assert "quantized=True quantizes the base model, but" in unsaid
    assert "base_model_quantized is False" in unsaid
    unmet = problems(lora_config=lora_config(paths))
    assert "base_model_quantized=True says the base model is quantized, but quantized" in unmet
    speculating = problems(
        lora_config=lora_config(paths),
        is_medusa=True,
        medusa_speculation_length=4,
        num_medusa_heads=4,
        medusa_tree=[[0], [1]],
        **quantized,
    )
    assert "speculation (medusa) with lora_config is not implemented yet" in speculating
    lfu_config = lora_config(paths)
    lfu_config.eviction_policy = "lfu"
    lfu = problems(lora_config=lfu_config, **quantized)
    assert "eviction_policy='lfu' with lora_config is not implemented yet" in lfu

    config.neuron_config.lora_config.base_model_quantized = False
    with pytest.raises(ConfigError, match="set base_model_quantized=True"):
        NeuronLlamaForCausalLM(checkpoint, config)


def test_the_command_line_sets_base_model_quantized_from_quantized(adapters, tmp_path, capsys):
    from nxdplug.cli.main import main

    checkpoint, paths = adapters
    config = quantized_config(checkpoint, paths, tmp_path / "q", "int8", "per_channel")
    NeuronLlamaForCausalLM.save_quantized_state_dict(checkpoint, config)
    quantized = {
        "quantized": "true",
        "quantized_checkpoints_path": str(tmp_path / "q"),
        "quantization_dtype": "int8",
        "quantization_type": "per_channel_symmetric",
    }
    code = main(
        ["check-config", "--model-path", str(checkpoint)]
        + [arg for key, value in quantized.items() for arg in ("--neuron-config", f"{key}={value}")]
        + ["--lora-ckpt-paths", *(f"{name}={path}" for name, path in paths.items())]
    )
    listing = capsys.readouterr().out
    assert code == 0, listing
    assert "multi-lora" in listing and "weight-quantization" in listing
