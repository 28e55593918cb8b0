from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file

from nxdplug.checkpoint import state_dict as checkpoint
from nxdplug.checkpoint.state_dict import (
    CheckpointFiles,
    check_state_dict,
    find_checkpoint,
    iter_checkpoint_tensors,
    load_into_module,
    load_state_dict,
    replace_prefix,
    save_state_dict,
)
from nxdplug.errors import CheckpointError

FILE_NAMES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def tiny_state_dict() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(10, 4, generator=gen),
        "model.norm.weight": torch.randn(4, generator=gen),
        "lm_head.weight": torch.randn(10, 4, generator=gen),
        "model.steps": torch.arange(3),
    }


def _save(state: dict[str, torch.Tensor], path: Path) -> None:
    if path.suffix == ".safetensors":
        save_file(state, path)
    else:
        torch.save(state, path)


def write_checkpoint(folder: Path, layout: str, state: dict[str, torch.Tensor]) -> None:
    """Write ``state`` in one of the four layouts; sharded ones get two shards and an index."""
    folder.mkdir(parents=True, exist_ok=True)
    if not layout.endswith(".index.json"):
        _save(state, folder / layout)
        return
    stem, ext = ("model", "safetensors") if "safetensors" in layout else ("pytorch_model", "bin")
    names = list(state)
    halves = (names[: len(names) // 2], names[len(names) // 2 :])
    weight_map = {}
    for i, half in enumerate(halves, start=1):
        shard = f"{stem}-{i:05d}-of-00002.{ext}"
        _save({n: state[n] for n in half}, folder / shard)
        weight_map.update(dict.fromkeys(half, shard))
    (folder / layout).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), name


# --- the four layouts -------------------------------------------------------------------------


@pytest.mark.parametrize("layout", FILE_NAMES)
def test_round_trip_in_each_layout(tmp_path: Path, layout: str) -> None:
    state = tiny_state_dict()
    write_checkpoint(tmp_path, layout, state)

    found = find_checkpoint(tmp_path)

    assert found.format == ("safetensors" if "safetensors" in layout else "pickle")
    if layout.endswith(".index.json"):
        assert found.index == tmp_path / layout
        assert len(found.files) == 2
    else:
        assert found == CheckpointFiles(found.format, (tmp_path / layout,), None)
    assert_same(load_state_dict(tmp_path), state)


def test_safetensors_preferred_over_pickle(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "pytorch_model.bin", {"x": torch.zeros(2)})
    write_checkpoint(tmp_path, "model.safetensors.index.json", {"x": torch.ones(2)})

    assert find_checkpoint(tmp_path).format == "safetensors"
    assert torch.equal(load_state_dict(tmp_path)["x"], torch.ones(2))


def test_legacy_pickle_format_is_read(tmp_path: Path) -> None:
    state = tiny_state_dict()
    torch.save(state, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)

    assert_same(load_state_dict(tmp_path), state)


@pytest.mark.parametrize("layout", FILE_NAMES)
def test_dtype_casts_floating_tensors_only(tmp_path: Path, layout: str) -> None:
    state = tiny_state_dict()
    write_checkpoint(tmp_path, layout, state)

    loaded = load_state_dict(tmp_path, dtype=torch.bfloat16)

    expected = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in state.items()}
    assert_same(loaded, expected)


# --- checkpoints written the way HF writes them -----------------------------------------------


@pytest.fixture(scope="module")
def hf_model() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    return transformers.LlamaForCausalLM(cfg)


def test_hf_sharded_safetensors(tmp_path: Path, hf_model: transformers.LlamaForCausalLM) -> None:
    hf_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")

    found = find_checkpoint(tmp_path)

    assert found.index == tmp_path / "model.safetensors.index.json"
    assert len(found.files) > 1
    assert_same(load_state_dict(tmp_path), hf_model.state_dict())


def test_hf_sharded_pickle(tmp_path: Path, hf_model: transformers.LlamaForCausalLM) -> None:
    # transformers 5 writes only safetensors; this is how transformers 4 wrote sharded pickles.
    hf_model.config.save_pretrained(tmp_path)
    state = hf_model.state_dict()
    split = split_torch_state_dict_into_shards(
        state, filename_pattern="pytorch_model{suffix}.bin", max_shard_size="20KB"
    )
    for file_name, names in split.filename_to_tensors.items():
        torch.save({n: state[n].contiguous() for n in names}, tmp_path / file_name)
    index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))

    found = find_checkpoint(tmp_path)

    assert found.format == "pickle"
    assert len(found.files) > 1
    assert_same(load_state_dict(tmp_path), state)
    # The files are what HF itself reads.
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert_same(reloaded.state_dict(), state)


