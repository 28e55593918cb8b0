"""HF checkpoints: find, read tensor by tensor, check against a model, and save.

The four layouts of the feature guide are supported, safetensors first:
``model.safetensors``, ``model.safetensors.index.json``, ``pytorch_model.bin`` and
``pytorch_model.bin.index.json`` (an index maps each tensor name to its shard file).
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import ClassVar, Literal, Protocol

import attrs
import torch
from safetensors.torch import save_file
from torch import nn

from nxdplug.checkpoint.safetensors_reader import (
    SafetensorsFormatError,
    iter_safetensors,
    read_header,
)
from nxdplug.contracts import with_defaults
from nxdplug.errors import CheckpointError

Format = Literal["safetensors", "pickle"]

# In order of preference: (file name, format, is an index).
_LAYOUTS: tuple[tuple[str, Format, bool], ...] = (
    ("model.safetensors", "safetensors", False),
    ("model.safetensors.index.json", "safetensors", True),
    ("pytorch_model.bin", "pickle", False),
    ("pytorch_model.bin.index.json", "pickle", True),
)


@attrs.frozen
class CheckpointFiles:
    """The weight files of one checkpoint folder.

    ``format`` is ``"safetensors"`` or ``"pickle"``; ``files`` are the files to read, in order;
    ``index`` is the index file of a sharded checkpoint, ``None`` for a single file.
    """

    format: Format
    files: tuple[Path, ...]
    index: Path | None = None


def find_checkpoint(model_path: str | os.PathLike[str]) -> CheckpointFiles:
    """Locate the weights in ``model_path``, preferring safetensors over pickle."""
    folder = Path(model_path)
    for name, fmt, is_index in _LAYOUTS:
        path = folder / name
        if not path.is_file():
            continue
        if is_index:
            return CheckpointFiles(fmt, _shards_of(path), path)
        return CheckpointFiles(fmt, (path,))
    names = ", ".join(name for name, _, _ in _LAYOUTS)
    where = folder if folder.is_dir() else f"{folder} (not an existing folder)"
    raise CheckpointError(
        f"no checkpoint found in {where}: looked for {names}. Convert the weights to one of "
        "these formats (safetensors recommended)."
    )


def _shards_of(index: Path) -> tuple[Path, ...]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shard_names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"cannot read checkpoint index {index}: expected JSON with a 'weight_map' object "
            f"mapping tensor names to shard files ({type(exc).__name__}: {exc})"
        ) from exc
    shards = tuple(index.parent / name for name in shard_names)
    missing = [str(shard.name) for shard in shards if not shard.is_file()]
    if missing:
        raise CheckpointError(
            f"checkpoint index {index} names shard file(s) missing from {index.parent}: "
            + ", ".join(missing)
        )
    return shards


def iter_checkpoint_tensors(
    model_path: str | os.PathLike[str], dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` one at a time, floating tensors cast to ``dtype`` when given.

    Safetensors files are read one tensor at a time straight into that tensor's memory, and
    pickle files are memory-mapped where the file allows it, so peak host memory stays near one
    copy of the weights even when the caller keeps every tensor.
    """
    checkpoint = find_checkpoint(model_path)
    read = _iter_safetensors if checkpoint.format == "safetensors" else _iter_pickle
    for path in checkpoint.files:
        for name, tensor in read(path):
            yield name, _cast(tensor, dtype)


def checkpoint_tensor_names(model_path: str | os.PathLike[str]) -> tuple[str, ...]:
    """The names of a checkpoint's tensors, read from its index or safetensors headers without
    reading any tensor; empty for a single pickle file (which would have to be loaded)."""
    checkpoint = find_checkpoint(model_path)
    if checkpoint.index is not None:
        return tuple(json.loads(checkpoint.index.read_text())["weight_map"])
    if checkpoint.format != "safetensors":
        return ()
    (path,) = checkpoint.files
    try:
        with path.open("rb") as handle:
            header, _ = read_header(handle, path.stat().st_size)
    except (SafetensorsFormatError, OSError) as exc:
        raise _unreadable(path, exc) from exc
    return tuple(header)


COMPUTE_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def is_castable(dtype: torch.dtype) -> bool:
    """Whether a tensor of ``dtype`` follows the model's torch_dtype: 16-64-bit floats do;
    integers and 8-bit floats (quantized weights) keep their dtype."""
    return dtype in COMPUTE_FLOATS


class DtypeKeeping(Protocol):
    """What loading asks of a module about its tensors' dtypes."""

    keeps_dtype: ClassVar[tuple[str, ...]] = ()
    """The parameters and buffers that keep the dtype the module gives them whatever the
    model's torch_dtype (a quantized layer's float32 scales, as HF's
    ``_keep_in_fp32_modules`` keeps modules); none by default."""


def dtype_keeping_names(module: nn.Module) -> set[str]:
    """The parameters and buffers of ``module`` and its children that keep their dtype
    (:attr:`DtypeKeeping.keeps_dtype`), by their names in ``module``."""
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, child in module.named_modules()
        for name in with_defaults(child, DtypeKeeping).keeps_dtype
    }


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None or not is_castable(tensor.dtype):
        return tensor
    return tensor.to(dtype)


def _unreadable(path: Path, exc: Exception) -> CheckpointError:
    return CheckpointError(
        f"cannot read checkpoint file {path}; it may be corrupted or truncated "
        f"({type(exc).__name__}: {exc})"
    )


def _iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        yield from iter_safetensors(path)
    except (SafetensorsFormatError, OSError) as exc:
        raise _unreadable(path, exc) from exc


