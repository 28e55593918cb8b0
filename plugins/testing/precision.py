"""Judging a model in a low precision the way it can be judged.

A bfloat16 model cannot match float32 exactly, and a fixed logit tolerance sits at the edge of
its noise. The fair bar is HF transformers' own forward in the same dtype: against HF in float32
on the same weights (the greedy path of the float32 model, teacher-forced), the model's logits
must be no further off than HF's low-precision logits (max and mean error within ``ratio`` of
HF's), and its greedy choices no worse. Choices are compared where the two low-precision runs
disagree about the float32 token: a model as good as HF's wins about as many of those positions
as it loses, so it fails only when it loses more than chance allows (a two-sigma sign test).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from nxdplug.plugin_api import hf_greedy, left_padded, teacher_forced_logits

if TYPE_CHECKING:
    from nxdplug.plugin_api import NeuronBaseForCausalLM


@attrs.frozen
class PrecisionReport:
    """Errors against HF float32 of the model (``max_error``, ``mean_error``) and of HF in the
    same dtype (``hf_*``); how often each picks HF float32's greedy token (``agreement``); and,
    among the positions where just one of the two picks it, how many each won."""

    dtype: torch.dtype
    ratio: float
    max_error: float
    mean_error: float
    hf_max_error: float
    hf_mean_error: float
    agreement: float
    hf_agreement: float
    won: int
    lost: int

    @property
    def choices_hold(self) -> bool:
        """Not significantly more positions lost than won (two standard deviations)."""
        contested = self.won + self.lost
        return self.lost - self.won <= 2 * math.sqrt(contested)

    @property
    def passed(self) -> bool:
        return (
            self.max_error <= self.ratio * self.hf_max_error
            and self.mean_error <= self.ratio * self.hf_mean_error
            and self.choices_hold
        )

    def summary(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{self.dtype} against HF float32: {verdict}; max error {self.max_error:.4f} "
            f"(HF {self.hf_max_error:.4f}, {self.max_error / self.hf_max_error:.2f}x), mean "
            f"{self.mean_error:.5f} (HF {self.hf_mean_error:.5f}, "
            f"{self.mean_error / self.hf_mean_error:.2f}x; at most {self.ratio}x); greedy "
            f"agreement {self.agreement:.3f} (HF {self.hf_agreement:.3f}), {self.won} positions "
            f"won and {self.lost} lost against HF"
        )


def hf_incremental_logits(
    hf_model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, forced: torch.Tensor
) -> torch.Tensor:
    """[batch, steps, vocab] float32 logits of an HF model fed ``forced`` one token per step
    after the left-padded prompt, with its KV cache: the path its ``generate()`` takes."""
    mask = attention_mask
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        out = hf_model(input_ids, attention_mask=mask, position_ids=positions, use_cache=True)
        logits = [out.logits[:, -1].float()]
        last = positions[:, -1:]
        for step in range(forced.shape[1] - 1):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
            last = last + 1
            out = hf_model(
                forced[:, step : step + 1],
                attention_mask=mask,
                position_ids=last,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
            logits.append(out.logits[:, -1].float())
    return torch.stack(logits, dim=1)


def check_low_precision(
    model: NeuronBaseForCausalLM,
    model_path: str | Path,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int,
    ratio: float = 1.25,
) -> PrecisionReport:
    """Compare ``model`` (an nxdplug causal LM, loaded, in bf16 or fp16) with HF transformers
    on the checkpoint at ``model_path``, as the module docstring says."""
    from transformers import AutoModelForCausalLM

    dtype = model.neuron_config.torch_dtype
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    input_ids, attention_mask = left_padded(input_ids, attention_mask)
    hf32 = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    reference = hf_greedy(hf32, input_ids, attention_mask, max_new_tokens)
    forced = reference.sequences[:, input_ids.shape[1] :]
    expected = torch.stack([step.float() for step in reference.logits], dim=1)[:, : forced.shape[1]]
    del hf32
    hf_low = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).eval()
    hf_logits = hf_incremental_logits(hf_low, input_ids, attention_mask, forced)
    logits = teacher_forced_logits(model, input_ids, attention_mask, forced).float()
    error, hf_error = (logits - expected).abs(), (hf_logits - expected).abs()
    right, hf_right = logits.argmax(-1) == forced, hf_logits.argmax(-1) == forced
    return PrecisionReport(
        dtype=dtype,
        ratio=ratio,
        max_error=float(error.max()),
        mean_error=float(error.mean()),
        hf_max_error=float(hf_error.max()),
        hf_mean_error=float(hf_error.mean()),
        agreement=float(right.float().mean()),
        hf_agreement=float(hf_right.float().mean()),
        won=int((right & ~hf_right).sum()),
        lost=int((~right & hf_right).sum()),
    )
