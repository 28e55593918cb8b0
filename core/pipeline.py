"""Resolve a config into the set of plugins it enables, and check that the set is consistent.

Selection follows the NxD Inference attributes: a feature, KV-cache strategy or speculation mode
is enabled when one of its ``enabled_by`` attributes is truthy; the model plugin comes from the
config's HF ``architectures`` / ``model_type``. The callbacks of the selected records (validate,
transform the model, add sub-models) then run, and no others.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import torch
from torch import nn

from nxdplug.contracts import optional, with_defaults
from nxdplug.errors import ConfigError, NxdPlugError
from nxdplug.modules.process_groups import TP, add_group, group_size
from nxdplug.registry import Registry, get_registry
from nxdplug.types import (
    CompileBackend,
    Feature,
    KVCacheStrategy,
    ModelArchitecture,
    ParallelGroup,
    SelectableRecord,
    SpeculationMode,
    StateDictConverter,
    StepInput,
)

if TYPE_CHECKING:
    from transformers import GenerationConfig

    from nxdplug.config import InferenceConfig, NeuronConfig
    from nxdplug.engine.token_choice import GraphSampling
    from nxdplug.generation.hf_adapter import TokenSource
    from nxdplug.modules.kv_cache import CacheLayout
    from nxdplug.runtime.application import NeuronBaseForCausalLM
    from nxdplug.runtime.model_wrapper import ModelWrapper

BACKEND_ENV = "NXDPLUG_BACKEND"


def requested_backend(neuron_config: NeuronConfig) -> str | None:
    """The backend a user asked for: NeuronConfig.compile_backend, then NXDPLUG_BACKEND."""
    return getattr(neuron_config, "compile_backend", None) or os.environ.get(BACKEND_ENV) or None


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
    "hybrid_sharding_config",
    "flash_decoding_enabled",
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
    step_inputs: tuple[StepInput, ...]
    parallel_groups: tuple[ParallelGroup, ...]
    plugins: frozenset[str]

    @property
    def enabled_records(self) -> tuple[SelectableRecord, ...]:
        """Every selected record that a config switches on (their callbacks run)."""
        chosen: tuple[SelectableRecord, ...] = (*self.features, self.kv_cache_strategy)
        if self.speculation_mode is not None:
            chosen += (self.speculation_mode,)
        return chosen + self.step_inputs + self.parallel_groups + self.converters

    def features_giving(self, field: str) -> tuple[Feature, ...]:
        """The selected features that give the callback ``field``."""
        return tuple(f for f in self.features if getattr(f, field) is not None)

    def with_backend(
        self, backend: CompileBackend, registry: Registry | None = None
    ) -> PluginSelection:
        """This selection compiled with ``backend`` instead of the one the config asked for."""
        registry = registry or get_registry()
        plugins = self.plugins - {registry.provider("compile_backends", self.compile_backend.name)}
        plugins |= {registry.provider("compile_backends", backend.name)}
        return attrs.evolve(self, compile_backend=backend, plugins=plugins)


def _architecture(config: InferenceConfig, registry: Registry) -> ModelArchitecture | None:
    architectures = getattr(config, "architectures", None) or ()
    model_type = getattr(config, "model_type", None)
    if not architectures and model_type is None:
        return None
    return registry.find_architecture(architectures, model_type)


def _single_choice(records: Iterable[Any], neuron_config: NeuronConfig, label: str) -> Any | None:
    chosen = [record for record in records if record.is_enabled_by(neuron_config)]
    if len(chosen) > 1:
        names = ", ".join(f"{r.name!r} (enabled by {', '.join(r.enabled_by)})" for r in chosen)
        raise ConfigError([f"the config enables more than one {label}: {names}; enable one"])
    return chosen[0] if chosen else None


# Feature callbacks whose one answer the application takes (where a graph's tokens are taken
# from): two enabled features giving the same one are refused, not one of them picked.
SINGLE_ANSWER_CALLBACKS = ("token_source", "request_sampling")


def _refuse_two_answers(selection: PluginSelection) -> None:
    problems = []
    for field in SINGLE_ANSWER_CALLBACKS:
        givers = selection.features_giving(field)
        if len(givers) > 1:
            names = ", ".join(f"{f.name!r} (enabled by {', '.join(f.enabled_by)})" for f in givers)
            problems.append(
                f"the config enables more than one feature that gives {field}: {names}; enable one"
            )
    if problems:
        raise ConfigError(problems)


def select_plugins(config: InferenceConfig, registry: Registry | None = None) -> PluginSelection:
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
    step_inputs = tuple(
        s for s in registry.records("step_inputs") if s.is_enabled_by(neuron_config)
    )
    groups = tuple(g for g in registry.records("parallel_groups") if g.is_enabled_by(neuron_config))
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
    chosen += [("step_inputs", s) for s in step_inputs]
    chosen += [("parallel_groups", g) for g in groups]
    if architecture is not None:
        chosen.append(("model_architectures", architecture))
    if speculation is not None:
        chosen.append(("speculation_modes", speculation))
    plugins = frozenset(registry.provider(kind, record.name) for kind, record in chosen)
    selection = PluginSelection(
        architecture=architecture,
        features=features,
        kv_cache_strategy=kv_cache,
        speculation_mode=speculation,
        compile_backend=backend,
        converters=converters,
        step_inputs=step_inputs,
        parallel_groups=groups,
        plugins=plugins,
    )
    _refuse_two_answers(selection)
    return selection


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
    selection: PluginSelection, neuron_config: NeuronConfig, registry: Registry
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


def _backend_problems(selection: PluginSelection, neuron_config: NeuronConfig) -> list[str]:
    backend = selection.compile_backend
    if backend.tp_degrees is not None and neuron_config.tp_degree not in backend.tp_degrees:
        return [
            f"tp_degree={neuron_config.tp_degree} is not supported by the {backend.name!r} "
            f"backend; supported: {list(backend.tp_degrees)}"
        ]
    return []


def settings_without_effect(
    selection: PluginSelection, neuron_config: NeuronConfig, registry: Registry
) -> dict[str, str]:
    """The settings other backends own (``CompileBackend.owned_settings``) that
    ``neuron_config`` sets to other than their defaults, which the selected backend ignores,
    each with the backend that reads it."""
    backend = selection.compile_backend
    owners = {
        name: record.name
        for record in registry.records("compile_backends")
        if record.name != backend.name
        for name in record.owned_settings
        if name not in backend.owned_settings
    }
    defaults = type(neuron_config)()
    return {
        name: owner
        for name, owner in sorted(owners.items())
        if hasattr(neuron_config, name) and getattr(neuron_config, name) != getattr(defaults, name)
    }


STRICT_CONFIG_ENV = "NXDPLUG_STRICT_CONFIG"


def _settings_without_effect_problems(
    selection: PluginSelection, neuron_config: NeuronConfig, registry: Registry
) -> list[str]:
    """The settings the selected backend ignores, reported once as a warning; with
    ``NXDPLUG_STRICT_CONFIG=1``, as problems of the config."""
    unused = settings_without_effect(selection, neuron_config, registry)
    if not unused:
        return []
    names = ", ".join(f"{name} (read by the {owner!r} backend)" for name, owner in unused.items())
    message = (
        f"{names}: no effect on the {selection.compile_backend.name!r} backend, which does not "
        "read it; kept in the config for a compile with that backend"
    )
    if os.environ.get(STRICT_CONFIG_ENV) == "1":
        return [f"{message} ({STRICT_CONFIG_ENV}=1 makes this an error; unset the settings)"]
    warnings.warn(message, RuntimeWarning, stacklevel=4)
    return []


class StepInputBuilder(Protocol):
    """The host side of a step-input plugin; built once per application with its config.

    ``example``, ``build`` and ``reset`` are required; the rest are optional (a builder has
    them only if it needs them; the core takes the bodies below as the answers otherwise).
    ``StepInput.builder`` is checked against this when the record is loaded.
    """

    def __init__(self, config: InferenceConfig) -> None: ...

    def example(self, batch_size: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Tensors of the graph's shapes ([batch_size, ...]) for tracing, by input name."""

    def build(
        self, batch_size: int, keywords: Mapping[str, Any], device: torch.device
    ) -> dict[str, torch.Tensor]:
        """This step's tensors, by input name, from the caller's keywords (those the record
        declares; absent ones are missing from ``keywords``). Refuse what cannot be honoured."""

    def reset(self) -> None:
        """A new generation starts (reseed a generator, ...)."""

    @optional
    def bind(self, application: NeuronBaseForCausalLM) -> None:
        """The application's model is loaded (eager or compiled): a builder that acts on it
        (writing adapter weights into their slots) takes it here, each time."""

    @optional
    def row_problem(self, keyword: str, value: Any) -> str | None:
        """Why the serving engine cannot serve one request's ``value`` of ``keyword`` (an
        adapter nobody registered); the request is refused with it, before it waits."""
        return None

    @optional
    def rows_fit(self, keyword: str, values: Sequence[Any]) -> bool:
        """Whether rows with these values of ``keyword`` can run in one step (no more distinct
        adapters than slots); a request waits until it fits beside the running ones."""
        return True

    @optional
    def served_names(self) -> Mapping[str, Mapping[str, Any]]:
        """Names a server offers as models beside the base model, each with the step keywords
        of a request that names it (an adapter by its id)."""
        return {}


