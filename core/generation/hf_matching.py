"""Token and logit matching of a loaded model against HF transformers' greedy generation.

``nxdplug run --check-accuracy-mode`` reports with it, and the plugin author's test kit gives it
as ``check_accuracy``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import torch

from nxdplug.errors import NxdPlugError
from nxdplug.generation.hf_adapter import HuggingFaceGenerationAdapter

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from nxdplug.runtime.application import NeuronBaseForCausalLM

ACCURACY_MODES = ("token-matching", "logit-matching", "skip")

# (atol, rtol) per dtype for logits of the same checkpoint, nxdplug vs transformers.
LOGIT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (0.1, 0.02),
    torch.float16: (0.03, 0.005),
}


@attrs.frozen
class AccuracyReport:
    """The outcome of one accuracy check."""

    mode: str
    passed: bool
    expected: torch.Tensor
    actual: torch.Tensor
    first_mismatch: tuple[int, int] | None = None
    max_logit_error: float | None = None
    tolerance: tuple[float, float] | None = None

    def summary(self) -> str:
        new_tokens = self.expected.shape[1]
        if self.mode == "token-matching":
            if self.passed:
                rows = self.expected.shape[0]
                return f"token matching: PASS ({rows} rows x {new_tokens} tokens identical to HF)"
            row, index = self.first_mismatch
            return f"token matching: FAIL (row {row} differs from HF at new token {index})"
        verdict = "PASS" if self.passed else "FAIL"
        atol, rtol = self.tolerance
        divergence = (
            "greedy tokens identical"
            if self.first_mismatch is None
            else f"greedy tokens first differ at row {self.first_mismatch[0]}, "
            f"step {self.first_mismatch[1]}"
        )
        return (
            f"logit matching: {verdict} (max |error| {self.max_logit_error:.3g} over "
            f"{new_tokens} steps, atol {atol} rtol {rtol}; {divergence})"
        )


def _first_mismatch(expected: torch.Tensor, actual: torch.Tensor) -> tuple[int, int] | None:
    width = min(expected.shape[1], actual.shape[1])
    differs = expected[:, :width] != actual[:, :width]
    if expected.shape[1] != actual.shape[1] and not differs.any():
        return (0, width)
    if not differs.any():
        return None
    row = int(differs.any(dim=1).nonzero()[0])
    return row, int(differs[row].nonzero()[0])


def left_padded(
    input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same prompts padded on the left, the only layout HF decoder-only generation handles."""
    lengths = attention_mask.sum(-1)
    width = input_ids.shape[1]
    ids = torch.zeros_like(input_ids)
    mask = torch.zeros_like(attention_mask)
    for row in range(input_ids.shape[0]):
        count = int(lengths[row])
        ids[row, width - count :] = input_ids[row][attention_mask[row].bool()]
        mask[row, width - count :] = 1
    return ids, mask


def hf_greedy(
    hf_model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
) -> Any:
    """HF transformers' greedy generation with per-step logits (prompts left-padded for it)."""
    input_ids, attention_mask = left_padded(input_ids, attention_mask)
    pad = hf_model.generation_config.pad_token_id
    eos = hf_model.generation_config.eos_token_id
    with torch.inference_mode():
        return hf_model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad if pad is not None else 0,
            eos_token_id=eos,
            return_dict_in_generate=True,
            output_logits=True,
        )


def compare_with_hf(
    model: NeuronBaseForCausalLM,
    hf_model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int,
    mode: str = "token-matching",
    tolerance: tuple[float, float] | None = None,
    generate_kwargs: dict[str, Any] | None = None,
) -> AccuracyReport:
    """Compare ``model`` (an nxdplug causal LM, loaded) with ``hf_model`` on the same prompts.

    ``generate_kwargs`` go to the model's ``generate()`` in token matching (e.g. the
    ``assistant_model`` of a speculating model)."""
    if mode not in ACCURACY_MODES[:2]:
        raise ValueError(f"mode must be one of {ACCURACY_MODES[:2]}, got {mode!r}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    prompt = input_ids.shape[1]
    reference = hf_greedy(hf_model, input_ids, attention_mask, max_new_tokens)
    expected = reference.sequences[:, prompt:]
    adapter = HuggingFaceGenerationAdapter(model)
    if mode == "token-matching":
        with torch.inference_mode():
            actual = adapter.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=hf_model.generation_config.eos_token_id,
                pad_token_id=hf_model.generation_config.pad_token_id or 0,
                **(generate_kwargs or {}),
            )[:, prompt:]
        mismatch = _first_mismatch(expected, actual)
        return AccuracyReport(mode, mismatch is None, expected, actual, mismatch)

    expected_logits = torch.stack([step.float() for step in reference.logits], dim=1)
    actual_logits = teacher_forced_logits(model, input_ids, attention_mask, expected)
    atol, rtol = tolerance or LOGIT_TOLERANCES[model.neuron_config.torch_dtype]
    error = (actual_logits - expected_logits).abs()
    passed = bool((error <= atol + rtol * expected_logits.abs()).all())
    actual = actual_logits.argmax(dim=-1)
    return AccuracyReport(
        mode,
        passed,
        expected,
        actual,
        _first_mismatch(expected_logits.argmax(dim=-1), actual),
        float(error.max()),
        (atol, rtol),
    )


def teacher_forced_logits(
    model: NeuronBaseForCausalLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    forced: torch.Tensor,
) -> torch.Tensor:
    """[batch, steps, vocab] logits of ``model`` when fed ``forced`` tokens after the prompt."""
    model.reset()
    logits = []
    mask = attention_mask
    step_input = input_ids
    with torch.inference_mode():
        for step in range(forced.shape[1]):
            step_logits = model(input_ids=step_input, attention_mask=mask).logits
            if step_logits is None:
                raise NxdPlugError(
                    "logit matching needs the model's logits, and this model samples on device "
                    "without returning them: set NeuronConfig(output_logits=True)"
                )
            logits.append(step_logits[:, -1])
            step_input = forced[:, step : step + 1]
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
    return torch.stack(logits, dim=1)
