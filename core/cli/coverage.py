"""Which plugin, backend or core code handles each attribute the API reference documents.

The reference (``api-reference.rst``) lists NeuronConfig's attributes and its sub-configs'
under section titles, as ``- ``name`` - description`` lines. :func:`documented_attributes`
reads them; :func:`status` says, for the installed plugins, who reads each one:

- ``core``: the core reads it (:data:`CORE_ATTRIBUTES`, a reviewed list);
- ``plugin <name>``: a selectable record's ``enabled_by`` or a feature's
  ``settings`` names it, or it is read with an attribute that does (:data:`READ_WITH`); a
  sub-config's attributes belong to the plugin its attribute enables;
- ``backend <name>``: a compile backend's ``owned_settings`` (reported as without effect on
  the others);
- ``refused``: a plugin-provided attribute no installed plugin declares (a config error);
- ``gap``: silently ignored today, listed in :data:`KNOWN_GAPS` with its issue;
- ``unhandled``: none of these, which the coverage test refuses.

``python -m nxdplug.cli.coverage --markdown`` prints the table of ``docs/api-coverage.md``.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from nxdplug.registry import Registry, get_registry

if TYPE_CHECKING:
    from nxdplug.config import NeuronConfig

# The section titles of the reference whose attributes are covered, and the nxdplug.config
# class of each.
CONFIG_CLASSES = (
    "NeuronConfig",
    "OnDeviceSamplingConfig",
    "LoraServingConfig",
    "MoENeuronConfig",
    "RouterConfig",
    "BlockwiseMatmulConfig",
    "HybridShardingConfig",
    "RoutedExpertsMLPOpsConfig",
    "MoEFusedTKGConfig",
    "FusedSpecNeuronConfig",
)

_TITLE_UNDERLINE = re.compile(r"^~{3,}\s*$")
_ITEM = re.compile(r"^(?P<indent>\s*)- ``(?P<name>[\w\-]+)(?:\([^)]*\))?``")
_SUB_CONFIG = re.compile(r"``(?P<cls>\w+Config)``")


@attrs.frozen(order=True)
class DocumentedAttribute:
    """One attribute of one config class, as the reference documents it."""

    config_class: str
    name: str

    @property
    def label(self) -> str:
        return f"{self.config_class}.{self.name}"


def documented_attributes(text: str) -> list[DocumentedAttribute]:
    """Every attribute of the :data:`CONFIG_CLASSES` that the reference ``text`` documents.

    Items nested under an attribute whose description names a ``...Config`` class belong to
    that class (``on_device_sampling_config`` lists OnDeviceSamplingConfig's); items nested
    under any other attribute (a JSON file's fields) are not attributes.
    """
    lines = text.splitlines()
    found: dict[DocumentedAttribute, None] = {}
    section: str | None = None
    in_attributes = False
    parents: list[tuple[int, str | None]] = []  # (indent, owning class of nested items)
    for number, line in enumerate(lines):
        following = lines[number + 1] if number + 1 < len(lines) else ""
        if _TITLE_UNDERLINE.match(following) and line.strip():
            section, in_attributes, parents = line.strip(), False, []
            continue
        if line.strip() == "Attributes":
            in_attributes, parents = True, []
            continue
        if line.strip() in ("Functions", "Initialization"):
            in_attributes = False
            continue
        match = _ITEM.match(line)
        if not (in_attributes and section in CONFIG_CLASSES and match):
            continue
        indent = len(match["indent"])
        while parents and parents[-1][0] >= indent:
            parents.pop()
        owner = parents[-1][1] if parents else section
        name = match["name"].replace("-", "_")
        if owner is not None:
            found[DocumentedAttribute(owner, name)] = None
        # What the item's nested items document: the class its description names, if any.
        description = line + " " + " ".join(lines[number + 1 : number + 4])
        nested = _SUB_CONFIG.search(description[match.end() :])
        parents.append((indent, nested["cls"] if nested and owner is not None else None))
    return sorted(found)


# A sub-config's attributes are read by whoever handles the attribute that holds it.
SUB_CONFIG_ATTRIBUTES = {
    "OnDeviceSamplingConfig": "on_device_sampling_config",
    "LoraServingConfig": "lora_config",
    "HybridShardingConfig": "hybrid_sharding_config",
    "RouterConfig": "router_config",
    "BlockwiseMatmulConfig": "blockwise_matmul_config",
    "FusedSpecNeuronConfig": "enable_fused_speculation",
}

_SELECTABLE_KINDS = (
    "features",
    "kv_cache_strategies",
    "speculation_modes",
    "step_inputs",
    "parallel_groups",
    "state_dict_converters",
)

# Attributes the core reads, reviewed by hand: the classifier cannot see a read in code. Each
# with where it is read. The coverage test checks every entry is a documented, real field.
CORE_ATTRIBUTES: dict[str, str] = {
    "MoEFusedTKGConfig.expert_mlp_kernel_enabled": "modules/moe/moe.py: warned, no effect",
    "MoEFusedTKGConfig.moe_fused_kernel_enabled": "modules/moe/moe.py: warned, no effect",
    "MoEFusedTKGConfig.quantized": "modules/moe/moe.py: warned, no effect",
    "MoEFusedTKGConfig.router_topk_kernel_enabled": "modules/moe/moe.py: warned, no effect",
    "MoEFusedTKGConfig.shared_mlp_kernel_enabled": "modules/moe/moe.py: warned, no effect",
    "MoENeuronConfig.capacity_factor": "modules/moe/moe.py: to the experts",
    "MoENeuronConfig.early_expert_affinity_modulation": "modules/moe/moe.py: to the experts",
    "MoENeuronConfig.fused_shared_experts": "modules/moe/moe.py",
    "MoENeuronConfig.gate_clamp_lower_limit": "modules/moe/moe.py: to the experts",
    "MoENeuronConfig.gate_clamp_upper_limit": "modules/moe/moe.py: to the experts",
    "MoENeuronConfig.glu_mlp": "modules/moe/moe.py: to the experts",
    "MoENeuronConfig.glu_type": "modules/moe/moe.py: to the experts",
    "MoENeuronConfig.hidden_act_bias": "modules/moe/moe.py: to the experts",
    "MoENeuronConfig.hidden_act_scaling_factor": "modules/moe/moe.py: to the experts",
    "MoENeuronConfig.moe_ep_degree": "modules/moe/parallel.py",
    "MoENeuronConfig.moe_tp_degree": "modules/moe/parallel.py",
    "MoENeuronConfig.normalize_top_k_affinities": "modules/moe/moe.py: to the experts",
    "MoENeuronConfig.return_expert_index": "modules/moe/moe.py",
    "MoENeuronConfig.return_router_logits": "modules/moe/moe.py",
    "MoENeuronConfig.router_config": "modules/moe/routing.py",
    "MoENeuronConfig.shared_experts_sequence_parallel_enabled": "config/moe.py: refused",
    "MoENeuronConfig.transpose_shared_experts_weights": "modules/moe/moe.py",
    "MoENeuronConfig.up_clamp_lower_limit": "modules/moe/moe.py: to the experts",
    "MoENeuronConfig.up_clamp_upper_limit": "modules/moe/moe.py: to the experts",
    "NeuronConfig.async_mode": "engine/engine.py, runtime/step_ahead.py: the next step runs ahead",
    "NeuronConfig.attention_dtype": "modules/attention.py",
    "NeuronConfig.batch_size": "runtime/model_wrapper.py: every sub-model's batch",
    "NeuronConfig.cast_type": "runtime/application.py: how weights are cast",
    "NeuronConfig.context_encoding_buckets": "runtime/model_wrapper.py",
    "NeuronConfig.ctx_batch_size": "runtime/model_wrapper.py",
    "NeuronConfig.is_continuous_batching": "engine/engine.py, runtime/model_wrapper.py",
    "NeuronConfig.enable_bucketing": "runtime/model_wrapper.py: buckets",
    "NeuronConfig.max_batch_size": "modules/kv_cache.py: KV-cache rows",
    "NeuronConfig.max_context_length": "runtime/model_wrapper.py: the context-encoding length",
    "NeuronConfig.max_length": "modules/kv_cache.py, generation/hf_adapter.py",
    "NeuronConfig.max_new_tokens": "generation/hf_adapter.py: tokens generated",
    "NeuronConfig.n_active_tokens": "config/validation.py: refused unless seq_len",
    "NeuronConfig.n_positions": "config/validation.py: refused unless seq_len",
    "NeuronConfig.output_logits": "generation/hf_adapter.py: logits returned",
    "NeuronConfig.padding_side": "config/validation.py : left or right",
    "NeuronConfig.qk_layernorm": "modules/attention.py: per-head q/k RMSNorm",
    "NeuronConfig.rpl_reduce_dtype": "modules/parallel_linear.py: row-parallel reduce dtype",
    "NeuronConfig.save_sharded_checkpoint": "compile/compiled_model.py",
    "NeuronConfig.seq_len": "runtime/model_base.py, model_wrapper.py: KV-cache length and buckets",
    "NeuronConfig.sequence_parallel_enabled": "modules/sequence_parallel.py, runtime/model_base.py",
    "NeuronConfig.skip_sharding": "compile/compiled_model.py",
    "NeuronConfig.skip_warmup": "compile/compiled_model.py",
    "NeuronConfig.spec_batch_size": "runtime/model_wrapper.py",
    "NeuronConfig.tkg_batch_size": "runtime/model_wrapper.py",
    "NeuronConfig.token_generation_buckets": "runtime/model_wrapper.py",
    "NeuronConfig.torch_dtype": "runtime/application.py, checkpoint/state_dict.py: weights' dtype",
    "NeuronConfig.tp_degree": "modules/tensor_parallel.py and the parallel layers",
    "RoutedExpertsMLPOpsConfig.bias": "modules/moe/expert_mlps.py: shapes",
    "RoutedExpertsMLPOpsConfig.capacity_factor": "modules/moe/expert_mlps.py",
    "RoutedExpertsMLPOpsConfig.early_expert_affinity_modulation": "modules/moe/expert_mlps.py",
    "RoutedExpertsMLPOpsConfig.enable_spmd_rank": "modules/moe/expert_mlps.py: warned, no effect",
    "RoutedExpertsMLPOpsConfig.gate_clamp_lower_limit": "modules/moe/expert_mlps.py",
    "RoutedExpertsMLPOpsConfig.gate_clamp_upper_limit": "modules/moe/expert_mlps.py",
    "RoutedExpertsMLPOpsConfig.glu_mlp": "modules/moe/expert_mlps.py",
    "RoutedExpertsMLPOpsConfig.glu_type": "modules/moe/expert_mlps.py",
    "RoutedExpertsMLPOpsConfig.hidden_act": "modules/moe/expert_mlps.py: shapes",
    "RoutedExpertsMLPOpsConfig.hidden_act_bias": "modules/moe/expert_mlps.py",
    "RoutedExpertsMLPOpsConfig.hidden_act_scaling_factor": "modules/moe/expert_mlps.py",
    "RoutedExpertsMLPOpsConfig.hidden_size": "modules/moe/expert_mlps.py: shapes",
    "RoutedExpertsMLPOpsConfig.input_layer_init_method": "modules/moe/expert_mlps.py: gate_up",
    "RoutedExpertsMLPOpsConfig.is_prefill": "modules/moe/expert_mlps.py: picks the path",
    "RoutedExpertsMLPOpsConfig.intermediate_size": "modules/moe/expert_mlps.py: shapes",
    "RoutedExpertsMLPOpsConfig.normalize_top_k_affinities": "modules/moe/expert_mlps.py",
    "RoutedExpertsMLPOpsConfig.num_experts": "modules/moe/expert_mlps.py: shapes",
    "RoutedExpertsMLPOpsConfig.output_layer_init_method": "modules/moe/expert_mlps.py: down",
    "RoutedExpertsMLPOpsConfig.top_k": "modules/moe/expert_mlps.py: shapes",
    "RoutedExpertsMLPOpsConfig.up_clamp_lower_limit": "modules/moe/expert_mlps.py",
    "RoutedExpertsMLPOpsConfig.up_clamp_upper_limit": "modules/moe/expert_mlps.py",
    "RoutedExpertsMLPOpsConfig.use_index_calc_kernel": "modules/moe/moe.py",
    "RouterConfig.act_fn": "modules/moe/routing.py",
    "RouterConfig.dtype": "modules/moe/routing.py",
}

# Attributes read by the plugin another attribute enables, which does not declare them (they are
# not in its enabled_by or settings), reviewed by hand: label -> (enabling attribute, where).
READ_WITH: dict[str, tuple[str, str]] = {
    "NeuronConfig.enable_eagle_draft_input_norm": ("enable_eagle_speculation", "the draft model"),
    "NeuronConfig.medusa_speculation_length": ("is_medusa", "the speculator"),
    "NeuronConfig.medusa_tree": ("is_medusa", "the speculator's tree"),
    "NeuronConfig.num_medusa_heads": ("is_medusa", "the heads"),
    "NeuronConfig.modules_to_not_convert": ("quantized", "the modules left unquantized"),
    "NeuronConfig.quantization_dtype": ("quantized", "selects the method"),
    "NeuronConfig.quantization_type": ("quantized", "selects the method"),
    "NeuronConfig.quantized_checkpoints_path": ("quantized", "where the checkpoint is"),
}

# Attributes the reference documents that nxdplug accepts and then ignores, with no word to the
# user; each with its issue. The coverage test prints them, and fails when one is handled (so
# the list only shrinks).
KNOWN_GAPS: dict[str, str] = {}


def _handlers(registry: Registry) -> dict[str, list[str]]:
    """Attribute name (dotted within NeuronConfig for a sub-config's) -> who handles it."""
    handlers: dict[str, list[str]] = {}

    def add(name: str, handler: str) -> None:
        if handler not in handlers.setdefault(name, []):
            handlers[name].append(handler)

    for kind in _SELECTABLE_KINDS:
        for record in registry.records(kind):
            plugin = f"plugin {registry.provider(kind, record.name)}"
            for name in record.enabled_by:
                add(name, plugin)
            for name in (
                *getattr(record, "settings", {}),
                *getattr(record, "runtime_settings", ()),
            ):
                add(name, plugin)
    for record in registry.records("compile_backends"):
        for name in record.owned_settings:
            add(name, f"backend {record.name}")
    return handlers


def status(attribute: DocumentedAttribute, handlers: dict[str, list[str]]) -> str:
    """Who handles ``attribute``: ``plugin <name>`` / ``backend <name>`` (comma-joined when
    several), ``core``, ``refused`` (a plugin-provided attribute no installed plugin declares:
    setting it is a config error), ``gap (<issue>)`` or ``unhandled``."""
    from nxdplug.pipeline import PLUGIN_PROVIDED_ATTRIBUTES

    found = []
    if attribute.config_class.endswith("NeuronConfig"):
        found += handlers.get(attribute.name, [])
    holder = SUB_CONFIG_ATTRIBUTES.get(attribute.config_class)
    if holder is not None:
        found += handlers.get(f"{holder}.{attribute.name}", [])
        found += [h for h in handlers.get(holder, []) if h not in found]
    if attribute.label in READ_WITH:
        found += handlers.get(READ_WITH[attribute.label][0], [])
    if found:
        return ", ".join(dict.fromkeys(found))
    if attribute.label in CORE_ATTRIBUTES:
        return "core"
    if attribute.config_class == "NeuronConfig" and attribute.name in PLUGIN_PROVIDED_ATTRIBUTES:
        return "refused"
    if attribute.label in KNOWN_GAPS:
        return f"gap ({KNOWN_GAPS[attribute.label]})"
    return "unhandled"


def reference_text(path: Path | None = None) -> str:
    """The API reference: ``path``, or ``$NXDPLUG_REFERENCE``, or ../shared/reference."""
    if path is None:
        default = Path(__file__).resolve().parents[2].parent / "shared" / "reference"
        path = Path(os.environ.get("NXDPLUG_REFERENCE", default / "api-reference.rst"))
    return path.read_text(errors="replace")


def coverage(
    text: str | None = None, registry: Registry | None = None
) -> dict[DocumentedAttribute, str]:
    """Every documented attribute with its status for the installed plugins."""
    handlers = _handlers(registry or get_registry())
    return {a: status(a, handlers) for a in documented_attributes(text or reference_text())}


def markdown_table(statuses: dict[DocumentedAttribute, str]) -> str:
    """The table of ``docs/api-coverage.md``: one row per documented attribute."""
    rows = ["| Attribute | Handled by |", "| --- | --- |"]
    rows += [f"| `{a.label}` | {statuses[a]} |" for a in sorted(statuses)]
    return "\n".join(rows) + "\n"


def explain(neuron_config: NeuronConfig, registry: Registry | None = None) -> dict[str, str]:
    """For each NeuronConfig attribute set to other than its default: who handles it."""
    handlers = _handlers(registry or get_registry())
    defaults = type(neuron_config)()
    cls = "MoENeuronConfig" if type(neuron_config).__name__ == "MoENeuronConfig" else None
    result = {}
    for field in attrs.fields(type(neuron_config)):
        value = getattr(neuron_config, field.name)
        if value == getattr(defaults, field.name):
            continue
        owner = "MoENeuronConfig" if cls and f"MoENeuronConfig.{field.name}" in _LABELS else None
        result[field.name] = status(
            DocumentedAttribute(owner or "NeuronConfig", field.name), handlers
        )
    return result


_LABELS = frozenset(CORE_ATTRIBUTES) | frozenset(READ_WITH) | frozenset(KNOWN_GAPS)


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nxdplug.cli.coverage")
    parser.add_argument(
        "--markdown", action="store_true", help="print the table of docs/api-coverage.md"
    )
    parser.add_argument("--reference", type=Path, help="api-reference.rst")
    args = parser.parse_args(None if argv is None else list(argv))
    statuses = coverage(reference_text(args.reference))
    if args.markdown:
        print(markdown_table(statuses), end="")
    else:
        for attribute, state in sorted(statuses.items()):
            print(f"{attribute.label:60} {state}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
