"""Running one model over several processes, one tensor-parallel rank each.

A script or ``nxdplug`` command launched by ``torchrun --nproc-per-node N`` with ``tp_degree=N``
runs as N ranks: every process builds the model with its shard of each parallel layer, loads
its slice of the checkpoint, and runs the same steps; the layers' collectives (gloo on the CPU)
keep them in lockstep, and every rank ends with the same tokens. Without such a launch,
``tp_degree`` only sets the head layout and one process holds the whole model.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from nxdplug.errors import ConfigError
from nxdplug.modules.parallel_linear import tp_rank, tp_world_size


def launched_ranks() -> int:
    """How many processes the launcher started (``WORLD_SIZE``; 1 without a launcher)."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            [f"WORLD_SIZE is {raw!r}; expected a whole number of processes"]
        ) from None


def join_launched_ranks(tp_degree: int) -> None:
    """Join the launcher's process group when it started several processes for ``tp_degree``.

    Nothing happens in a single process, or when the caller initialized torch.distributed
    already (the layers then check that its size is ``tp_degree``).
    """
    world = launched_ranks()
    if world == 1 or dist.is_initialized():
        return
    if world != tp_degree:
        raise ConfigError(
            [
                f"{world} processes were launched (WORLD_SIZE) but tp_degree is {tp_degree}: "
                f"launch one process per rank (torchrun --nproc-per-node {tp_degree}) or set "
                f"tp_degree={world}"
            ]
        )
    dist.init_process_group("gloo")


def end_rank_process(exit_code: int = 0) -> NoReturn:
    """End a rank's process once its work is done: on success wait for every rank, leave the
    process group, and exit at once with ``exit_code``.

    Exiting through the interpreter's teardown after a gloo group was used aborts about one run
    in ten with torch 2.13 ("terminate called without an active exception": a thread of the
    group is still joinable when the process exits), after all the work succeeded; skipping the
    teardown avoids it.
    """
    if dist.is_initialized():
        if exit_code == 0:
            dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def is_first_rank() -> bool:
    """Whether this process speaks for the ranks (prints, writes shared files)."""
    return tp_rank() == 0


@runtime_checkable
class ShardedModule(Protocol):
    """A module whose parameters are this rank's shard of its checkpoint tensors (the parallel
    linear layers, experts, a plugin's layers)."""

    def shard_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's shard of ``full``: the module's own tensors, by parameter name."""


def this_ranks_shard(
    model: nn.Module, state_dict: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``state_dict`` (a full checkpoint in the model's names) with the tensors of each parallel
    layer of ``model`` cut to this rank's shard; the checkpoint itself when there is one rank."""
    if tp_world_size() == 1:
        return state_dict
    sharded = dict(state_dict)
    for prefix, module in model.named_modules():
        if not isinstance(module, ShardedModule):
            continue
        keys = {name: f"{prefix}.{name}" for name, _ in module.named_parameters(recurse=False)}
        full = {name: state_dict[key] for name, key in keys.items() if key in state_dict}
        shard = module.shard_state_dict(full)
        sharded.update({keys[name]: tensor for name, tensor in shard.items()})
    return sharded


def shared_by_first_rank(value: object) -> object:
    """``value`` as the first rank has it, on every rank."""
    if tp_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def wait_for_all_ranks() -> None:
    """Return once every rank has got here."""
    if tp_world_size() > 1:
        dist.barrier()
