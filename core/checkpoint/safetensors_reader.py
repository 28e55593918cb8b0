"""Read a safetensors file one tensor at a time, straight into each tensor's own memory.

``safe_open`` memory-maps the whole file, and every page it touches stays resident in the process
while the file is open, so loading through it peaks near two copies of the weights (the mapped
file and the tensors). Reading each tensor's bytes with ``readinto`` peaks at one copy.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

HEADER_LIMIT = 100 * 1024 * 1024


class SafetensorsFormatError(ValueError):
    """The file is not a well-formed safetensors file."""


def read_header(handle: object, size: int) -> tuple[dict[str, dict], int]:
    """The tensor entries of the header and the offset where tensor data starts."""
    prefix = handle.read(8)
    if len(prefix) != 8:
        raise SafetensorsFormatError("file is shorter than the 8-byte header length")
    (header_length,) = struct.unpack("<Q", prefix)
    if header_length > min(HEADER_LIMIT, size - 8):
        raise SafetensorsFormatError(f"header length {header_length} does not fit the file")
    try:
        header = json.loads(handle.read(header_length))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsFormatError(f"header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise SafetensorsFormatError("header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + header_length


def _tensor_bounds(
    name: str, entry: dict, data_size: int
) -> tuple[torch.dtype, list[int], int, int]:
    try:
        dtype = DTYPES[entry["dtype"]]
        shape = [int(d) for d in entry["shape"]]
        begin, end = (int(o) for o in entry["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SafetensorsFormatError(f"bad header entry for {name!r}: {entry}") from exc
    expected = dtype.itemsize * torch.Size(shape).numel()
    if not 0 <= begin <= end <= data_size or end - begin != expected:
        raise SafetensorsFormatError(
            f"tensor {name!r} spans bytes {begin}..{end} of {data_size}; its shape and dtype "
            f"need {expected}"
        )
    return dtype, shape, begin, end


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` in file order; each tensor owns freshly read memory."""
    size = path.stat().st_size
    with path.open("rb", buffering=0) as handle:
        header, data_start = read_header(handle, size)
        entries = [
            (name, *_tensor_bounds(name, entry, size - data_start))
            for name, entry in header.items()
        ]
        for name, dtype, shape, begin, end in sorted(entries, key=lambda e: e[3]):
            raw = torch.empty(end - begin, dtype=torch.uint8)
            handle.seek(data_start + begin)
            view = memoryview(raw.numpy())
            while view:
                count = handle.readinto(view)
                if not count:
                    raise SafetensorsFormatError(f"file ends inside tensor {name!r}")
                view = view[count:]
            yield name, raw.view(dtype).reshape(shape)
