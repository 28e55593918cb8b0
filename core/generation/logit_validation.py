"""Logit validation: a model's raw next-token logits against reference ones, with teacher forcing.

This is the check NxD Inference's ``check_accuracy_logits`` runs (there through
``torch_neuronx.testing.validation.logit_validation``). ``generate_fn`` greedily continues a
batch of prompts and returns its logits; wherever its greedy token differs from the reference's
(the argmax of the expected logits), the positions up to and including that one are checked, the
reference's tokens are appended to the prompts, and ``generate_fn`` is called again from there
(teacher forcing), so that one early divergence does not make every later position incomparable.

At each checked position:

- positions where either side is ``-inf`` (banned tokens) are left out, and the constant shift
  between the two rows (the intercept of a least-squares line through them) is taken off the
  actual logits: a softmax does not see a shift;
- for every entry ``top_k -> (atol, rtol)`` of ``tol_map`` (``top_k`` a number or ``"all"``),
  the expected row's ``top_k`` best tokens must satisfy ``|actual - expected| <= atol + rtol *
  |expected|``; the entry's error is the largest ``|actual - expected| / |expected|`` among them;
- where the greedy tokens differ (a divergence), the actual logit of the expected token must be
  within ``divergence_difference_tol`` of the actual maximum: a near tie may break the other way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from nxdplug.errors import NxdPlugError

# Tighter for the likelier tokens, which decide what is generated.
DEFAULT_TOLERANCE_MAP: dict[str, tuple[float, float]] = {
    "5": (1e-5, 0.01),
    "50": (1e-5, 0.02),
    "1000": (1e-5, 0.03),
    "all": (1e-5, 0.05),
}
DEFAULT_DIVERGENCE_DIFFERENCE_TOLERANCE = 0.001

GenerateResult = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class LogitMatchingValidationError(AssertionError):
    """Logit validation failed; ``results`` holds every checked position of every row."""

    def __init__(self, message: str, results: list[list[dict[str, Any]]]) -> None:
        super().__init__(message)
        self.message = message
        self.results = results

    def get_divergence_index(self) -> int:
        """The latest failing position of any row (0 as soon as a row fails at position 0);
        -1 when none failed."""
        latest = -1
        for row in self.results:
            for index, token in enumerate(row):
                if not token["passed"]:
                    if index == 0:
                        return 0
                    latest = max(latest, index)
        return latest


def logit_validation(
    input_ids: torch.Tensor | Sequence[Sequence[int]],
    generate_fn: Callable[[torch.Tensor], GenerateResult],
    expected_logits: torch.Tensor,
    tol_map: Mapping[str | int, tuple[float, float]] | None = None,
    divergence_difference_tol: float | None = None,
) -> tuple[bool, list[list[dict[str, Any]]], str]:
    """Check ``generate_fn``'s logits against ``expected_logits`` [steps, batch, vocab].

    ``input_ids`` [batch, prompt] are the prompts (all rows the same length). ``generate_fn``
    takes the prompts extended so far, [batch, length], and returns the logits of the tokens it
    generates next, [new, batch, vocab], or ``(logits, tokens [batch, new])`` when it chooses
    its tokens otherwise than by argmax. Returns ``(passed, results, message)``: ``results[row]``
    has one dict per checked position (``passed``, ``divergence``, ``divergence_difference``,
    ``error_map``: top_k -> error, ...).
    """
    tol_map = dict(DEFAULT_TOLERANCE_MAP if tol_map is None else tol_map)
    _check_tol_map(tol_map)
    if divergence_difference_tol is None:
        divergence_difference_tol = DEFAULT_DIVERGENCE_DIFFERENCE_TOLERANCE
    prompts = torch.as_tensor(input_ids)
    if expected_logits.dim() != 3 or prompts.dim() != 2:
        raise NxdPlugError(
            "logit_validation needs expected_logits [steps, batch, vocab] and input_ids "
            f"[batch, prompt]; got {list(expected_logits.shape)} and {list(prompts.shape)}"
        )
    if expected_logits.shape[1] != prompts.shape[0]:
        raise NxdPlugError(
            f"expected_logits has {expected_logits.shape[1]} rows, input_ids "
            f"{prompts.shape[0]}: they must be the same batch"
        )
    expected_tokens = expected_logits.argmax(dim=-1).T  # [batch, steps]
    steps = expected_tokens.shape[1]
    results: list[list[dict[str, Any]]] = [[] for _ in range(prompts.shape[0])]
    start = 0
    while start < steps:
        actual_logits, actual_tokens = _generated(generate_fn(prompts))
        end = start + _checked_length(expected_tokens[:, start:], actual_tokens)
        for row, row_results in enumerate(results):
            for offset in range(end - start):
                row_results.append(
                    validate_position(
                        expected_logits[start + offset, row],
                        actual_logits[offset, row],
                        tol_map,
                        divergence_difference_tol,
                        int(actual_tokens[row, offset]),
                    )
                )
        prompts = torch.cat([prompts, expected_tokens[:, start:end].to(prompts.dtype)], dim=1)
        start = end
    passed = all(token["passed"] for row in results for token in row)
    return passed, results, _summary(passed, results, tol_map, divergence_difference_tol)


def validate_position(
    expected: torch.Tensor,
    actual: torch.Tensor,
    tol_map: Mapping[str | int, tuple[float, float]],
    divergence_difference_tol: float,
    actual_token: int | None = None,
) -> dict[str, Any]:
    """The checks of one position: two [vocab] rows of logits, and the token the model chose
    (its argmax when None)."""
    expected_token = int(expected.argmax())
    if actual_token is None:
        actual_token = int(actual.argmax())
    finite = (expected != float("-inf")) & (actual != float("-inf"))
    expected_kept, actual_kept = expected[finite].double(), actual[finite].double()
    shift = _shift(expected_kept, actual_kept)
    actual_kept = actual_kept - shift
    error_map, passed = {}, True
    for top_k, (atol, rtol) in tol_map.items():
        chosen = _top_indices(expected_kept, top_k)
        exp, act = expected_kept[chosen], actual_kept[chosen]
        passed &= bool(((act - exp).abs() <= atol + rtol * exp.abs()).all())
        error_map[top_k] = float(((act - exp).abs() / exp.abs().clamp(min=1e-8)).max())
    divergence = expected_token != actual_token
    difference = 0.0
    if divergence:
        shifted = actual.double() - shift
        difference = float(shifted.max() - shifted[expected_token])
        passed &= difference < divergence_difference_tol
    return {
        "passed": passed,
        "divergence": divergence,
        "divergence_difference": difference,
        "error_map": error_map,
        "shift": shift,
        "expected_token": expected_token,
        "actual_token": actual_token,
    }


def _check_tol_map(tol_map: Mapping[str | int, tuple[float, float]]) -> None:
    for top_k, tolerances in tol_map.items():
        if str(top_k) != "all" and not (str(top_k).isdigit() and int(top_k) > 0):
            raise NxdPlugError(
                f"tol_map key {top_k!r}: expected a number of top tokens (5, '50') or 'all'"
            )
        if len(tuple(tolerances)) != 2:
            raise NxdPlugError(
                f"tol_map[{top_k!r}] must be a pair (atol, rtol); got {tolerances!r}"
            )


def _generated(result: GenerateResult) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits [new, batch, vocab], tokens [batch, new])`` of what ``generate_fn`` returned."""
    if isinstance(result, tuple):
        logits, tokens = result
        if tuple(logits.shape[:-1]) != tuple(tokens.T.shape):
            raise NxdPlugError(
                "generate_fn returned logits and tokens of different steps or rows: "
                f"{list(logits.shape)} and {list(tokens.shape)} (expected [new, batch, vocab] "
                "and [batch, new])"
            )
        return logits, tokens
    return result, result.argmax(dim=-1).T


