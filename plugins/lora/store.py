"""Where each adapter is, with dynamic multi-LoRA: registered (its folder: ``lora_ckpt_paths``,
``lora_ckpt_paths_cpu`` or ``load_adapter``), held on the host (its matrices), and in one of the
``max_loras`` slots the graphs read (the first ``lora_ckpt_paths`` ones at start-up).

A request naming an adapter that is not in a slot brings it in: into a free slot, or into the
least recently used one that no row of the request uses (its adapter stays on the host). The
host keeps at most ``max_cpu_loras`` adapters' matrices, dropping the least recently used;
an adapter dropped there is read from its folder again when asked for. Slots are rows of the
stacked LoRA weights, which every graph takes as inputs, so nothing is recompiled. The host
holds an adapter's matrices whole, in the model's layout; each rank writes its own part of
them into its weights.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from nxdplug.plugin_api import CheckpointError, NotSupportedError, NxdPlugError
from nxdplug.plugins.lora.adapters import (
    Adapter,
    adapter_matrices,
    read_adapter,
    slots,
)
from nxdplug.plugins.lora.layout import Placement, in_model_layout, placement, write_slot

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig, NeuronBaseForCausalLM

LORA_WEIGHTS = (".lora_a", ".lora_b", ".lora_scale")


class AdapterStore:
    def __init__(self, config: InferenceConfig) -> None:
        lora_config = config.neuron_config.lora_config
        self.config = config
        self.dynamic = lora_config.enable_dynamic_multi_lora
        self.max_slots = lora_config.max_loras
        self.max_on_host = lora_config.max_cpu_loras
        self.max_rank = lora_config.max_lora_rank
        self.paths: dict[str, Path] = lora_config.adapter_paths() | lora_config.adapter_paths(
            on_host=True
        )
        self.initial_slots = slots(config)
        self.slot_of: dict[str, int] = dict(self.initial_slots)
        self.recent: OrderedDict[str, None] = OrderedDict.fromkeys(self.slot_of)  # oldest first
        self.on_host: OrderedDict[str, tuple[Adapter, dict]] = OrderedDict()
        self.weights: dict[str, torch.Tensor] = {}

    def bind(self, weight_tensors: dict[str, torch.Tensor]) -> None:
        """The loaded model's stacked LoRA weights, holding the start-up adapters."""
        self.weights = {k: t for k, t in weight_tensors.items() if k.endswith(LORA_WEIGHTS)}
        if self.dynamic and not self.weights:
            raise NotSupportedError(
                "enable_dynamic_multi_lora writes adapters into the weights the graphs take, "
                "but this model's weights are frozen into its graphs (freezing=true); compile "
                "without freezing"
            )
        self.slot_of = dict(self.initial_slots)
        self.recent = OrderedDict.fromkeys(self.slot_of)

    def slots_for(self, adapter_ids: Iterable[str | None]) -> list[int]:
        """Each row's slot (0 for None), bringing adapters into slots as needed."""
        wanted = [i for i in dict.fromkeys(adapter_ids) if i is not None]
        unknown = sorted(i for i in wanted if i not in self.paths)
        if unknown:
            raise NxdPlugError(
                f"adapter_ids names {unknown}, not among the served adapters {list(self.paths)}"
                + (" (load_adapter adds one)" if self.dynamic else " (lora_ckpt_paths)")
            )
        if len(wanted) > self.max_slots:
            raise NxdPlugError(
                f"the request uses {len(wanted)} adapters but there are max_loras="
                f"{self.max_slots} slots; split the batch, or raise max_loras"
            )
        for adapter_id in wanted:
            if adapter_id not in self.slot_of:
                self._bring_in(adapter_id, pinned=set(wanted))
            self.recent.move_to_end(adapter_id)
        return [self.slot_of.get(i, 0) for i in adapter_ids]

    def register(self, adapter_id: str, path: Path) -> None:
        """``load_adapter``: check the adapter and hold it on the host, ready for a slot."""
        self._require_dynamic("load_adapter")
        if adapter_id in self.paths:
            raise NxdPlugError(f"adapter {adapter_id!r} is loaded already; unload it first")
        self._held(adapter_id, Path(path), check_fit=True)
        self.paths[adapter_id] = Path(path)

    def unregister(self, adapter_id: str) -> None:
        """``unload_adapter``: forget the adapter; its slot, if any, is emptied."""
        self._require_dynamic("unload_adapter")
        if adapter_id not in self.paths:
            raise NxdPlugError(f"no adapter {adapter_id!r} is loaded; loaded: {list(self.paths)}")
        slot = self.slot_of.pop(adapter_id, None)
        if slot is not None:
            self.recent.pop(adapter_id)
            write_slot(self.weights, slot, adapter_id, {}, 0.0, self._placement)
        self.on_host.pop(adapter_id, None)
        del self.paths[adapter_id]

    def _placement(self, projection: str) -> Placement:
        """Which part of ``projection``'s LoRA weights this rank holds."""
        return placement(projection, self.config)

    def _require_dynamic(self, what: str) -> None:
        if not self.dynamic:
            raise NotSupportedError(
                f"{what} needs LoraServingConfig(enable_dynamic_multi_lora=True); without it the "
                "adapters are those of lora_ckpt_paths, loaded at start-up"
            )

    def _bring_in(self, adapter_id: str, pinned: set[str]) -> None:
        taken = set(self.slot_of.values())
        free = [s for s in range(1, self.max_slots + 1) if s not in taken]
        if free:
            slot = free[0]
        else:
            evicted = next(i for i in self.recent if i not in pinned)
            slot = self.slot_of.pop(evicted)
            self.recent.pop(evicted)
        adapter, matrices = self._held(adapter_id, self.paths[adapter_id], check_fit=False)
        write_slot(self.weights, slot, adapter_id, matrices, adapter.scale, self._placement)
        self.slot_of[adapter_id] = slot
        self.recent[adapter_id] = None

    def _held(self, adapter_id: str, path: Path, check_fit: bool) -> tuple[Adapter, dict]:
        """The adapter's matrices from the host, or read from its folder into the host."""
        if adapter_id in self.on_host:
            self.on_host.move_to_end(adapter_id)
            return self.on_host[adapter_id]
        adapter = read_adapter(adapter_id, path)
        if adapter.rank > self.max_rank:
            raise CheckpointError(
                f"LoRA adapter {adapter_id!r} has rank {adapter.rank}, above max_lora_rank "
                f"({self.max_rank})"
            )
        matrices = in_model_layout(adapter_matrices(adapter), adapter_id, self.config)
        if check_fit and self.weights:  # write it to nowhere: the shapes are checked now
            scratch = {k: t[:1].clone() for k, t in self.weights.items()}
            write_slot(scratch, 0, adapter_id, matrices, adapter.scale, self._placement)
        self.on_host[adapter_id] = (adapter, matrices)
        while len(self.on_host) > self.max_on_host:
            self.on_host.popitem(last=False)
        return adapter, matrices


def adapter_store(application: NeuronBaseForCausalLM) -> AdapterStore:
    """The adapter store of an application whose config enables multi-LoRA."""
    builder = application.context.step_input_builders.get("adapter-ids")
    if builder is None:
        raise NotSupportedError(
            "this application serves no LoRA adapters: set NeuronConfig(lora_config="
            "LoraServingConfig(enable_dynamic_multi_lora=True, ...))"
        )
    return builder.store


def load_adapter(application: NeuronBaseForCausalLM, adapter_id: str, path: str | Path) -> None:
    """Add a PEFT adapter to a running application (dynamic multi-LoRA); it takes a slot when
    a request first names it. Nothing is recompiled."""
    adapter_store(application).register(adapter_id, Path(path))


def unload_adapter(application: NeuronBaseForCausalLM, adapter_id: str) -> None:
    """Remove an adapter from a running application; requests may no longer name it."""
    adapter_store(application).unregister(adapter_id)
