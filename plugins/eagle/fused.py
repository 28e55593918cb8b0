"""The fused sub-models: target and EAGLE draft in one graph per phase.

Two phases are compiled (besides the core's target-only context encoding):

- ``eagle_context_encoding_model`` (:class:`EagleContextPhase`): the target encodes the prompt
  and returns the last token's logits and feature; in the same graph the draft encodes the
  prompt's pairs ``(x_{t+1}, f_t)`` for t = 0..P-2 into its cache.
- ``fused_speculation_model`` (:class:`EagleSpeculationPhase`): (1) the draft encodes the
  *pending pairs* (up to k+1 pairs whose real target features the previous call produced;
  the rest are masked out by their positions and later overwritten), (2) drafts k tokens
  autoregressively on its own predicted features, (3) the target verifies
  ``[last committed token, d_1..d_k]`` and returns its logits and features.

Every shape is fixed (k, the bucket, the batch), the per-row counts are gathered, never
branched on, so each phase exports as one graph. Drafting picks
``argmax(logits * inv_temperature + noise)``: with zero noise that is the draft's greedy
token, with Gumbel noise an exact draw from ``softmax(logits * inv_temperature)`` (the q of
the rejection rule).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from nxdplug.plugin_api import (
    FUSED_SPECULATION_MODEL_TAG,
    ModelWrapper,
    StepInputs,
    last_token_states,
)
from nxdplug.plugins.eagle.draft import feature_size

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig, PipelineContext

EAGLE_CONTEXT_TAG = "eagle_context_encoding_model"


def gather_rows(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[b, index[b]]`` for [batch, seq, ...] values and [batch] indices, keeping a
    length-1 seq dimension."""
    shape = (values.shape[0], 1, *values.shape[2:])
    expanded = index.view(-1, *([1] * (values.dim() - 1))).expand(shape)
    return values.gather(1, expanded)


class EagleContextPhase(nn.Module):
    """Target context encoding plus the draft's own context encoding, one graph."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts compacted to the left ([batch, bucket], positions 0..). Returns the last
        real token's logits [batch, 1, vocab] (float32) and the feature the draft reads
        [batch, 1, feature] (the final norm's output for EAGLE-1, three layers' for EAGLE-3)."""
        draft = self.model.eagle_draft
        final, features = draft.target_features(self.model, step)
        # Pair t = (x_{t+1}, f_t); the pair at each row's last position has no next token yet
        # (it is written with a placeholder and rewritten as the first pending pair).
        input_ids = step.input_ids
        next_tokens = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)
        draft(next_tokens, features, step.attention_mask, step.position_ids, step.seq_ids)
        last = last_token_states(final, step.attention_mask)
        return self.model.lm_head(last).float(), last_token_states(features, step.attention_mask)


class EagleSpeculationPhase(nn.Module):
    """Re-encode the pending pairs, draft k tokens, verify them with the target: one graph."""

    def __init__(self, model: nn.Module, speculation_length: int) -> None:
        super().__init__()
        self.model = model
        self.speculation_length = speculation_length

    def forward(self, step: StepInputs) -> tuple[torch.Tensor, ...]:
        """One speculation step.

        The step's tokens and positions [batch, k+1] are the pending pairs' (``pending_tokens``,
        ``pending_positions``), with ``step["pending_features"]`` [batch, k+1, hidden] and
        ``step["pending_count"]`` [batch] (1..k+1): the pairs ``(x_{t+1}, f_t)`` at draft
        positions t whose real features are new; the last of them holds each row's newest
        token x_{L-1} at t = L-2. The ``attention_mask`` [batch, keys] is all ones (positions
        order what each token sees); ``step["draft_noise"]`` [batch, k, vocab] and
        ``step["inv_temperature"]`` [batch, 1] choose the drafts.

        Returns ``drafts`` [batch, k], ``draft_logits`` [batch, k, vocab],
        ``target_logits`` [batch, k+1, vocab] (float32) and the target's features
        [batch, k+1, hidden] of ``[x_{L-1}, d_1..d_k]`` at positions L-1..L-1+k.
        """
        pending_tokens, pending_positions = step.input_ids, step.position_ids
        attention_mask, seq_ids = step.attention_mask, step.seq_ids
        pending_features, pending_count = step["pending_features"], step["pending_count"]
        noise, inv_temperature = step["draft_noise"], step["inv_temperature"]
        draft = self.model.eagle_draft
        last = pending_count - 1
        predicted = draft(
            pending_tokens, pending_features, attention_mask, pending_positions, seq_ids
        )
        hidden = gather_rows(predicted, last)  # the prediction of f_{L-1}
        base = pending_positions.gather(1, last[:, None])  # t = L-2
        drafts, draft_logits = [], []
        for step in range(self.speculation_length):
            logits = draft.token_logits(hidden)
            scores = logits * inv_temperature[:, :, None] + noise[:, step : step + 1]
            token = scores.argmax(dim=-1)
            drafts.append(token)
            draft_logits.append(logits)
            if step + 1 < self.speculation_length:
                hidden = draft(token, hidden, attention_mask, base + step + 1, seq_ids)
        drafts_tensor = torch.cat(drafts, dim=1)
        newest = pending_tokens.gather(1, last[:, None])
        tokens = torch.cat([newest, drafts_tensor], dim=1)
        offsets = torch.arange(1, self.speculation_length + 2, device=base.device)
        final, features = draft.target_features(
            self.model, StepInputs(tokens, attention_mask, base + offsets, seq_ids)
        )
        target_logits = self.model.lm_head(final).float()
        return drafts_tensor, torch.cat(draft_logits, dim=1), target_logits, features