_ACTIVE_CONTEXT: ContextVar[PipelineContext | None] = ContextVar("nxdplug_pipeline", default=None)


@attrs.define(eq=False)
class PipelineContext:
    """What the record callbacks of one application get.

    Made once per application (or per config being checked, with ``model_cls`` None): the
    config, the plugin selection, the model class, the device, and the step-input builders of
    the selected step inputs, which keep their state (a sampler's generator) for the
    application's life.
    """

    config: InferenceConfig
    selection: PluginSelection
    model_cls: type[nn.Module] | None = None
    _builders: dict[str, StepInputBuilder] | None = attrs.field(default=None, init=False)
    _running_on: torch.device | None = attrs.field(default=None, init=False)

    @property
    def neuron_config(self) -> NeuronConfig:
        return self.config.neuron_config

    @property
    def device(self) -> torch.device:
        """Where the model runs: the device of the backend that loaded it (``run_on``), else
        the selected backend's."""
        if self._running_on is not None:
            return self._running_on
        return torch.device(self.selection.compile_backend.device)

    def run_on(self, backend: CompileBackend) -> None:
        """The model is about to be loaded by ``backend`` (``to_cpu()`` uses the eager one
        whatever the config selects; a compiled folder names its own)."""
        self._running_on = torch.device(backend.device)

    def _callbacks(self, field: str) -> Iterator[Any]:
        for record in self.selection.enabled_records:
            if getattr(record, field) is not None:
                yield record.load(field)

    def problems(self) -> list[str]:
        """What the selected records' ``validate`` callbacks report."""
        return [p for check in self._callbacks("validate") for p in check(self)]

    def transform_model(self, model: nn.Module) -> None:
        """Let the selected records change a freshly built model."""
        for transform in self._callbacks("transform_model"):
            transform(model, self)

    def extra_submodels(self) -> list[ModelWrapper]:
        """The ModelWrappers the selected records add."""
        return [w for add in self._callbacks("add_submodels") for w in add(self)]

    def _single_answer(self, field: str) -> Any | None:
        """The ``field`` callback of the enabled feature that gives it (one at most: see
        :func:`select_plugins`), or None."""
        givers = self.selection.features_giving(field)
        return givers[0].load(field) if givers else None

    def token_source(
        self,
        generation_config: GenerationConfig,
        batch_size: int,
        step_keywords: dict[str, Any],
        generate_kwargs: dict[str, Any],
    ) -> TokenSource | None:
        """Where ``generate()`` takes each step's tokens from, when an enabled feature gives
        them (a model that samples in its graph); None: the host samples."""
        source = self._single_answer("token_source")
        if source is None:
            return None
        return source(self, generation_config, batch_size, step_keywords, generate_kwargs)

    def request_sampling(self) -> GraphSampling | None:
        """How the serving engine hands each request's sampling settings to a model that
        samples in its graph, when an enabled feature says; None: the engine samples."""
        sampling = self._single_answer("request_sampling")
        return None if sampling is None else sampling(self)

    def build_model(self) -> nn.Module:
        """The model class built for this config, transformed by the enabled plugins."""
        if self.model_cls is None:
            raise NxdPlugError("this pipeline context checks a config and builds no model")
        with self.active():
            model = self.model_cls(self.config)
            self.transform_model(model)
        return model

    def lay_out_process_groups(self) -> None:
        """Make the process groups the selected plugins declare, on every rank alike."""
        for record in self.selection.parallel_groups:
            partition = record.load("partition")(group_size(TP), self.config)
            add_group(record.name, partition)

    def kv_cache(self, layout: CacheLayout) -> nn.Module:
        """A KV-cache manager of the selected strategy for ``layout``."""
        return self.selection.kv_cache_strategy.load("implementation")(layout)

    def step_inputs_for(self, tag: str, takes_unnamed: bool = True) -> tuple[StepInput, ...]:
        """The selected step inputs a sub-model with this tag takes: those naming the tag in
        their ``phases``, and, when ``takes_unnamed``, those naming no phase."""
        return tuple(
            s
            for s in self.selection.step_inputs
            if tag in s.phases or (takes_unnamed and not s.phases)
        )

    @property
    def step_input_builders(self) -> dict[str, StepInputBuilder]:
        """The builders of the selected step inputs, by record name (made once)."""
        if self._builders is None:
            self._builders = {
                s.name: s.load("builder")(self.config) for s in self.selection.step_inputs
            }
        return self._builders

    def step_input_builder(self, record: StepInput) -> StepInputBuilder:
        """The application's builder of a selected step input."""
        return self.step_input_builders[record.name]

    def step_keywords(self) -> frozenset[str]:
        """The forward() / generate() keywords the selected step inputs take."""
        return frozenset(k for s in self.selection.step_inputs for k in s.keywords)

    def bind(self, application: NeuronBaseForCausalLM) -> None:
        """The application's model is loaded (eager or compiled): builders that act on it
        (:meth:`StepInputBuilder.bind`) get it."""
        for builder in self.step_input_builders.values():
            with_defaults(builder, StepInputBuilder).bind(application)

    def reset(self) -> None:
        """A new generation starts: every step-input builder resets."""
        for builder in self.step_input_builders.values():
            builder.reset()

    @contextmanager
    def active(self) -> Iterator[PipelineContext]:
        """Make this the context :func:`current_context` returns inside the block."""
        token = _ACTIVE_CONTEXT.set(self)
        try:
            yield self
        finally:
            _ACTIVE_CONTEXT.reset(token)


