"""A request's logits adjusted before its token is chosen: ``logit_bias``, ``min_tokens`` and
the repetition, frequency and presence penalties, in vLLM's order (bias and the ``min_tokens``
mask first, then the penalties), and last the structured output's mask.
:class:`~nxdplug.engine.requests.SamplingSettings` says what each one means."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from nxdplug.engine.requests import Request


def adjusted_logits(
    requests: Sequence[Request], logits: torch.Tensor, eos_token_ids: Collection[int]
) -> torch.Tensor:
    """``logits`` [rows, vocab] with each request's adjustments made to its row: a float32 copy
    when any request adjusts, ``logits`` itself when none does."""
    rows = [i for i, request in enumerate(requests) if request.settings.adjustments()]
    if not rows:
        return logits
    adjusted = logits.float().clone()
    for index in rows:
        adjust_row(adjusted[index], requests[index], eos_token_ids)
    return adjusted


def adjust_row(row: torch.Tensor, request: Request, eos_token_ids: Collection[int]) -> None:
    """Adjust one request's float32 logits [vocab] in place."""
    settings = request.settings
    biased = [(token, bias) for token, bias in settings.logit_bias if token < row.numel()]
    if biased:
        ids, biases = zip(*biased, strict=True)
        row[_ids(ids, row)] += torch.tensor(biases, dtype=row.dtype, device=row.device)
    if len(request.output_ids) < settings.min_tokens:
        stops = set(settings.stop_token_ids)
        if not settings.ignore_eos:
            stops |= set(eos_token_ids)
        row[_ids(list(stops), row)] = float("-inf")
    if settings.repetition_penalty != 1:
        seen = _ids(request.prompt_ids + request.output_ids, row).unique()
        scores = row[seen]
        penalty = settings.repetition_penalty
        row[seen] = torch.where(scores > 0, scores / penalty, scores * penalty)
    if (settings.frequency_penalty or settings.presence_penalty) and request.output_ids:
        ids, counts = _ids(request.output_ids, row).unique(return_counts=True)
        row[ids] -= settings.frequency_penalty * counts + settings.presence_penalty
    if request.constraint is not None:
        request.constraint.mask(row)


def _ids(ids: Sequence[int], row: torch.Tensor) -> torch.Tensor:
    """Token ids as an index into ``row``; ids past its end (a stop token or prompt id the
    model's head cannot produce) are dropped."""
    return torch.tensor([t for t in ids if t < row.numel()], dtype=torch.long, device=row.device)
