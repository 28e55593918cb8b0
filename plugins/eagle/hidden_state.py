"""NxD Inference's ``HiddenStateRollingBuffer``: EAGLE's hidden states per sequence and position.

An EAGLE draft step reads the target's hidden state from the step before it. When batches run
asynchronously a step can be cut short (a new prompt's context encoding is scheduled) and run
again, so more than the newest state is kept: ``buffer_length`` per sequence (NxD Inference
takes 2 * speculation_length), position p in slot ``p % buffer_length``. ``set_state`` is given
the next positions and ``get_state`` the current ones, so a step reads what the one before it
wrote, and a step run again still finds it. Row ``max_batch_size`` is scratch: with
``apply_seq_ids_mask`` a padding row (a negative seq id) writes and reads there.

``set_state`` returns the whole buffer (NxD Inference's traced graph returns it as an output
aliased to the parameter): a new tensor, which ``inplace`` makes the parameter's data; with
``use_kernel`` off the CPU, :func:`rolling_buffer_set_state` writes the parameter in place.
"""

from __future__ import annotations

import torch
from torch import nn


def rolling_buffer_set_state(
    buffer: torch.Tensor,
    hidden_states: torch.Tensor,
    batch_ids: torch.Tensor,
    position_ids: torch.Tensor,
) -> torch.Tensor:
    """NxD Inference's NKI kernel on plain torch: write ``hidden_states[i]`` ([batch, hidden])
    at ``buffer[batch_ids[i], position_ids[i]]`` in place and return ``buffer`` [max_batch,
    buffer_size, hidden].

    Positions are taken as already reduced modulo buffer_size. As the kernel, a row addresses
    the buffer as one flat index ``batch_id * buffer_size + position``, a write outside the
    buffer is skipped, and rows are written in order (a later one wins).
    """
    batch = batch_ids.shape[0]
    max_batch, slots, hidden = buffer.shape
    if hidden_states.shape[0] != batch or position_ids.shape[0] != batch or max_batch < batch:
        raise ValueError(
            f"rolling_buffer_set_state: hidden_states {tuple(hidden_states.shape)} and "
            f"position_ids {tuple(position_ids.shape)} must have one row per batch id "
            f"({batch}), and the buffer {tuple(buffer.shape)} at least as many rows"
        )
    if hidden_states.shape[-1] != hidden:
        raise ValueError(
            f"rolling_buffer_set_state: hidden_states {tuple(hidden_states.shape)} must have "
            f"the buffer's hidden size {hidden}"
        )
    flat = buffer.view(max_batch * slots, hidden)
    targets = batch_ids.reshape(batch).long() * slots + position_ids.reshape(batch).long()
    for row, target in enumerate(targets.tolist()):
        if 0 <= target < len(flat):
            flat[target] = hidden_states[row]
    return buffer


class HiddenStateRollingBuffer(nn.Module):
    """The last ``buffer_length`` hidden states of each of ``max_batch_size`` sequences."""

    def __init__(
        self,
        max_batch_size: int,
        buffer_length: int,
        hidden_size: int,
        dtype: torch.dtype = torch.float32,
        inplace: bool = False,
        apply_seq_ids_mask: bool = False,
        use_kernel: bool = False,
    ) -> None:
        super().__init__()
        self.max_batch_size = max_batch_size
        self.buffer_length = buffer_length
        self.inplace = inplace
        self.apply_seq_ids_mask = apply_seq_ids_mask
        self.use_kernel = use_kernel
        self.shape = (max_batch_size + 1, buffer_length, hidden_size)  # + the scratch row
        self.hidden_states = nn.Parameter(torch.zeros(self.shape, dtype=dtype), requires_grad=False)

    def _rows_and_slots(
        self, seq_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffer row and slot of each sequence ([bs, 1] or [bs] inputs): two [bs]."""
        rows = seq_ids.reshape(seq_ids.shape[0])
        if self.apply_seq_ids_mask and len(rows) > 1:
            rows = torch.where(rows >= 0, rows, self.max_batch_size)
        return rows, position_ids.reshape(position_ids.shape[0]) % self.buffer_length

    def set_state(
        self, seq_ids: torch.Tensor, position_ids: torch.Tensor, hidden_state: torch.Tensor
    ) -> torch.Tensor:
        """Store ``hidden_state`` [bs, 1, hidden] at each sequence's position; the buffer."""
        rows, slots = self._rows_and_slots(seq_ids, position_ids)
        states = hidden_state.squeeze(1)
        if self.use_kernel and states.device.type != "cpu":
            updated = rolling_buffer_set_state(self.hidden_states.data, states, rows, slots)
        else:
            updated = torch.index_put(self.hidden_states, (rows, slots), states)
        if self.inplace:
            self.hidden_states.data = updated
        return updated

    def get_state(self, seq_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The state stored at each sequence's position: [bs, 1, hidden]."""
        rows, slots = self._rows_and_slots(seq_ids, position_ids)
        return self.hidden_states[rows, slots].unsqueeze(1)
