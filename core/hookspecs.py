"""The extension points of nxdplug.

Registration hooks (``nxdplug_<plural noun>``) return an iterable of records from
:mod:`nxdplug.types`; every plugin's records are collected and looked up by name through
:mod:`nxdplug.registry`. What acts on one config (checks it, changes the model, adds sub-models)
is a callback a record names, run only while the config enables that record (see
:mod:`nxdplug.pipeline`).

A plugin is a module (or object) with functions decorated by :data:`nxdplug.hookimpl`, registered
under the ``nxdplug`` entry-point group of its distribution.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import pluggy

from nxdplug.types import (
    CliExtension,
    CompileBackend,
    ConfigLoader,
    Feature,
    KVCacheStrategy,
    ModelArchitecture,
    ParallelGroup,
    PhaseOutput,
    QuantizationMethod,
    QuantizedCheckpointFormat,
    RecordKind,
    Sampler,
    SpeculationMode,
    StateDictConverter,
    StepInput,
    StructuredOutputBackend,
    Subcommand,
)

if TYPE_CHECKING:
    from nxdplug.manager import NxdPlugPluginManager

PROJECT_NAME = "nxdplug"

# The plugin API version. A plugin module may declare the version it was written for as
# ``NXDPLUG_API_VERSION = 2``; one written for another version is refused, not loaded.
# Version 2: plugins import from ``nxdplug.plugin_api``; the plugin-wide pipeline hooks and the
# sampling-only ones became record callbacks; serving's hooks moved to the serve plugin.
API_VERSION = 2
API_VERSION_ATTRIBUTE = "NXDPLUG_API_VERSION"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class ModelSpecs:
    """Model families and how their checkpoints are read."""

    @hookspec
    def nxdplug_model_architectures(self) -> Iterable[ModelArchitecture]:
        """Register model families.

        .. code-block:: python

            @nxdplug.hookimpl
            def nxdplug_model_architectures():
                yield ModelArchitecture(
                    name="llama",
                    model_type="llama",
                    hf_architectures=("LlamaForCausalLM",),
                    application="my_pkg.modeling:NeuronLlamaForCausalLM",
                    config_class="my_pkg.modeling:LlamaInferenceConfig",
                )
        """

    @hookspec
    def nxdplug_config_loaders(self) -> Iterable[ConfigLoader]:
        """Register readers of model configuration files.

        .. code-block:: python

            @nxdplug.hookimpl
            def nxdplug_config_loaders():
                yield ConfigLoader(
                    name="yaml", filenames=("config.yaml",), loader="my_pkg.io:read_yaml"
                )
        """

    @hookspec
    def nxdplug_state_dict_converters(self) -> Iterable[StateDictConverter]:
        """Register steps of the HF-to-nxdplug state-dict conversion chain.

        .. code-block:: python

            @nxdplug.hookimpl
            def nxdplug_state_dict_converters():
                yield StateDictConverter(
                    name="my-model-renames",
                    converter="my_pkg.convert:rename_keys",
                    model_types=("my_model",),
                    order=10,
                )
        """


class NumericsSpecs:
    """How numbers are stored and turned into tokens."""

    @hookspec
    def nxdplug_quantization_methods(self) -> Iterable[QuantizationMethod]:
        """Register weight quantization methods.

        .. code-block:: python

            @nxdplug.hookimpl
            def nxdplug_quantization_methods():
                yield QuantizationMethod(
                    name="nf4-per_channel",
                    dtype="nf4",
                    granularity="per_channel",
                    implementation="my_pkg.quant:Nf4PerChannel",
                )
        """

    @hookspec
    def nxdplug_quantized_checkpoint_formats(self) -> Iterable[QuantizedCheckpointFormat]:
        """Register readers of quantized checkpoints other tools write, by ``quant_method``.

        .. code-block:: python

            @nxdplug.hookimpl
            def nxdplug_quantized_checkpoint_formats():
                yield QuantizedCheckpointFormat(
                    name="hqq",
                    quant_methods=("hqq",),
                    reader="my_pkg.hqq:HqqReader",
                )
        """

    @hookspec
    def nxdplug_samplers(self) -> Iterable[Sampler]:
        """Register samplers that turn logits into tokens.

        .. code-block:: python

            @nxdplug.hookimpl
            def nxdplug_samplers():
                yield Sampler(name="min-p", implementation="my_pkg.sampling:MinPSampler")
        """

    @hookspec
    def nxdplug_kv_cache_strategies(self) -> Iterable[KVCacheStrategy]:
        """Register KV-cache layouts, each with the cache space through which the serving
        engine reserves room in it for a request (by default a whole line, a batch row). The
        implementation is a ``KVCacheManager``: ``update_and_read`` stores a step's keys and
        values and hands back the rows' cached ones; ``store_and_attend`` may compute the
        attention over the layout itself (the static layout's decode kernel does), or return
        None to leave it to the model; ``graph_variant`` names what else decides the traced
        graphs (part of a compiled folder's hash).

        .. code-block:: python

            @nxdplug.hookimpl
            def nxdplug_kv_cache_strategies():
                yield KVCacheStrategy(
                    name="paged",
                    implementation="my_pkg.cache:PagedKVCache",
                    cache_space="my_pkg.cache:BlockTables",
                    enabled_by=("is_block_kv_layout",),
                )
        """


class ExecutionSpecs:
    """What runs: speculation, optional features, compile backends."""

    @hookspec
    def nxdplug_speculation_modes(self) -> Iterable[SpeculationMode]:
        """Register speculative-decoding modes.

        .. code-block:: python

            @nxdplug.hookimpl
            def nxdplug_speculation_modes():
                yield SpeculationMode(
                    name="medusa", implementation="my_pkg.medusa:Medusa", enabled_by=("is_medusa",)
                )
        """

    @hookspec
    def nxdplug_features(self) -> Iterable[Feature]:
        """Register features a config can switch on, with their own settings.

        .. code-block:: python

            @nxdplug.hookimpl
            def nxdplug_features():
                yield Feature(
                    name="logit-softcap",
                    enabled_by=("logit_softcap",),
                    settings={"logit_softcap": None},
                )
        """

    @hookspec
    def nxdplug_compile_backends(self) -> Iterable[CompileBackend]:
        """Register compile backends.

        .. code-block:: python

            @nxdplug.hookimpl
            def nxdplug_compile_backends():
                yield CompileBackend(
                    name="tvm", implementation="my_pkg.backend:TVMBackend", priority=5
                )
        """

    @hookspec
    def nxdplug_step_inputs(self) -> Iterable[StepInput]:
        """Register per-row inputs that a feature adds to the graphs of a step.

        .. code-block:: python

            @nxdplug.hookimpl
            def nxdplug_step_inputs():
                yield StepInput(
                    name="banned-tokens",
                    builder="my_pkg.ban:BannedTokenInput",
                    inputs=("banned_token_ids",),
                    keywords=("banned_token_ids",),
                    enabled_by=("ban_tokens",),
                )
        """


class ParallelSpecs:
    """How the work and the weights are laid out over the launched ranks."""

    @hookspec
    def nxdplug_parallel_groups(self) -> Iterable[ParallelGroup]:
        """Register named process groups a feature shards over, as partitions of the ranks.

        .. code-block:: python

            @nxdplug.hookimpl
            def nxdplug_parallel_groups():
                yield ParallelGroup(
                    name="ep",
                    partition="my_pkg.experts:expert_parallel_ranks",
                    enabled_by=("moe_ep_degree",),
                )
        """


class CommandLineSpecs:
    """What plugins add to the ``nxdplug`` command."""

    @hookspec
    def nxdplug_commands(self) -> Iterable[Subcommand]:
        """Register a command of its own (``nxdplug serve``, ``nxdplug benchmark`` are such).

        .. code-block:: python

            @nxdplug.hookimpl
            def nxdplug_commands():
                yield Subcommand(
                    name="my-report",
                    description="print what my plugin measured",
                    add_arguments="my_pkg.cli:add_report_arguments",
                    run="my_pkg.cli:run_report",
                )
        """

    @hookspec
    def nxdplug_cli_extensions(self) -> Iterable[CliExtension]:
        """Register command-line behaviour of a feature (options, config preparation, the
        keywords it gives ``generate()``).

        .. code-block:: python

            @nxdplug.hookimpl
            def nxdplug_cli_extensions():
                yield CliExtension(
                    name="my-draft",
                    implementation="my_pkg.cli:MyDraftCommandLine",
                    enabled_by=("my_speculation",),
                )
        """


class DecodingSpecs:
    """What plugins add to the serving engine's requests: how their tokens are chosen, and
    outputs of their own."""

    @hookspec
    def nxdplug_structured_output_backends(self) -> Iterable[StructuredOutputBackend]:
        """Register a library that constrains tokens to a JSON schema, regex, choice or grammar.

        .. code-block:: python

            @nxdplug.hookimpl
            def nxdplug_structured_output_backends():
                yield StructuredOutputBackend(
                    name="my-grammars",
                    implementation="my_pkg.grammars:MyCompiler",
                    kinds=("json", "regex"),
                )
        """

    @hookspec
    def nxdplug_phase_outputs(self) -> Iterable[PhaseOutput]:
        """Register a per-request output that a feature's context-encoding phase computes
        (the phase itself comes from the feature's ``add_submodels``, ``selected_by`` the
        record's name).

        .. code-block:: python

            @nxdplug.hookimpl
            def nxdplug_phase_outputs():
                yield PhaseOutput(
                    name="prompt_entropy",
                    implementation="my_pkg.entropy:PromptEntropy",
                    outputs=("prompt_entropy",),
                    missing="load the model with NeuronConfig(score_entropy=True)",
                )
        """


class ExtensionSpecs:
    """Hooks that plugins add for their own plugins (pytest's ``pytest_addhooks``)."""

    @hookspec(historic=True)
    def nxdplug_add_hookspecs(self, pluginmanager: NxdPlugPluginManager) -> None:
        """Add a plugin's own hook specifications, and the record kinds its registration hooks
        return, through ``pluginmanager.add_plugin_hookspecs``. Called once as the plugin
        registers; a plugin implementing another plugin's hook marks it
        ``@hookimpl(optionalhook=True)``, so that it still loads without that plugin.

        .. code-block:: python

            @nxdplug.hookimpl
            def nxdplug_add_hookspecs(pluginmanager):
                pluginmanager.add_plugin_hookspecs(
                    MyServerSpecs,
                    RecordKind("my_routes", "nxdplug_my_routes", MyRoute, "my route"),
                )
        """


SPEC_CLASSES = (
    ModelSpecs,
    NumericsSpecs,
    ExecutionSpecs,
    ParallelSpecs,
    CommandLineSpecs,
    DecodingSpecs,
    ExtensionSpecs,
)

# The record each of the core's registration hooks returns (see :mod:`nxdplug.registry`).
RECORD_KINDS = (
    RecordKind("model_architectures", "nxdplug_model_architectures", ModelArchitecture, "model"),
    RecordKind("config_loaders", "nxdplug_config_loaders", ConfigLoader, "config loader"),
    RecordKind(
        "state_dict_converters",
        "nxdplug_state_dict_converters",
        StateDictConverter,
        "state-dict converter",
    ),
    RecordKind(
        "quantization_methods",
        "nxdplug_quantization_methods",
        QuantizationMethod,
        "quantization method",
    ),
    RecordKind(
        "quantized_checkpoint_formats",
        "nxdplug_quantized_checkpoint_formats",
        QuantizedCheckpointFormat,
        "quantized checkpoint format",
    ),
    RecordKind("samplers", "nxdplug_samplers", Sampler, "sampler"),
    RecordKind(
        "kv_cache_strategies", "nxdplug_kv_cache_strategies", KVCacheStrategy, "KV-cache strategy"
    ),
    RecordKind(
        "speculation_modes", "nxdplug_speculation_modes", SpeculationMode, "speculation mode"
    ),
    RecordKind("step_inputs", "nxdplug_step_inputs", StepInput, "step input"),
    RecordKind("parallel_groups", "nxdplug_parallel_groups", ParallelGroup, "process group"),
    RecordKind("features", "nxdplug_features", Feature, "feature"),
    RecordKind("compile_backends", "nxdplug_compile_backends", CompileBackend, "compile backend"),
    RecordKind("cli_extensions", "nxdplug_cli_extensions", CliExtension, "command-line extension"),
    RecordKind("commands", "nxdplug_commands", Subcommand, "command"),
    RecordKind(
        "structured_output_backends",
        "nxdplug_structured_output_backends",
        StructuredOutputBackend,
        "structured-output backend",
    ),
    RecordKind("phase_outputs", "nxdplug_phase_outputs", PhaseOutput, "phase output"),
)
