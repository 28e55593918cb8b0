"""NxD Inference's ``HiddenStateRollingBuffer`` and ``rolling_buffer_set_state``
(``nxdplug.nxdi.modules.eagle.hidden_state``): the cases of its unit tests
(test_hidden_state_rolling_buffer.py and the kernel's rollback test), fewer random draws."""

from __future__ import annotations

import pytest
import torch

from nxdplug.nxdi.modules.eagle.hidden_state import (
    HiddenStateRollingBuffer,
    rolling_buffer_set_state,
)

DRAWS = 50  # NxD Inference's tests draw 1000 cases each
HIDDEN = 128


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_the_buffer_is_a_module_with_a_scratch_row() -> None:
    buffer = HiddenStateRollingBuffer(3, 8, 16, dtype=torch.bfloat16)
    assert buffer.shape == (4, 8, 16)
    assert list(buffer.state_dict()) == ["hidden_states"]
    state = buffer.hidden_states
    assert state.shape == (4, 8, 16) and state.dtype == torch.bfloat16 and not state.requires_grad
    assert not state.any()
    assert (buffer.inplace, buffer.apply_seq_ids_mask, buffer.use_kernel) == (False, False, False)


def test_context_encoding_state_is_read_at_the_next_position(generator) -> None:
    for _ in range(DRAWS):
        buffer = HiddenStateRollingBuffer(7, 2, HIDDEN, inplace=True)
        position_ids = torch.randint(128256, (1, 1), generator=generator)
        seq_ids = torch.randint(0, 7, (1, 1), dtype=torch.int32, generator=generator)
        state = torch.rand((1, 1, HIDDEN), generator=generator)
        buffer.set_state(seq_ids, position_ids + 1, state)
        torch.testing.assert_close(buffer.get_state(seq_ids, position_ids + 1), state)


def test_token_generation_state_is_read_after_the_accepted_tokens(generator) -> None:
    k = 4
    for _ in range(DRAWS):
        buffer = HiddenStateRollingBuffer(2, k * 2, HIDDEN, inplace=True)
        position_ids = torch.randint(128256, (2, 1), generator=generator)
        seq_ids = torch.randperm(2, generator=generator).reshape(2, 1)
        accepted = torch.randint(1, k, (2, 1), generator=generator)
        state = torch.rand((2, 1, HIDDEN), generator=generator)
        buffer.set_state(seq_ids, position_ids + accepted, state)
        torch.testing.assert_close(buffer.get_state(seq_ids, position_ids + accepted), state)


def test_padding_rows_write_the_scratch_row_under_the_seq_ids_mask(generator) -> None:
    """NxD Inference's masked case (batch 2, one seq id -1). Its test also meant to check that
    the masked rows stay zero but does not assert it (a bare torch.allclose); here: the real
    sequence's row holds its state, the padding row's state went to the scratch row, and the
    sequence not in the batch is untouched."""
    k = 4
    for _ in range(DRAWS):
        buffer = HiddenStateRollingBuffer(2, k * 2, HIDDEN, inplace=True, apply_seq_ids_mask=True)
        padded = int(torch.randint(2, (1,), generator=generator))
        seq_ids = torch.arange(2).reshape(2, 1)
        seq_ids[padded] = -1
        real = 1 - padded
        position_ids = torch.randint(128256, (2, 1), generator=generator)
        state = torch.rand((2, 1, HIDDEN), generator=generator)
        buffer.set_state(seq_ids, position_ids, state)
        torch.testing.assert_close(buffer.get_state(seq_ids, position_ids), state)
        slots = position_ids[:, 0] % (k * 2)
        table = buffer.hidden_states
        torch.testing.assert_close(table[real, slots[real]], state[real, 0])
        torch.testing.assert_close(table[2, slots[padded]], state[padded, 0])
        assert not table[padded].any()


@pytest.mark.parametrize("use_kernel", [False, True])
def test_a_step_rolled_back_reads_the_state_before_it(generator, use_kernel) -> None:
    """NxD Inference's rollback case (batch 4, k 5); with ``use_kernel`` too (which, as NxD
    Inference's, writes with index_put on the CPU), and the kernel test's accepted counts."""
    k, batch = 5, 4
    accepted = (torch.tensor([[1], [5], [3], [5]]), torch.tensor([[1], [5], [4], [1]]))
    for draw in range(DRAWS):
        buffer = HiddenStateRollingBuffer(batch, k * 2, HIDDEN, inplace=True, use_kernel=use_kernel)
        seq_ids = torch.randperm(batch, generator=generator).reshape(batch, 1)
        position_ids = torch.randint(128256, (batch, 1), generator=generator)
        first, second = (
            accepted if draw == 0 else (torch.randint(1, k, (batch, 1), generator=generator),) * 2
        )
        states = torch.rand((2, batch, 1, HIDDEN), generator=generator)
        step_1 = position_ids + first
        buffer.set_state(seq_ids, step_1, states[0])
        torch.testing.assert_close(buffer.get_state(seq_ids, step_1), states[0])
        step_2 = step_1 + second
        buffer.set_state(seq_ids, step_2, states[1])
        torch.testing.assert_close(buffer.get_state(seq_ids, step_2), states[1])
        torch.testing.assert_close(buffer.get_state(seq_ids, step_1), states[0])


def test_set_state_returns_the_buffer_and_writes_the_parameter_only_inplace() -> None:
    seq_ids, position_ids = torch.tensor([[1]]), torch.tensor([[13]])
    state = torch.full((1, 1, 4), 2.0)
    buffer = HiddenStateRollingBuffer(2, 4, 4)
    written = buffer.set_state(seq_ids, position_ids, state)
    assert written.shape == (3, 4, 4) and written[1, 1].tolist() == [2.0] * 4  # 13 % 4 = 1
    assert written.count_nonzero() == 4 and not buffer.hidden_states.any()
    buffer = HiddenStateRollingBuffer(2, 4, 4, inplace=True)
    written = buffer.set_state(seq_ids, position_ids, state)
    assert torch.equal(buffer.hidden_states.data, written)


def test_rolling_buffer_set_state_writes_in_place_and_skips_outside_writes() -> None:
    buffer = torch.zeros(3, 4, 2)
    states = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    # Rows address batch * 4 + position: (0, 1) -> 1, (2, 3) -> 11, (2, 4) -> 12, outside.
    result = rolling_buffer_set_state(
        buffer, states, torch.tensor([0, 2, 2]), torch.tensor([1, 3, 4])
    )
    assert result is buffer
    assert buffer.nonzero()[:, :2].unique(dim=0).tolist() == [[0, 1], [2, 3]]
    assert buffer[0, 1].tolist() == [1.0, 1.0] and buffer[2, 3].tolist() == [2.0, 2.0]
    # A later row at the same place wins; a position past the buffer size runs into the next
    # sequence's slots, as the kernel's flat index does.
    rolling_buffer_set_state(buffer, states[:2], torch.tensor([1, 1]), torch.tensor([0, 0]))
    assert buffer[1, 0].tolist() == [2.0, 2.0]
    rolling_buffer_set_state(buffer, states[2:], torch.tensor([0]), torch.tensor([5]))
    assert buffer[1, 1].tolist() == [3.0, 3.0]
    with pytest.raises(ValueError, match="one row per batch id"):
        rolling_buffer_set_state(
            buffer, states[:2], torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2])
        )
    with pytest.raises(ValueError, match="hidden size 2"):
        rolling_buffer_set_state(buffer, torch.zeros(1, 3), torch.tensor([0]), torch.tensor([0]))
