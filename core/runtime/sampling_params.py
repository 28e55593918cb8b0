"""NxD Inference's per-row ``sampling_params``: a [batch, 3] float tensor of rows
``(top_k, top_p, temperature)``, how to build one and which values its sampler accepts."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

SamplingValues = torch.Tensor | Sequence[float] | float


def prepare_sampling_params(
    batch_size: int,
    top_k: SamplingValues = (1,),
    top_p: SamplingValues = (1.0,),
    temperature: SamplingValues = (1.0,),
) -> torch.Tensor:
    """The [batch_size, 3] ``sampling_params``: each setting one value for every row, or one
    value per row."""
    columns = {
        "top_k": _column(top_k),
        "top_p": _column(top_p),
        "temperature": _column(temperature),
    }
    lengths = {name: len(column) for name, column in columns.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"top_k, top_p and temperature must have as many values; got {lengths}")
    if len(columns["top_k"]) == 1:
        columns = {name: column.expand(batch_size) for name, column in columns.items()}
    return torch.stack(list(columns.values()), dim=1)


def _column(values: SamplingValues) -> torch.Tensor:
    column = torch.as_tensor(values, dtype=torch.float32)
    return column.reshape(1) if column.dim() == 0 else column


def validate_sampling_params(
    params: torch.Tensor, on_device_sampling_config: Mapping[str, Any] | Any
) -> None:
    """Raise ValueError unless every row of ``params`` [batch, 3] is a valid
    ``(top_k, top_p, temperature)``, each message starting as NxD Inference's does.

    As NxD Inference's sampler: ``top_k`` a whole number, -1 or 0..``global_topk`` (-1 and 0
    draw uniformly from the ``global_topk`` candidates), ``top_p`` in (0, 1], ``temperature``
    0 or more (0 is greedy, so only with a ``top_k`` of 1 or more).
    """
    if params.dim() != 2 or params.shape[1] != 3:
        raise ValueError(
            f"Expected tensor of shape (batch_size, 3), but got {params.shape}: rows "
            "(top_k, top_p, temperature)"
        )
    if isinstance(on_device_sampling_config, Mapping):
        global_topk = on_device_sampling_config["global_topk"]
    else:
        global_topk = on_device_sampling_config.global_topk
    top_k, top_p, temperature = params.to(torch.float32).unbind(dim=1)
    if not bool(((top_k == -1) | ((top_k >= 0) & (top_k <= global_topk))).all()):
        raise ValueError(
            "Invalid top-k values found. top-k must be -1 or in 0..global_topk="
            f"{global_topk}; got {top_k.tolist()}"
        )
    if not torch.equal(top_k, top_k.floor()):
        raise ValueError(
            f"Invalid top-k values found. top-k must be whole numbers; got {top_k.tolist()}"
        )
    if not bool(((top_p > 0) & (top_p <= 1)).all()):
        raise ValueError(
            f"Invalid top-p values found. top-p must be in (0, 1]; got {top_p.tolist()}"
        )
    if not bool((temperature >= 0).all()):
        raise ValueError(
            "Invalid temperature values found. Temperature must be 0 or more; got "
            f"{temperature.tolist()}"
        )
    if bool(((temperature == 0) & (top_k <= 0)).any()):
        raise ValueError(
            "Invalid sampling parameters found. Temperature = 0 enables greedy sampling: set "
            f"top_k to 1 or more; got rows {params.tolist()}"
        )


def infer_sampling_params(params: torch.Tensor) -> torch.Tensor:
    """NxD Inference's: rows with temperature 0 (greedy) get top_k and top_p 1, in place;
    returns ``params``."""
    greedy = params[:, 2] == 0
    if bool(greedy.any()):
        logger.warning("Temperature = 0 enables greedy sampling; setting top_k and top_p to 1")
        params[greedy, 0] = 1
        params[greedy, 1] = 1
    return params
