"""Resolve a config into the set of plugins it enables, and check that the set is consistent.

Selection follows the NxD Inference attributes: a feature, KV-cache strategy or speculation mode
is enabled when one of its ``enabled_by`` attributes is truthy; the model plugin comes from the
config's HF ``architectures`` / ``model_type``. Pipeline hooks (validate, transform the model,
add sub-models) are then called only for the plugins in that set.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from nxdplug.compile.backend import requested_backend
from nxdplug.errors import ConfigError, NxdPlugError
from nxdplug.registry import Registry, get_registry
from nxdplug.types import (
    CompileBackend,
    Feature,
    KVCacheStrategy,
    ModelArchitecture,
    SpeculationMode,
    StateDictConverter,
)

# NxD Inference attributes whose behaviour lives in a plugin: switching one on without an
# installed plugin that declares it in ``enabled_by`` is a problem, never a silent no-op.
PLUGIN_PROVIDED_ATTRIBUTES = (
    "on_device_sampling_config",
    "quantized",
    "kv_cache_quant",
    "speculation_length",
    "is_medusa",
    "enable_eagle_speculation",
    "enable_fused_speculation",
    "is_eagle_draft",
    "lora_config",
    "flash_decoding_enabled",
    "async_mode",
    "qk_layernorm",
    "draft_model_modules_to_not_convert",
)

DEFAULT_KV_CACHE_STRATEGY = "static"
DEFAULT_BACKEND = "eager"


@attrs.frozen
class PluginSelection:
    """The plugins one config enables, and the records it selected from them."""

    architecture: ModelArchitecture | None
    features: tuple[Feature, ...]
    kv_cache_strategy: KVCacheStrategy
    speculation_mode: SpeculationMode | None
    compile_backend: CompileBackend
    converters: tuple[StateDictConverter, ...]
    plugins: frozenset[str]


def _architecture(config: Any, registry: Registry) -> ModelArchitecture | None:
    architectures = getattr(config, "architectures", None) or ()
    model_type = getattr(config, "model_type", None)
    if not architectures and model_type is None:
        return None
    return registry.find_architecture(architectures, model_type)


def _single_choice(records: Iterable[Any], neuron_config: Any, label: str) -> Any | None:
    chosen = [record for record in records if record.is_enabled_by(neuron_config)]
    if len(chosen) > 1:
        names = ", ".join(f"{r.name!r} (enabled by {', '.join(r.enabled_by)})" for r in chosen)
        raise ConfigError([f"the config enables more than one {label}: {names}; enable one"])
    return chosen[0] if chosen else None


def select_plugins(config: Any, registry: Registry | None = None) -> PluginSelection:
    """The plugins ``config`` enables; raises when a named or implied choice does not exist."""
    registry = registry or get_registry()
    neuron_config = config.neuron_config
    architecture = _architecture(config, registry)
    features = tuple(f for f in registry.records("features") if f.is_enabled_by(neuron_config))
    kv_cache = _single_choice(
        registry.records("kv_cache_strategies"), neuron_config, "KV-cache strategy"
    ) or registry.get("kv_cache_strategies", DEFAULT_KV_CACHE_STRATEGY)
    speculation = _single_choice(
        registry.records("speculation_modes"), neuron_config, "speculation mode"
    )
    backend = registry.get("compile_backends", requested_backend(neuron_config) or DEFAULT_BACKEND)
    model_type = architecture.model_type if architecture else getattr(config, "model_type", "")
    converters = tuple(
        sorted(
            (
                c
                for c in registry.records("state_dict_converters")
                if c.applies_to(model_type, neuron_config)
            ),
            key=lambda c: c.order,
        )
    )

    chosen: list[tuple[str, Any]] = [("features", f) for f in features]
    chosen += [("kv_cache_strategies", kv_cache), ("compile_backends", backend)]
    chosen += [("state_dict_converters", c) for c in converters]
    if architecture is not None:
        chosen.append(("model_architectures", architecture))
    if speculation is not None:
        chosen.append(("speculation_modes", speculation))
    plugins = frozenset(registry.provider(kind, record.name) for kind, record in chosen)
    return PluginSelection(
        architecture=architecture,
        features=features,
        kv_cache_strategy=kv_cache,
        speculation_mode=speculation,
        compile_backend=backend,
        converters=converters,
        plugins=plugins,
    )


def _feature_problems(selection: PluginSelection, registry: Registry) -> list[str]:
    enabled = {f.name for f in selection.features}
    known = set(registry.names("features"))
    problems = []
    for feature in selection.features:
        for needed in feature.requires:
            if needed not in enabled:
                state = "is not enabled" if needed in known else "is not installed"
                problems.append(f"feature {feature.name!r} requires {needed!r}, which {state}")
        problems += [
            f"feature {feature.name!r} cannot be combined with {other!r}; disable one of them"
            for other in feature.conflicts_with
            if other in enabled
        ]
    return problems


def _unimplemented_attribute_problems(
    selection: PluginSelection, neuron_config: Any, registry: Registry
) -> list[str]:
    declared = {
        attribute
        for kind in ("features", "kv_cache_strategies", "speculation_modes")
        for record in registry.records(kind)
        for attribute in record.enabled_by
    }
    problems = [
        f"{name}={getattr(neuron_config, name)!r} is set, but no installed plugin implements "
        f"it; install the plugin that provides {name}, or unset it"
        for name in PLUGIN_PROVIDED_ATTRIBUTES
        if getattr(neuron_config, name, None) and name not in declared
    ]
    if not neuron_config.trace_tokengen_model and selection.speculation_mode is None:
        problems.append(
            "trace_tokengen_model=False leaves no sub-model to generate tokens with; it is for "
            "speculative decoding (speculation_length with a speculation plugin), so set it to "
            "True otherwise"
        )
    return problems


NEURON_KERNEL_FLAGS = (
    "attn_kernel_enabled",
    "qkv_kernel_enabled",
    "mlp_kernel_enabled",
    "quantized_mlp_kernel_enabled",
    "rmsnorm_quantize_kernel_enabled",
)


def _backend_problems(selection: PluginSelection, neuron_config: Any) -> list[str]:
    backend = selection.compile_backend
    problems = []
    if backend.tp_degrees is not None and neuron_config.tp_degree not in backend.tp_degrees:
        problems.append(
            f"tp_degree={neuron_config.tp_degree} is not supported by the {backend.name!r} "
            f"backend; supported: {list(backend.tp_degrees)}"
        )
    if "nki-kernels" not in backend.capabilities:
        problems += [
            f"{flag}=True selects a Neuron (NKI) kernel, which the {backend.name!r} backend "
            f"cannot run; set {flag}=False or compile with the neuron backend"
            for flag in NEURON_KERNEL_FLAGS
            if getattr(neuron_config, flag, False)
        ]
    return problems


def hook_caller(name: str, selection: PluginSelection) -> Any:
    """The pipeline hook ``name``, restricted to the plugins of ``selection``."""
    manager = get_registry().manager
    others = [
        plugin
        for plugin_name, plugin in manager.list_name_plugin()
        if plugin_name not in selection.plugins
    ]
    return manager.subset_hook_caller(name, remove_plugins=others)


def config_problems(config: Any, registry: Registry | None = None) -> list[str]:
    """Every problem of ``config``: core rules, unknown attributes, plugin sets, plugin checks."""
    from nxdplug.config.validation import core_config_problems, unknown_attribute_problems

    registry = registry or get_registry()
    problems = list(core_config_problems(config))
    settings = {name for f in registry.records("features") for name in f.settings}
    problems += unknown_attribute_problems(config.neuron_config, settings)
    try:
        selection = select_plugins(config, registry)
    except ConfigError as exc:
        return problems + exc.problems
    except NxdPlugError as exc:
        return [*problems, str(exc)]
    problems += _feature_problems(selection, registry)
    problems += _unimplemented_attribute_problems(selection, config.neuron_config, registry)
    problems += _backend_problems(selection, config.neuron_config)
    for plugin_problems in hook_caller("nxdplug_validate_config", selection)(config=config):
        problems += list(plugin_problems or ())
    return problems


def validate(config: Any, source: str | None = None) -> PluginSelection:
    """Check ``config`` and return its plugin set; raise one ConfigError listing all problems."""
    problems = config_problems(config)
    if problems:
        raise ConfigError(problems, source=source)
    return select_plugins(config)