def _iter_pickle(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    # Only the zip format (torch >= 1.6) can be memory-mapped; the legacy format is read whole.
    try:
        state = torch.load(
            path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path)
        )
    except Exception as exc:  # torch raises many types for a bad file; all mean the same here
        raise _unreadable(path, exc) from exc
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise CheckpointError(f"checkpoint file {path} does not hold a flat dict of tensors")
    # Popping lets a tensor the caller casts or drops be freed before the next one is read.
    for name in list(state):
        yield name, state.pop(name)


def load_tensor_file(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors (or ``.pt``/``.bin`` pickle) file."""
    path = Path(path)
    read = _iter_pickle if path.suffix in PICKLE_SUFFIXES else _iter_safetensors
    return dict(read(path))


def load_state_dict(
    model_path: str | os.PathLike[str], dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Read the whole checkpoint in ``model_path`` into a dict."""
    state_dict: dict[str, torch.Tensor] = {}
    for name, tensor in iter_checkpoint_tensors(model_path, dtype):
        if name in state_dict:
            raise CheckpointError(f"tensor {name!r} appears twice in the checkpoint {model_path}")
        state_dict[name] = tensor
    return state_dict


def replace_prefix(
    state_dict: Mapping[str, torch.Tensor], old_prefix: str, new_prefix: str
) -> dict[str, torch.Tensor]:
    """Rename keys starting with ``old_prefix``; other keys are kept as they are.

    NxD Inference strips HF's ``"model."`` this way (``_STATE_DICT_MODEL_PREFIX`` to
    ``_NEW_STATE_DICT_MODEL_PREFIX``). A rename that lands on an existing key is an error.
    """
    renamed: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        new_name = new_prefix + name[len(old_prefix) :] if name.startswith(old_prefix) else name
        if new_name in renamed:
            raise CheckpointError(
                f"replacing prefix {old_prefix!r} with {new_prefix!r} gives the key {new_name!r} "
                "twice"
            )
        renamed[new_name] = tensor
    return renamed


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    expected: Mapping[str, tuple[int, ...]],
    source: str,
) -> None:
    """Raise one CheckpointError listing every missing, unexpected and mis-shaped tensor."""
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    misshaped = sorted(
        name
        for name in set(expected) & set(state_dict)
        if tuple(state_dict[name].shape) != tuple(expected[name])
    )
    if not (missing or unexpected or misshaped):
        return
    lines = [f"  missing {name} (expected shape {_shape(expected[name])})" for name in missing]
    lines += [
        f"  unexpected {name} (shape {_shape(tuple(state_dict[name].shape))})"
        for name in unexpected
    ]
    lines += [
        f"  mis-shaped {name}: expected {_shape(tuple(expected[name]))}, "
        f"found {_shape(tuple(state_dict[name].shape))}"
        for name in misshaped
    ]
    raise CheckpointError(
        f"checkpoint {source} does not fit the model: {len(missing)} missing, "
        f"{len(unexpected)} unexpected, {len(misshaped)} mis-shaped tensor(s):\n" + "\n".join(lines)
    )


def load_into_module(
    module: torch.nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    source: str,
    dtype: torch.dtype | None = None,
) -> None:
    """Check ``state_dict`` against ``module`` and load it.

    Floating tensors end up in ``dtype``, or in the dtype the module already has. When that keeps
    every dtype and the module is materialized, the weights are copied into the existing storage
    (ties between parameters survive); otherwise (a new dtype, or a module on the meta device)
    the checkpoint tensors are assigned as they are, cast only where the dtype differs.
    """
    current = module.state_dict()
    check_state_dict(state_dict, {name: tuple(t.shape) for name, t in current.items()}, source)
    kept = dtype_keeping_names(module)
    assign = any(
        t.is_meta
        or (dtype is not None and name not in kept and is_castable(t.dtype) and t.dtype != dtype)
        for name, t in current.items()
    )
    if assign:
        state_dict = {
            name: _to_module(tensor, current[name], None if name in kept else dtype)
            for name, tensor in state_dict.items()
        }
    module.load_state_dict(state_dict, strict=True, assign=assign)


def _to_module(
    tensor: torch.Tensor, current: torch.Tensor, dtype: torch.dtype | None
) -> torch.Tensor:
    device = tensor.device if current.is_meta else current.device
    if is_castable(tensor.dtype) and is_castable(current.dtype):
        return tensor.to(device=device, dtype=dtype or current.dtype)
    return tensor.to(device=device)


PICKLE_SUFFIXES = (".pt", ".bin")


def save_state_dict(state_dict: Mapping[str, torch.Tensor], path: str | os.PathLike[str]) -> None:
    """Write ``state_dict`` as one file, atomically: pickle for a ``.pt``/``.bin`` path (as
    NxD Inference's quantized checkpoints), safetensors otherwise.

    Tensors are made contiguous, and tensors sharing storage (tied weights, views) are cloned,
    which safetensors requires.
    """
    target = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    seen_storage: set[tuple[torch.device, int]] = set()
    for name, tensor in state_dict.items():
        tensor = tensor.detach().contiguous()
        storage = (tensor.device, tensor.untyped_storage().data_ptr())
        if storage in seen_storage:
            tensor = tensor.clone()
        else:
            seen_storage.add(storage)
        tensors[name] = tensor
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        if target.suffix in PICKLE_SUFFIXES:
            torch.save(tensors, tmp)
        else:
            save_file(tensors, tmp, metadata={"format": "pt"})
        os.chmod(tmp, 0o644)  # mkstemp makes the file private; weights are ordinary files
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
