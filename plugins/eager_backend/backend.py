"""The eager backend: sub-models run as the PyTorch modules they are."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nxdplug.plugin_api import NotSupportedError

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig

NO_ARTEFACTS = "the eager backend runs modules as they are and writes no artefacts"


class EagerBackend:
    """Runs a model as is; there is nothing to compile and no artefact to write."""

    name = "eager"
    produces_artefacts = False
    artefact_suffix = ""

    def unavailable_reason(self) -> str | None:
        return None

    def versions(self, config: InferenceConfig) -> dict[str, str]:
        return {"torch": torch.__version__}

    def prepare(self, model: nn.Module) -> nn.Module:
        return model.eval()

    def compile_graph(
        self,
        function: nn.Module,
        example_args: tuple[Any, ...],
        output: Path,
        *,
        debug: bool,
        compiler_args: str | None,
    ) -> None:
        raise NotSupportedError(NO_ARTEFACTS)

    def embeds_weights(self, compiler_args: str | None) -> bool:
        return False

    def load_graph(self, path: Path, *, weights_in_graph: bool) -> Callable[..., torch.Tensor]:
        raise NotSupportedError(NO_ARTEFACTS)
