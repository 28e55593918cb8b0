"""Registration records: what a plugin says it provides.

Every record is a small frozen attrs class with a validated ``name``. Code is referenced lazily
as ``"package.module:attribute"`` strings, so building and listing records imports nothing heavy;
:meth:`PluginRecord.load` imports a reference when the component is actually used, and checks
it against the protocol its field names (``follows``, see :mod:`nxdplug.contracts`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from nxdplug.contracts import contract_problems
from nxdplug.errors import PluginError
from nxdplug.lazy import is_ref, resolve_ref

if TYPE_CHECKING:
    from nxdplug.config import NeuronConfig

_NAME = re.compile(r"^[a-z][a-z0-9_.\-]*$")


def _check_name(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be lower-case letters, digits, "
            f"'_', '-' or '.', starting with a letter; got {value!r}"
        )


def _check_ref(instance: object, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None and not is_ref(value):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be a 'package.module:attribute' "
            f"reference; got {value!r}"
        )


def _str_tuple(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(value)


def ref_field(*, follows: str | None = None, **kwargs: Any) -> Any:
    """An attrs field holding a ``"package.module:attribute"`` reference (records of plugins
    that add their own hooks use it too). ``follows`` references the protocol (or base class)
    the object must follow; it is checked when the record is loaded, not when listed."""
    metadata = {} if follows is None else {"follows": follows}
    return attrs.field(validator=_check_ref, metadata=metadata, **kwargs)


def _names_field() -> Any:
    return attrs.field(default=(), converter=_str_tuple)


@attrs.frozen(kw_only=True)
class PluginRecord:
    """Base of every record: a unique ``name`` within its kind and a one-line description."""

    name: str = attrs.field(validator=_check_name)
    description: str = ""

    def load(self, field_name: str) -> Any:
        """Import and return the object a reference field points to; raise PluginError,
        naming the plugin, when it does not follow the protocol the field names."""
        reference = getattr(self, field_name)
        loaded = resolve_ref(reference)
        follows = attrs.fields_dict(type(self))[field_name].metadata.get("follows")
        problems = [] if follows is None else contract_problems(loaded, resolve_ref(follows))
        if problems:
            from nxdplug.registry import get_registry  # the registry imports the records

            raise PluginError(
                f"{get_registry().describe(self)}: its {field_name} {reference} does not "
                f"follow {follows}: it {'; it '.join(problems)}"
            )
        return loaded


@attrs.frozen(kw_only=True)
class SelectableRecord(PluginRecord):
    """A record a config switches on through NxD Inference attributes.

    ``enabled_by`` names NeuronConfig attributes; the record is selected when any of them is
    truthy (``is_medusa``, ``kv_cache_quant``, ...), or, with ``enabled_when_set``, when any is
    set to something other than None (so that a numeric setting of 0 is seen, and checked). An
    empty tuple means it is never switched on by an attribute and must be chosen by name or be
    the default of its kind. ``disabled_by`` names attributes that, when truthy, hand the
    config to another record (``speculation_length`` selects draft-model speculation unless
    ``enable_fused_speculation`` asks for the fused kind).

    The pipeline callbacks run only while this record is enabled, each given the application's
    :class:`nxdplug.pipeline.PipelineContext`: ``validate(context) -> Iterable[str]`` reports
    problems, ``transform_model(model, context)`` changes a freshly built model before its
    weights load, ``add_submodels(context) -> Iterable[ModelWrapper]`` adds phases.
    """

    enabled_by: tuple[str, ...] = _names_field()
    enabled_when_set: bool = False
    disabled_by: tuple[str, ...] = _names_field()
    validate: str | None = ref_field(default=None)
    transform_model: str | None = ref_field(default=None)
    add_submodels: str | None = ref_field(default=None)

    def is_enabled_by(self, neuron_config: object) -> bool:
        if any(getattr(neuron_config, attr, None) for attr in self.disabled_by):
            return False
        values = [getattr(neuron_config, attr, None) for attr in self.enabled_by]
        if self.enabled_when_set:
            return any(value is not None for value in values)
        return any(bool(value) for value in values)


@attrs.frozen(kw_only=True)
class ModelArchitecture(PluginRecord):
    """A model family.

    ``hf_architectures`` are the ``architectures`` entries of an HF ``config.json`` this plugin
    serves; ``application`` and ``config_class`` point at the NeuronBaseForCausalLM subclass and
    its InferenceConfig subclass; ``hf_config_class`` / ``hf_model_class`` at the transformers
    classes used to build tiny checkpoints and as the accuracy oracle; ``tiny_config`` the
    config values a tiny random checkpoint of the family needs on top of the common tiny
    defaults (sizes under other names, nested sub-configs).
    """

    model_type: str = attrs.field(validator=_check_name)
    hf_architectures: tuple[str, ...] = _names_field()
    application: str = ref_field()
    config_class: str = ref_field()
    hf_config_class: str | None = ref_field(default=None)
    hf_model_class: str | None = ref_field(default=None)
    capabilities: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)
    tiny_config: Mapping[str, Any] = attrs.field(factory=dict, converter=dict, hash=False)


@attrs.frozen(kw_only=True)
class ConfigLoader(PluginRecord):
    """Reads model attributes from a checkpoint folder.

    ``loader(model_path) -> dict`` is tried when one of ``filenames`` exists in the folder; the
    dict's ``"attribute_map"`` entry, if any, lists attribute aliases.
    """

    filenames: tuple[str, ...] = _names_field()
    loader: str = ref_field()


@attrs.frozen(kw_only=True)
class StateDictConverter(SelectableRecord):
    """One step of the HF-to-nxdplug state-dict conversion chain.

    ``converter(state_dict, config) -> state_dict``. It runs for the model types listed (all when
    empty) and, when ``enabled_by`` is set, only when the config switches it on. Steps run in
    ascending ``order``: model renames use 0-99, layout changes (fused QKV, GQA) 100-199,
    quantization 200-299.
    """

    converter: str = ref_field()
    model_types: tuple[str, ...] = _names_field()
    order: int = 100

    def applies_to(self, model_type: str, neuron_config: object) -> bool:
        if self.model_types and model_type not in self.model_types:
            return False
        return not self.enabled_by or self.is_enabled_by(neuron_config)


@attrs.frozen(kw_only=True)
class QuantizationMethod(PluginRecord):
    """Weight quantization to ``dtype`` (``int8``, ``f8e4m3``, ...) at a ``granularity``
    (``per_tensor``, ``per_channel``, or ``blockwise``: groups of input features).

    ``implementation`` is a class built with no arguments whose
    ``quantize_state_dict(state_dict, config) -> state_dict`` returns the quantized checkpoint.
    The record's name is ``<dtype>-<granularity>``, which is how NeuronConfig's
    ``quantization_dtype`` and ``quantization_type`` select it.
    """

    dtype: str
    granularity: str = attrs.field(
        validator=attrs.validators.in_(("per_tensor", "per_channel", "blockwise"))
    )
    implementation: str = ref_field()

    @staticmethod
    def name_for(neuron_config: NeuronConfig) -> str:
        """The name of the method a NeuronConfig's ``quantization_dtype`` and
        ``quantization_type`` select (``int8``, ``per_channel_symmetric``: ``int8-per_channel``).
        """
        granularity = neuron_config.quantization_type.removesuffix("_symmetric")
        return f"{neuron_config.quantization_dtype}-{granularity}"


@attrs.frozen(kw_only=True)
class QuantizedCheckpointFormat(PluginRecord):
    """A quantized checkpoint layout other tools write (GPTQ, AWQ, compressed-tensors, ...),
    found by ``config.json``'s ``quantization_config.quant_method``, as transformers finds its
    quantizer.

    ``reader`` is a class built with ``(quantization_config, tensor_names)``: the config's dict
    and the names of the checkpoint's tensors (empty when unknown). Its ``settings() -> dict``
    are the NeuronConfig settings the checkpoint means (``quantized``, ``quantization_dtype``,
    ``modules_to_not_convert``, ...; none to load it in full precision), and
    ``convert(state_dict, config) -> state_dict`` turns the stored tensors into those settings'
    layout, dequantizing (and logging) what cannot run as stored.
    """

    quant_methods: tuple[str, ...] = _names_field()
    reader: str = ref_field(follows="nxdplug.config.checkpoint_format:CheckpointFormatReader")


@attrs.frozen(kw_only=True)
class Sampler(PluginRecord):
    """Turns next-token logits into tokens; ``implementation`` is a class taking no arguments."""

    implementation: str = ref_field(follows="nxdplug.runtime.sampling:TokenSampler")


@attrs.frozen(kw_only=True)
class KVCacheStrategy(SelectableRecord):
    """A KV-cache layout; ``implementation`` is a KVCacheManager subclass. ``cache_space`` is
    the :class:`nxdplug.engine.cache_space.CacheSpace` subclass (built with the NeuronConfig)
    through which the serving engine reserves room in it; by default a whole line (batch row)
    per request."""

    implementation: str = ref_field(follows="nxdplug.modules.kv_cache:KVCacheManager")
    cache_space: str = ref_field(
        default="nxdplug.engine.cache_space:CacheLines",
        follows="nxdplug.engine.cache_space:CacheSpace",
    )


@attrs.frozen(kw_only=True)
class SpeculationMode(SelectableRecord):
    """A speculative-decoding mode (draft model, Medusa, EAGLE).

    ``implementation`` is a class built with the application whose ``generate(request)``
    follows :class:`nxdplug.runtime.speculation.Speculator`. In the serving engine, the mode
    serves the ``method`` values of vLLM's ``speculative_config`` named in ``engine_methods``,
    each step's proposals coming from ``engine_proposer`` (a class built with
    ``(application, speculative_config, draft, every_rank)``, ``every_rank`` what runs calls
    on every rank, that follows :class:`nxdplug.engine.speculative.Proposer`; the engine
    verifies them), or, for a mode whose own phases draft and verify, from ``engine_fused``
    (built the same way, following :class:`nxdplug.engine.speculative.FusedSpeculator`). The
    engine refuses a mode with neither. ``engine_settings(speculative_config) -> dict`` gives
    the NeuronConfig settings that build a model for those methods besides
    ``speculation_length`` (``nxdplug serve --speculative-config`` applies them).
    """

    implementation: str = ref_field(follows="nxdplug.runtime.speculation:Speculator")
    engine_methods: tuple[str, ...] = _names_field()
    engine_proposer: str | None = ref_field(
        default=None, follows="nxdplug.engine.speculative:Proposer"
    )
    engine_fused: str | None = ref_field(
        default=None, follows="nxdplug.engine.speculative:FusedSpeculator"
    )
    engine_settings: str | None = ref_field(default=None)


@attrs.frozen(kw_only=True)
class StepInput(SelectableRecord):
    """Per-row inputs a feature adds to the graphs of the core's phases.

    ``builder`` is a class built with the InferenceConfig that follows
    :class:`nxdplug.pipeline.StepInputBuilder`: each step it makes the tensors named in
    ``inputs`` ([batch, ...], one row per sequence; the core pads rows and buckets) from the
    ``forward()`` / ``generate()`` keywords named in ``keywords``. The graphs find them in
    ``StepInputs.extra`` by name. ``phases`` lists the sub-model tags that take them (empty:
    every sub-model that takes the core's step, ``ModelWrapper.takes_step_inputs``).
    """

    builder: str = ref_field(follows="nxdplug.pipeline:StepInputBuilder")
    inputs: tuple[str, ...] = _names_field()
    keywords: tuple[str, ...] = _names_field()
    phases: tuple[str, ...] = _names_field()


@attrs.frozen(kw_only=True)
class ParallelGroup(SelectableRecord):
    """A named process group a feature lays its weights or work out over (``ep`` for experts,
    a phase's own ``tp``); the record's ``name`` is the group's.

    ``partition(world_size, config) -> Iterable[Iterable[int]]`` splits the launched ranks into
    equal blocks, each block one group (``[[0, 1], [2, 3]]``: two groups of two). Layers name
    the group they are sharded over; see :mod:`nxdplug.modules.process_groups`.
    """

    partition: str = ref_field()


@attrs.frozen(kw_only=True)
class CliExtension(SelectableRecord):
    """What a feature adds to the ``nxdplug`` commands named in ``commands``.

    ``implementation`` is a class built with no arguments that follows
    :class:`nxdplug.cli.extensions.CommandLineExtension`: its ``add_arguments`` runs for every
    installed record (before a config exists); the rest only while the config enables the
    record (``enabled_by``), e.g. to put a draft checkpoint into the config, or to pass a draft
    application to ``generate()``. ``default_settings``, if given, is a function of the parsed
    arguments giving the NeuronConfig settings the feature turns on by default where its
    options leave them unsaid (vLLM's prefix caching in ``serve``); the command drops them,
    saying why, when they would make the config invalid.
    """

    implementation: str = ref_field(follows="nxdplug.cli.extensions:CommandLineExtension")
    commands: tuple[str, ...] = attrs.field(default=("run", "benchmark"), converter=_str_tuple)
    default_settings: str | None = ref_field(default=None)


@attrs.frozen(kw_only=True)
class StructuredOutputBackend(PluginRecord):
    """Constrains a request's tokens to a JSON schema, a regular expression, a list of choices
    or a grammar (OpenAI's ``response_format``, vLLM's ``structured_outputs``), for the engine.

    ``implementation`` is a class built with ``(tokenizer, vocab_size)`` that follows
    :class:`nxdplug.engine.structured_output.ConstraintCompiler`; ``kinds`` are the
    constraints it compiles, of ``json``, ``regex``, ``choice`` and ``grammar``; ``priority``
    orders the choice when several are installed (the highest wins).
    """

    implementation: str = ref_field(follows="nxdplug.engine.structured_output:ConstraintCompiler")
    kinds: tuple[str, ...] = _names_field()
    priority: int = 0


@attrs.frozen(kw_only=True)
class PhaseOutput(PluginRecord):
    """A per-request output that a feature's own context-encoding phase computes as it encodes
    a prompt, beside the core's logits.

    ``name`` is at once the request setting that asks for it (``SamplingSettings(name=...)``;
    None: not asked), the ``forward()`` keyword that routes a prompt to the phase (the phase's
    ``ModelWrapper.selected_by``) and the ``RequestOutput`` attribute that carries it on a
    request's first output. ``outputs`` name the tensors the phase adds to what ``forward()``
    returns (``CausalLMOutputWithTokens.with_outputs``). ``implementation`` is a class built
    with no arguments that follows :class:`nxdplug.engine.phase_outputs.RowOutput`: it checks
    a request's value and turns the request's row of those tensors into its output.
    ``missing`` tells a caller asking a model without the phase how to get one.
    """

    implementation: str = ref_field()
    outputs: tuple[str, ...] = _names_field()
    missing: str = ""


@attrs.frozen(kw_only=True)
class Feature(SelectableRecord):
    """A feature a config switches on, with what it needs and what it cannot be combined with.

    ``settings`` are the extra NeuronConfig attributes the feature owns, with their defaults, so
    that a config naming them is not reported as having unknown attributes.
    ``runtime_settings`` name (dotted, within NeuronConfig) the settings whose values reach the
    graphs as step inputs rather than shaping them: a compiled folder is reused whatever they
    are (``on_device_sampling_config.top_k``).

    A feature whose model chooses its tokens in its graph says where the host takes them from,
    through two more callbacks: ``token_source(context, generation_config, batch_size,
    step_keywords, generate_kwargs)`` gives the :class:`nxdplug.generation.hf_adapter.TokenSource`
    of a ``generate()`` call (``step_keywords``: the step-input keywords the caller gave;
    ``generate_kwargs``: its GenerationConfig keywords, as given); ``request_sampling(context)``
    the :class:`nxdplug.engine.token_choice.GraphSampling` through which the serving engine
    hands each request's sampling settings to the graph. None from either, or no enabled feature
    giving it: the host samples. A config enabling two features that give the same one is
    refused.
    """

    requires: tuple[str, ...] = _names_field()
    conflicts_with: tuple[str, ...] = _names_field()
    settings: Mapping[str, Any] = attrs.field(factory=dict, converter=dict, hash=False)
    runtime_settings: tuple[str, ...] = _names_field()
    token_source: str | None = ref_field(default=None)
    request_sampling: str | None = ref_field(default=None)


@attrs.frozen(kw_only=True)
class CompileBackend(PluginRecord):
    """Runs or compiles the sub-models.

    ``implementation`` is a class following :class:`nxdplug.compile.backend.Backend`;
    ``priority`` orders the automatic choice (the highest available wins); ``device`` is where
    the backend runs the model (``cpu``, ``cuda``, ...: weights, caches and every step input
    are made there); ``tp_degrees`` lists the tensor-parallel degrees the target supports
    (``None``: any); ``capabilities`` are free-form words features may ask for (the neuron
    backend's ``"nki-kernels"``); ``owned_settings`` name the NeuronConfig attributes only this
    backend reads (compiler hints, kernel switches): with another backend selected, those set
    to other than their defaults are reported once as having no effect.
    """

    implementation: str = ref_field(follows="nxdplug.compile.backend:Backend")
    priority: int = 0
    device: str = "cpu"
    tp_degrees: tuple[int, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(tuple)
    )
    capabilities: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)
    owned_settings: tuple[str, ...] = _names_field()


@attrs.frozen(kw_only=True)
class Subcommand(PluginRecord):
    """A command of ``nxdplug`` (``nxdplug NAME ...``); ``description`` is its help line.

    ``add_arguments`` is a function ``(argparse.ArgumentParser) -> None`` run when the command
    line is parsed (its module should import nothing heavy: every command's arguments are built
    for ``--help``); ``run`` is a function ``(argparse.Namespace) -> int`` giving the exit code.
    A :class:`~nxdplug.errors.NxdPlugError` it raises is printed as one error line.
    """

    add_arguments: str = ref_field()
    run: str = ref_field()


@attrs.frozen
class RecordKind:
    """A kind of registered record: the registration hook that provides it, its record class
    and how messages name it. The core's kinds are in :data:`nxdplug.hookspecs.RECORD_KINDS`; a
    plugin that adds hooks adds its kinds with them (``nxdplug_add_hookspecs``)."""

    name: str
    hook: str
    record_type: type[PluginRecord]
    label: str