def current_context(config: InferenceConfig) -> PipelineContext:
    """The active context of ``config`` (while an application builds its model), or a new one.

    Model classes keep NxD Inference's constructor, ``(config)``; this is how one built by an
    application reaches the application's selection instead of computing it again.
    """
    active = _ACTIVE_CONTEXT.get()
    if active is not None and active.config is config:
        return active
    return PipelineContext(config, select_plugins(config))


def _problems_and_selection(
    config: InferenceConfig, registry: Registry
) -> tuple[list[str], PluginSelection | None]:
    from nxdplug.config.validation import core_config_problems, unknown_attribute_problems

    problems = list(core_config_problems(config))
    settings = {name for f in registry.records("features") for name in f.settings}
    problems += unknown_attribute_problems(config.neuron_config, settings)
    try:
        selection = select_plugins(config, registry)
    except ConfigError as exc:
        return problems + exc.problems, None
    except NxdPlugError as exc:
        return [*problems, str(exc)], None
    problems += _feature_problems(selection, registry)
    problems += _unimplemented_attribute_problems(selection, config.neuron_config, registry)
    problems += _backend_problems(selection, config.neuron_config)
    problems += _settings_without_effect_problems(selection, config.neuron_config, registry)
    problems += PipelineContext(config, selection).problems()
    return problems, selection


def config_problems(config: InferenceConfig, registry: Registry | None = None) -> list[str]:
    """Every problem of ``config``: core rules, unknown attributes, plugin sets, plugin checks."""
    return _problems_and_selection(config, registry or get_registry())[0]


def validate(config: InferenceConfig, source: str | None = None) -> PluginSelection:
    """Check ``config`` and return its plugin set; raise one ConfigError listing all problems."""
    problems, selection = _problems_and_selection(config, get_registry())
    if problems or selection is None:
        raise ConfigError(problems, source=source)
    return selection
