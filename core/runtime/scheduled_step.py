"""What one model call computes, stated row by row by the caller that scheduled it.

The serving engine and ``generate()`` know what each row of a call is: its new tokens and how
many positions its cache already holds before them. They say so in a :class:`ScheduledStep`,
and the application's runner (``NeuronBaseForCausalLM.run``) turns that into one phase's
:class:`~nxdplug.modules.step.StepInputs`; nothing is inferred from padding or masks. A prompt
is a row with nothing cached; a decode step, one new token over the cached ones; a prompt's
suffix after a cached prefix, or one chunk of a long prompt, several new tokens over them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch


@attrs.frozen
class ScheduledStep:
    """One call's rows.

    - ``input_ids`` [rows, n]: each row's new tokens, right-padded to the longest;
    - ``num_new`` [rows]: how many of them are real (at least 1);
    - ``num_cached`` [rows]: positions already in the row's cache, so its new tokens sit at
      positions ``num_cached ..num_cached + num_new - 1``;
    - ``seq_ids`` [rows]: the cache line of each row;
    - ``keywords``: the step-input plugins' per-row values (``sampling_params``,
      ``adapter_ids``, a block cache's ``block_tables``, ...) and the keywords that select a
      phase (a plugin's phase output, ``name=True``).
    """

    input_ids: torch.Tensor
    num_new: torch.Tensor
    num_cached: torch.Tensor
    seq_ids: torch.Tensor
    keywords: Mapping[str, Any] = attrs.field(factory=dict)

    @classmethod
    def from_rows(
        cls,
        new_tokens: Sequence[Sequence[int]],
        num_cached: Sequence[int],
        seq_ids: Sequence[int],
        keywords: Mapping[str, Any] | None = None,
        device: torch.device | str = "cpu",
    ) -> ScheduledStep:
        """A step from host lists: each row's new tokens, its cached count and its line."""
        longest = max(len(tokens) for tokens in new_tokens)
        padded = [list(tokens) + [0] * (longest - len(tokens)) for tokens in new_tokens]
        return cls(
            _long(padded, device),
            _long([len(tokens) for tokens in new_tokens], device),
            _long(list(num_cached), device),
            _long(list(seq_ids), device),
            dict(keywords or {}),
        )

    @classmethod
    def prompts(
        cls,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        keywords: Mapping[str, Any] | None = None,
        seq_ids: torch.Tensor | None = None,
    ) -> ScheduledStep:
        """Prompts given HF's way (padded on either side, ``attention_mask`` 1 for real
        tokens), each into its line in ``seq_ids`` (by default, the line of its row)."""
        tokens, mask, _ = compact_left(
            input_ids, attention_mask, positions_from_mask(attention_mask)
        )
        num_new = mask.sum(dim=-1)
        lines = _lines(input_ids) if seq_ids is None else seq_ids
        return cls(tokens, num_new, torch.zeros_like(num_new), lines, dict(keywords or {}))

    @classmethod
    def next_tokens(
        cls,
        input_ids: torch.Tensor,
        num_cached: torch.Tensor,
        keywords: Mapping[str, Any] | None = None,
        seq_ids: torch.Tensor | None = None,
    ) -> ScheduledStep:
        """``input_ids`` [rows, n]: n new tokens for each row's line in ``seq_ids`` (by
        default, the line of its row), after its ``num_cached`` cached positions."""
        num_new = torch.full_like(num_cached, input_ids.shape[1])
        lines = _lines(input_ids) if seq_ids is None else seq_ids
        return cls(input_ids, num_new, num_cached, lines, dict(keywords or {}))

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def width(self) -> int:
        """Tokens per row in the call (the longest row's new tokens)."""
        return self.input_ids.shape[1]

    @property
    def is_prompt(self) -> bool:
        """Whether every row starts at position 0 (prompts encoded whole)."""
        return not bool(self.num_cached.any())

    @property
    def is_uniform(self) -> bool:
        """Whether every row has the same number of new tokens (decode, verification)."""
        return bool((self.num_new == self.width).all())

    def positions(self) -> torch.Tensor:
        """[rows, n]: each new token's cache position (padding continues past the last real
        token, at positions the cache mask leaves out)."""
        offsets = torch.arange(self.width, device=self.input_ids.device)
        return self.num_cached[:, None] + offsets

    def cache_mask(self) -> torch.Tensor:
        """[rows, keys]: the positions each row holds once its new tokens are written, as wide
        as the longest row needs."""
        ends = self.num_cached + self.num_new
        keys = torch.arange(int(ends.max()), device=ends.device)
        return (keys < ends[:, None]).long()

    def replace(self, **changes: Any) -> ScheduledStep:
        return attrs.evolve(self, **changes)


def _long(values: Any, device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """HF's positions for a padded batch: real tokens count from 0, padding gets 1."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def compact_left(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Move each row's real tokens to the front (right padding), whatever side was padded.

    Returns tokens and positions [batch, longest], and the mask of real tokens.
    """
    real = attention_mask.bool()
    lengths = real.sum(-1)
    longest = int(lengths.max())
    device = input_ids.device
    tokens = torch.zeros(input_ids.shape[0], longest, dtype=input_ids.dtype, device=device)
    positions = torch.arange(longest, device=device).expand(input_ids.shape[0], longest).clone()
    for row in range(input_ids.shape[0]):
        count = int(lengths[row])
        tokens[row, :count] = input_ids[row][real[row]]
        positions[row, :count] = position_ids[row][real[row]]
    mask = (torch.arange(longest, device=device) < lengths[:, None]).long()
    return tokens, mask, positions


def _lines(input_ids: torch.Tensor) -> torch.Tensor:
    """Row i in line i."""
    return torch.arange(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
