"""Build modules whose parameters take no memory until the checkpoint's tensors arrive."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside the block, every parameter a module registers is moved to the meta device.

    Buffers (rotary tables, KV caches) stay real. Loading a checkpoint with ``assign=True`` then
    puts the checkpoint's own tensors in place, so the weights exist once in memory instead of
    twice (random initial values plus the checkpoint).
    """
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        with torch.no_grad():
            yield
    finally:
        nn.Module.register_parameter = original
