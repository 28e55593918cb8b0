"""Dynamic multi-LoRA: more adapters than slots, served in turn, without recompiling.

Three PEFT adapters, two slots (``max_loras=2``) and room for two on the host
(``max_cpu_loras=2``); PEFT's mixed-batch generation with the same adapters is the oracle.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel

from nxdplug import HuggingFaceGenerationAdapter, LoraServingConfig, NeuronConfig, from_pretrained
from nxdplug.errors import NotSupportedError, NxdPlugError
from nxdplug.plugins.lora.store import adapter_store, load_adapter, unload_adapter
from tests.plugins.lora.test_lora import hf_model, save_adapters

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "code": {"r": 4, "lora_alpha": 8, "target_modules": ALL},
    "chat": {"r": 8, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    "math": {"r": 2, "lora_alpha": 2, "target_modules": ["o_proj", "up_proj"]},
}
PROMPTS = torch.tensor([[5, 9, 13, 2, 8], [0, 0, 7, 3, 11], [0, 4, 4, 20, 6]])
MASK = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
NEW_TOKENS = 10


def three_adapters(tiny_checkpoint, tmp_path_factory) -> tuple:
    """A tiny checkpoint and the three PEFT adapters of ``ADAPTERS`` for it, by name."""
    checkpoint = tiny_checkpoint("llama", initializer_range=0.15)
    folder = tmp_path_factory.mktemp("adapters")
    return checkpoint, save_adapters(checkpoint, folder, ADAPTERS, first_seed=10)


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    return three_adapters(tiny_checkpoint, tmp_path_factory)


def peft_with_adapters(checkpoint, paths) -> PeftModel:
    """PEFT on HF transformers holding every adapter of ``paths`` (the oracle)."""
    first, *others = paths
    model = PeftModel.from_pretrained(hf_model(checkpoint), paths[first], adapter_name=first)
    for name in others:
        model.load_adapter(paths[name], adapter_name=name)
    return model.eval()


@pytest.fixture(scope="module")
def peft_outputs(adapters):
    """PEFT's tokens for a request's adapters (None: the base model)."""
    model = peft_with_adapters(*adapters)

    def generate(rows):
        names = [row or "__base__" for row in rows]
        with torch.no_grad():
            return model.generate(
                input_ids=PROMPTS,
                attention_mask=MASK,
                adapter_names=names,
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
            )

    return generate


def make_app(checkpoint, paths, dynamic=True):
    lora = LoraServingConfig(
        max_loras=2,
        max_cpu_loras=2,
        max_lora_rank=8,
        enable_dynamic_multi_lora=dynamic,
        lora_ckpt_paths=paths,
    )
    config = NeuronConfig(torch_dtype="float32", batch_size=3, seq_len=32, lora_config=lora)
    return from_pretrained(checkpoint, config)


def generate(app, rows):
    adapter = HuggingFaceGenerationAdapter(app)
    return adapter.generate(
        PROMPTS, attention_mask=MASK, adapter_ids=rows, max_new_tokens=NEW_TOKENS
    )


def test_adapters_take_turns_in_the_slots_without_recompiling(adapters, peft_outputs, tmp_path):
    checkpoint, paths = adapters
    app = make_app(checkpoint, {"code": paths["code"], "chat": paths["chat"]})
    app.compile(tmp_path / "compiled", quiet=True)
    app.load(tmp_path / "compiled", quiet=True)
    graphs = [wrapper.model.graphs for wrapper in app.models]
    store = adapter_store(app)
    assert store.slot_of == {"code": 1, "chat": 2}

    load_adapter(app, "math", paths["math"])
    assert list(store.on_host) == ["math"]  # checked and held, no slot yet
    # math needs a slot: code is pinned by the request, so chat (least recent) gives way.
    for rows in (["math", "code", None], ["chat", None, "math"], ["code", "chat", "code"]):
        assert torch.equal(generate(app, rows), peft_outputs(rows)), rows
    assert [wrapper.model.graphs for wrapper in app.models] == graphs  # nothing recompiled
    # Slots after the three requests: math evicted chat, then chat evicted code (math was
    # pinned), then code evicted math.
    assert store.slot_of == {"chat": 1, "code": 2}
    assert list(store.on_host) == ["chat", "code"]  # two on the host, the oldest dropped


def test_unloading_frees_the_slot_and_forgets_the_adapter(adapters, peft_outputs) -> None:
    checkpoint, paths = adapters
    app = make_app(checkpoint, {"code": paths["code"]})
    app.to_cpu()
    load_adapter(app, "chat", paths["chat"])
    assert torch.equal(generate(app, ["chat", "code", None]), peft_outputs(["chat", "code", None]))
    unload_adapter(app, "chat")
    with pytest.raises(NxdPlugError, match=r"names \['chat'\], not among the served adapters"):
        generate(app, ["chat", None, None])
    slot_rows = [t[2] for k, t in app.weight_tensors().items() if k.endswith(".lora_b")]
    assert all(not row.any() for row in slot_rows)  # chat's slot (2) holds zeros again
    assert torch.equal(generate(app, [None, "code", None]), peft_outputs([None, "code", None]))


def test_requests_and_loads_that_cannot_be_served_are_refused(adapters, tiny_checkpoint) -> None:
    checkpoint, paths = adapters
    app = make_app(checkpoint, {"code": paths["code"]})
    app.to_cpu()
    load_adapter(app, "chat", paths["chat"])
    load_adapter(app, "math", paths["math"])
    with pytest.raises(NxdPlugError, match="uses 3 adapters but there are max_loras=2 slots"):
        generate(app, ["chat", "math", "code"])
    with pytest.raises(NxdPlugError, match="'code' is loaded already"):
        load_adapter(app, "code", paths["code"])
    static = make_app(checkpoint, {"code": paths["code"]}, dynamic=False)
    static.to_cpu()
    with pytest.raises(NotSupportedError, match="needs LoraServingConfig\\(enable_dynamic"):
        load_adapter(static, "chat", paths["chat"])
    other = tiny_checkpoint("llama", hidden_size=48, intermediate_size=96)
    small = make_app(other, {})
    small.to_cpu()
    with pytest.raises(NxdPlugError, match="it was trained for another model"):
        load_adapter(small, "code", paths["code"])


def test_host_listed_adapters_are_swapped_in_when_asked_for(adapters, peft_outputs) -> None:
    checkpoint, paths = adapters
    lora = LoraServingConfig(
        max_loras=1,
        max_lora_rank=8,
        enable_dynamic_multi_lora=True,
        lora_ckpt_paths={"code": paths["code"]},
        lora_ckpt_paths_cpu={"chat": paths["chat"], "math": paths["math"]},
    )
    config = NeuronConfig(torch_dtype="float32", batch_size=3, seq_len=32, lora_config=lora)
    app = from_pretrained(checkpoint, config)
    app.to_cpu()
    for rows in (["math", None, "math"], [None, "chat", None], ["code", "code", None]):
        assert torch.equal(generate(app, rows), peft_outputs(rows)), rows
    assert adapter_store(app).slot_of == {"code": 1}