class EagleContextWrapper(ModelWrapper):
    """The fused context-encoding sub-model (context buckets, ctx batch size); only the
    speculator calls it (``tokens_per_step`` 0)."""

    takes_step_inputs = False

    def __init__(self, config: InferenceConfig, model_cls: type[nn.Module]) -> None:
        super().__init__(
            config, model_cls, tag=EAGLE_CONTEXT_TAG, tokens_per_step=0, is_context_encoding=True
        )

    def phase_module(self, model: nn.Module) -> nn.Module:
        return EagleContextPhase(model)


class EagleSpeculationWrapper(ModelWrapper):
    """The fused speculation sub-model (token-generation buckets, spec batch size), whose
    graphs take the pending pairs' features and the draft's sampling inputs too.

    A call takes ``pending_width`` pending pairs a row and its target writes up to
    ``writes_past`` slots past the newest pair's; the tree's wrapper changes both.
    """

    takes_step_inputs = False
    extra_input_names = ("pending_features", "pending_count", "draft_noise", "inv_temperature")

    def __init__(self, config: InferenceConfig, model_cls: type[nn.Module]) -> None:
        super().__init__(
            config,
            model_cls,
            tag=FUSED_SPECULATION_MODEL_TAG,
            tokens_per_step=0,
            batch_size=config.neuron_config.spec_batch_size,
        )
        self.speculation_length = self.neuron_config.speculation_length

    @property
    def pending_width(self) -> int:
        return self.speculation_length + 1

    @property
    def writes_past(self) -> int:
        """[x_{L-1}, d_1..d_k]: up to k + 1 slots past the newest pair's."""
        return self.speculation_length + 1

    def phase_module(self, model: nn.Module) -> nn.Module:
        return EagleSpeculationPhase(model, self.speculation_length)

    def sampling_inputs(self, batch: int) -> dict[str, torch.Tensor]:
        """Example inputs of the draft's sampling, for tracing."""
        k, vocab, device = self.speculation_length, self.config.vocab_size, self.device
        return {
            "draft_noise": torch.zeros(batch, k, vocab, device=device),
            "inv_temperature": torch.ones(batch, 1, device=device),
        }

    def input_generator(self) -> list[StepInputs]:
        batch, width, device = self.batch_size, self.pending_width, self.device
        dtype = self.neuron_config.torch_dtype
        extra = {
            "pending_features": torch.zeros(
                batch, width, feature_size(self.config), dtype=dtype, device=device
            ),
            "pending_count": torch.ones(batch, dtype=torch.long, device=device),
            **self.sampling_inputs(batch),
        }
        return [
            StepInputs(
                torch.zeros(batch, width, dtype=torch.long, device=device),
                torch.ones(batch, bucket, dtype=torch.long, device=device),
                torch.arange(width, device=device).expand(batch, width).contiguous(),
                torch.arange(batch, dtype=torch.long, device=device),
                extra,
            )
            for bucket in self.buckets
        ]

    def forward(self, step: StepInputs) -> tuple[torch.Tensor, ...]:
        """One speculation step, its attention mask all ones over the smallest bucket that
        holds every slot it writes: its pending pairs', and ``writes_past`` slots past the
        newest one."""
        rows = step.rows
        self.check_ready(rows)
        positions, count = step.position_ids, step["pending_count"]
        base = positions.gather(1, (count - 1)[:, None])
        needed = int(torch.maximum(positions[:, -1:] + 1, base + self.writes_past + 1).max())
        mask = torch.ones(rows, self.bucket_for(needed), dtype=torch.long, device=positions.device)
        return self.run_padded(rows, step.replace(attention_mask=mask))


def add_submodels(context: PipelineContext) -> list[ModelWrapper]:
    """The ``add_submodels`` callback: the two fused phases (the second drafts a tree when
    ``token_tree_config`` is set)."""
    if context.neuron_config.token_tree_config is not None:
        from nxdplug.plugins.eagle.tree import add_tree_submodel

        speculation = add_tree_submodel(context)
    else:
        speculation = EagleSpeculationWrapper(context.config, context.model_cls)
    return [EagleContextWrapper(context.config, context.model_cls), speculation]
