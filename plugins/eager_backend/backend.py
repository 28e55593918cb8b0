"""The eager backend: sub-models run as the PyTorch modules they are."""

from __future__ import annotations

from torch import nn


class EagerBackend:
    """Runs a model as is; there is nothing to compile and no artefact to write."""

    name = "eager"

    def prepare(self, model: nn.Module) -> nn.Module:
        return model.eval()
