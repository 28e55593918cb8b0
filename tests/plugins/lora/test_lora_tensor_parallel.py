"""Multi-LoRA with tensor parallelism and fused QKV, against PEFT's mixed batch.

The checkpoint has one K/V head, so with tp_degree=2 the K/V heads are replicated to two and
the k/v adapters' B matrices must follow. Two ranks (gloo, one process each, as in
test_tensor_parallel) serve a mixed batch with ``lora_shard_linear_layer`` True (eager) and False
with fused QKV (compiled and loaded), then load a third adapter into a slot; every rank's tokens
must be PEFT's. One process checks the same layouts without a launch (tp_degree then only
sets the head layout).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from nxdplug import HuggingFaceGenerationAdapter, LoraServingConfig, NeuronConfig, from_pretrained
from nxdplug.testing import end_rank_process
from tests.core.modules.test_tensor_parallel import become_launched_rank, free_port

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "code": {"r": 4, "lora_alpha": 8, "target_modules": ALL},
    "chat": {
        "r": 8,
        "lora_alpha": 4,
        "use_rslora": True,
        "target_modules": ["q_proj", "v_proj", "down_proj"],
    },
    "math": {"r": 2, "lora_alpha": 4, "target_modules": ["k_proj", "o_proj", "up_proj"]},
}
PROMPTS = torch.tensor([[5, 9, 13, 2, 8], [0, 0, 7, 3, 11], [0, 4, 4, 20, 6]])
MASK = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
ROWS = ["code", "chat", None]
LOADED_ROWS = ["math", None, "code"]  # math is loaded at run time
NEW_TOKENS = 12
# (name, lora_shard_linear_layer, fused_qkv, compiled) of the two-rank runs
RUNS = [("sharded", True, False, False), ("whole-fused", False, True, True)]


def make_app(checkpoint, paths, tp_degree=2, dynamic=False, compiled=None, **settings):
    """Eager, or compiled into the folder ``compiled`` and loaded from it."""
    lora = LoraServingConfig(
        max_loras=2,
        max_lora_rank=8,
        lora_ckpt_paths=paths,
        enable_dynamic_multi_lora=dynamic,
        lora_shard_linear_layer=settings.pop("shard", True),
    )
    config = NeuronConfig(
        torch_dtype="float32",
        batch_size=3,
        seq_len=32,
        tp_degree=tp_degree,
        lora_config=lora,
        **settings,
    )
    app = from_pretrained(checkpoint, config)
    if compiled is None:
        app.to_cpu()
    else:
        app.compile(compiled, quiet=True)
        app.load(compiled, quiet=True)
    return app


def generate(app, rows):
    adapter = HuggingFaceGenerationAdapter(app)
    return adapter.generate(
        PROMPTS, attention_mask=MASK, adapter_ids=rows, max_new_tokens=NEW_TOKENS
    )


def _rank(rank: int, world: int, port: int, checkpoint: str, paths: dict, out: str) -> None:
    become_launched_rank(rank, world, port)
    from nxdplug.plugins.lora.store import load_adapter

    two = {name: paths[name] for name in ("code", "chat")}
    for name, shard, fused, compiled in RUNS:
        folder = Path(out) / f"{name}-compiled" if compiled else None
        app = make_app(checkpoint, two, shard=shard, fused_qkv=fused, compiled=folder)
        assert app.backend_name == ("inductor" if compiled else "eager")
        torch.save(generate(app, ROWS), Path(out) / f"{name}-{rank}.pt")
        shapes = {k: tuple(t.shape) for k, t in app.weight_tensors().items() if "lora_" in k}
        torch.save(shapes, Path(out) / f"{name}-shapes-{rank}.pt")
    app = make_app(checkpoint, {"code": paths["code"]}, dynamic=True, fused_qkv=True)
    load_adapter(app, "math", paths["math"])
    torch.save(generate(app, LOADED_ROWS), Path(out) / f"loaded-{rank}.pt")
    end_rank_process()


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    from tests.plugins.lora.test_lora import save_adapters

    checkpoint = tiny_checkpoint("llama", initializer_range=0.15, num_key_value_heads=1)
    folder = tmp_path_factory.mktemp("adapters")
    return checkpoint, save_adapters(checkpoint, folder, ADAPTERS, first_seed=20)


@pytest.fixture(scope="module")
def peft_tokens(adapters):
    """PEFT's greedy tokens for a request's adapters (None: the base model)."""
    from peft import PeftModel

    from tests.plugins.lora.test_lora import hf_model

    checkpoint, paths = adapters
    model = PeftModel.from_pretrained(hf_model(checkpoint), paths["code"], adapter_name="code")
    for name in ("chat", "math"):
        model.load_adapter(paths[name], adapter_name=name)

    def tokens(rows):
        with torch.no_grad():
            return model.eval().generate(
                input_ids=PROMPTS,
                attention_mask=MASK,
                adapter_names=[row or "__base__" for row in rows],
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
            )

    return tokens


def test_the_adapters_change_a_varied_greedy_path(peft_tokens) -> None:
    ours, base = peft_tokens(ROWS), peft_tokens([None, None, None])
    assert len(set(ours[0, PROMPTS.shape[1] :].tolist())) > 2
    assert not torch.equal(ours[0], base[0]) and not torch.equal(ours[1], base[1])
    loaded = peft_tokens(LOADED_ROWS)
    assert not torch.equal(loaded[0], base[0])


@pytest.mark.parametrize("fused_qkv", [False, True])
def test_one_process_with_the_tp_head_layout_gives_peft_tokens(adapters, peft_tokens, fused_qkv):
    checkpoint, paths = adapters
    app = make_app(checkpoint, {n: paths[n] for n in ("code", "chat")}, fused_qkv=fused_qkv)
    assert app.weight_tensors()["layers.0.self_attn.o_proj.lora_a"].shape == (3, 8, 64)
    assert torch.equal(generate(app, ROWS), peft_tokens(ROWS))


@pytest.mark.slow
def test_two_ranks_give_peft_tokens(adapters, peft_tokens, tmp_path) -> None:
    checkpoint, paths = adapters
    mp.spawn(
        _rank, args=(2, free_port(), str(checkpoint), paths, str(tmp_path)), nprocs=2, join=True
    )
    for rank in range(2):
        for name, *_ in RUNS:
            assert torch.equal(torch.load(tmp_path / f"{name}-{rank}.pt"), peft_tokens(ROWS)), (
                name,
                rank,
            )
        loaded = torch.load(tmp_path / f"loaded-{rank}.pt")
        assert torch.equal(loaded, peft_tokens(LOADED_ROWS)), rank
    # 3 slots, rank 8; hidden 64 (o_proj's input split: 32 a rank); q 64 + k 32 + v 32 rows
    # (one K/V head replicated to two), the fused qkv's rank three times 8; B rank-major
    # (lora_memory_transpose, the default).
    sharded = torch.load(tmp_path / "sharded-shapes-0.pt")
    assert sharded["layers.0.self_attn.o_proj.lora_a"] == (3, 8, 32)
    assert sharded["layers.0.self_attn.k_proj.lora_b"] == (3, 8, 16)
    whole = torch.load(tmp_path / "whole-fused-shapes-0.pt")
    assert whole["layers.0.self_attn.o_proj.lora_a"] == (3, 8, 64)
    assert whole["layers.0.self_attn.qkv_proj.lora_b"] == (3, 24, 128)