def _checked_length(expected: torch.Tensor, actual: torch.Tensor) -> int:
    """How many positions to check from here: up to the first one where any row's tokens
    differ, that one included; all that both have when none differs."""
    length = min(expected.shape[1], actual.shape[1])
    if length == 0:
        raise NxdPlugError("generate_fn returned no logits; it must generate one token or more")
    differs = (expected[:, :length] != actual[:, :length]).any(dim=0).nonzero()
    return int(differs[0]) + 1 if len(differs) else length


def _shift(expected: torch.Tensor, actual: torch.Tensor) -> float:
    """The intercept of the least-squares line ``actual ~ slope * expected + shift``."""
    design = torch.stack([expected, torch.ones_like(expected)], dim=1)
    solution = torch.linalg.lstsq(design, actual[:, None]).solution
    return float(solution[1, 0])


def _top_indices(expected: torch.Tensor, top_k: str | int) -> torch.Tensor:
    if str(top_k) == "all":
        return torch.arange(expected.numel(), device=expected.device)
    return torch.topk(expected, min(int(top_k), expected.numel())).indices


def _summary(
    passed: bool,
    results: list[list[dict[str, Any]]],
    tol_map: Mapping[str | int, tuple[float, float]],
    divergence_difference_tol: float,
) -> str:
    tokens = [(row, index, t) for row, r in enumerate(results) for index, t in enumerate(r)]
    lines = [
        f"Logit validation {'passed' if passed else 'failed'}: {len(tokens)} position(s) "
        f"checked over {len(results)} row(s)."
    ]
    for top_k, (atol, rtol) in tol_map.items():
        worst = max(tokens, key=lambda item: item[2]["error_map"][top_k], default=None)
        if worst is not None:
            row, index, token = worst
            lines.append(
                f"  top_k {top_k}: max relative error {token['error_map'][top_k]:.3g} "
                f"(row {row}, position {index}; atol={atol:g}, rtol={rtol:g})"
            )
    diverged = [(row, index, t) for row, index, t in tokens if t["divergence"]]
    for row, index, token in diverged:
        verdict = "within" if token["divergence_difference"] < divergence_difference_tol else "over"
        lines.append(
            f"  divergence at row {row}, position {index}: expected token "
            f"{token['expected_token']}, got {token['actual_token']}; difference "
            f"{token['divergence_difference']:.3g} {verdict} divergence_difference_tol="
            f"{divergence_difference_tol:g}"
        )
    failed = [(row, index) for row, index, t in tokens if not t["passed"]]
    if failed:
        lines.append(f"  failing (row, position): {failed}")
    return "\n".join(lines)