# --- laziness ---------------------------------------------------------------------------------


def test_safetensors_tensors_are_read_one_at_a_time(tmp_path: Path) -> None:
    """Each tensor is read when it is reached: data removed from the file after the first
    tensor was yielded is missed, which a reader that loaded everything up front would not."""
    state = {f"w{i}": torch.full((64,), float(i)) for i in range(4)}
    save_file(state, tmp_path / "model.safetensors")
    tensors = iter_checkpoint_tensors(tmp_path)
    first_name, first = next(tensors)
    assert torch.equal(first, state[first_name])
    with (tmp_path / "model.safetensors").open("r+b") as handle:
        handle.truncate(handle.seek(0, 2) - 64 * 4)  # the last tensor's bytes
    with pytest.raises(CheckpointError, match="ends inside tensor 'w3'"):
        list(tensors)


# VmHWM (peak resident memory) resets at exec, unlike ru_maxrss, which a child inherits.
PEAK_MEMORY_SCRIPT = """
import sys, torch
from nxdplug.checkpoint.state_dict import load_state_dict
def peak():
    status = open("/proc/self/status").read()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024
before = peak()
state = load_state_dict(sys.argv[1])
print(peak() - before)
"""


def test_loading_peaks_near_one_copy_of_the_weights(tmp_path: Path) -> None:
    import subprocess
    import sys

    size = 256 * 1024 * 1024
    shards = {f"layer{i}.weight": torch.ones(size // 16 // 4) for i in range(16)}
    save_file(shards, tmp_path / "model.safetensors")
    del shards
    result = subprocess.run(
        [sys.executable, "-c", PEAK_MEMORY_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    growth = int(result.stdout)
    assert size * 0.9 < growth < size * 1.25, f"peak grew by {growth / size:.2f} copies"


# --- errors -----------------------------------------------------------------------------------


def test_no_checkpoint_lists_the_four_names(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        find_checkpoint(tmp_path)

    message = str(info.value)
    assert str(tmp_path) in message
    for name in FILE_NAMES:
        assert name in message


def test_index_with_missing_shard(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "pytorch_model.bin.index.json", tiny_state_dict())
    (tmp_path / "pytorch_model-00002-of-00002.bin").unlink()

    with pytest.raises(CheckpointError) as info:
        find_checkpoint(tmp_path)

    assert str(tmp_path / "pytorch_model.bin.index.json") in str(info.value)
    assert "pytorch_model-00002-of-00002.bin" in str(info.value)


def test_index_that_is_not_json(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text("{not json")

    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path))):
        find_checkpoint(tmp_path)


@pytest.mark.parametrize(
    ("layout", "damaged"),
    [
        ("model.safetensors", "model.safetensors"),
        ("model.safetensors.index.json", "model-00002-of-00002.safetensors"),
        ("pytorch_model.bin", "pytorch_model.bin"),
        ("pytorch_model.bin.index.json", "pytorch_model-00001-of-00002.bin"),
    ],
)
@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupted_file_is_named(tmp_path: Path, layout: str, damaged: str, damage: str) -> None:
    write_checkpoint(tmp_path, layout, tiny_state_dict())
    path = tmp_path / damaged
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07junk" * 50)

    with pytest.raises(CheckpointError, match=re.escape(str(path))):
        load_state_dict(tmp_path)


def test_pickle_that_is_not_a_state_dict(tmp_path: Path) -> None:
    torch.save([torch.zeros(2)], tmp_path / "pytorch_model.bin")

    with pytest.raises(CheckpointError, match="flat dict of tensors"):
        load_state_dict(tmp_path)


def test_check_state_dict_lists_every_problem_with_shapes() -> None:
    state = {
        "ok": torch.zeros(2, 3),
        "wrong": torch.zeros(4, 5),
        "extra_a": torch.zeros(7),
        "extra_b": torch.zeros(1, 1),
    }
    expected = {"ok": (2, 3), "wrong": (5, 4), "gone_a": (8,), "gone_b": (2, 2, 2)}

    with pytest.raises(CheckpointError) as info:
        check_state_dict(state, expected, "/ckpt/path")

    message = str(info.value)
    assert "/ckpt/path" in message
    assert "2 missing, 2 unexpected, 1 mis-shaped" in message
    assert "missing gone_a (expected shape [8])" in message
    assert "missing gone_b (expected shape [2, 2, 2])" in message
    assert "unexpected extra_a (shape [7])" in message
    assert "unexpected extra_b (shape [1, 1])" in message
    assert "mis-shaped wrong: expected [5, 4], found [4, 5]" in message
    assert " ok" not in message


def test_check_state_dict_accepts_a_fit() -> None:
    check_state_dict({"a": torch.zeros(2)}, {"a": (2,)}, "src")


# --- prefixes, loading into a module, saving --------------------------------------------------


def test_replace_prefix() -> None:
    state = tiny_state_dict()

    renamed = replace_prefix(state, "model.", "")

    assert list(renamed) == ["embed_tokens.weight", "norm.weight", "lm_head.weight", "steps"]
    assert renamed["norm.weight"] is state["model.norm.weight"]


def test_replace_prefix_refuses_a_collision() -> None:
    with pytest.raises(CheckpointError, match="'x'"):
        replace_prefix({"model.x": torch.zeros(1), "x": torch.zeros(1)}, "model.", "")


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)
        self.register_buffer("position", torch.zeros(5, dtype=torch.int64))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def tiny_net_weights() -> dict[str, torch.Tensor]:
    return {
        "proj.weight": torch.randn(3, 4),
        "proj.bias": torch.randn(3),
        "position": torch.arange(5),
    }


def test_load_into_module_copies_in_place() -> None:
    net = TinyNet()
    weight = net.proj.weight
    state = tiny_net_weights()

    load_into_module(net, state, "src")

    assert net.proj.weight is weight
    assert_same(net.state_dict(), state)


def test_load_into_module_casts_to_the_module_dtype() -> None:
    net = TinyNet().to(torch.float64)
    state = tiny_net_weights()

    load_into_module(net, state, "src")

    assert net.proj.weight.dtype == torch.float64
    assert torch.equal(net.proj.weight, state["proj.weight"].double())
    assert net.position.dtype == torch.int64


def test_load_into_module_with_dtype_assigns_without_copying() -> None:
    net = TinyNet()
    state = {
        n: t.to(torch.bfloat16) if t.is_floating_point() else t
        for n, t in tiny_net_weights().items()
    }

    load_into_module(net, state, "src", dtype=torch.bfloat16)

    assert net.proj.weight.dtype == torch.bfloat16
    assert isinstance(net.proj.weight, torch.nn.Parameter)
    assert net.proj.weight.requires_grad
    assert net.proj.weight.data_ptr() == state["proj.weight"].data_ptr()
    assert_same(net.state_dict(), state)


def test_load_into_meta_module() -> None:
    with torch.device("meta"):
        net = TinyNet()
    state = tiny_net_weights()

    load_into_module(net, state, "src")

    assert not net.proj.weight.is_meta
    assert_same(net.state_dict(), state)


def test_load_into_module_reports_mismatch() -> None:
    state = tiny_net_weights()
    state["proj.weight"] = torch.zeros(4, 3)
    del state["position"]

    with pytest.raises(CheckpointError) as info:
        load_into_module(TinyNet(), state, "/my/ckpt")

    assert "/my/ckpt" in str(info.value)
    assert "missing position (expected shape [5])" in str(info.value)
    assert "mis-shaped proj.weight: expected [3, 4], found [4, 3]" in str(info.value)


def test_save_state_dict_handles_shared_and_strided_tensors(tmp_path: Path) -> None:
    base = torch.randn(4, 6)
    state = {"w": base, "tied": base, "row": base[1], "transposed": base.t()}
    path = tmp_path / "model.safetensors"

    save_state_dict(state, path)

    assert_same(load_state_dict(tmp_path), {n: t.contiguous() for n, t in state.items()})
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_save_state_dict_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "model.safetensors"
    save_state_dict({"x": torch.ones(2)}, path)

    def failing_save(tensors: dict[str, torch.Tensor], filename: str, **kwargs: object) -> None:
        Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_state_dict({"x": torch.zeros(2)}, path)

    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    assert torch.equal(load_state_dict(tmp_path)["x"], torch.ones(2))
