"""Everything a plugin may import from nxdplug, in one module (as ``pytest`` over ``_pytest``).

Plugins, built-in and third-party, import nxdplug's objects from here and from nowhere else in
the core (``tests/core/test_core_boundary.py`` holds the built-in ones to it), so that the core's
modules can move without breaking them. The ``TYPE_CHECKING`` imports below are the list, for
type checkers and for this module alike: each name is imported from its module on first use, so
a plugin's hooks module that takes its records from here imports no torch.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import TYPE_CHECKING

from nxdplug.lazy import lazy_attribute_getter

if TYPE_CHECKING:
    from nxdplug.checkpoint.atomic_folders import staged_folder
    from nxdplug.checkpoint.generation_config import model_generation_config
    from nxdplug.checkpoint.huge_pages import huge_page_buffer
    from nxdplug.checkpoint.state_dict import load_state_dict, load_tensor_file
    from nxdplug.cli.extensions import (
        OptionsOnly,
        add_extension_arguments,
        default_settings,
        enabling_settings,
        extension_config_kwargs,
        generate_keywords,
        hf_comparison,
        prepare_config,
    )
    from nxdplug.cli.inference import (
        add_compiled_model_options,
        add_model_path,
        application_beside,
        inference_config,
        load_model,
        load_tokenizer,
        selection_summary,
    )
    from nxdplug.cli.main import build_parser, exit_with, main
    from nxdplug.cli.options import (
        GENERIC_NEURON_CONFIG_DEST,
        SHARED_OPTIONS,
        TORCH_DTYPES,
        add_neuron_config_options,
        add_shared_option,
        neuron_config_kwargs,
        parse_key_value,
        positive_int,
    )
    from nxdplug.cli.speculation import (
        add_speculation_options,
        add_speculative_config_option,
        application_without_speculation,
        engine_draft,
        plain_application,
        refuse_unused_draft,
        speculation_settings,
        without_speculation,
    )
    from nxdplug.compile.artefacts import ArtefactError
    from nxdplug.config import (
        FusedSpecNeuronConfig,
        InferenceConfig,
        LoraServingConfig,
        MoENeuronConfig,
        NeuronConfig,
        OnDeviceSamplingConfig,
        load_pretrained_config,
    )
    from nxdplug.config.checkpoint_settings import agree_with_checkpoint
    from nxdplug.config.hf import pretrained_config_attributes, with_rope_aliases
    from nxdplug.config.serialization import read_json_object
    from nxdplug.config.suggestions import did_you_mean
    from nxdplug.config.token_tree import (
        TokenTree,
        TokenTreeError,
        sorted_paths,
        tree_attention,
        tree_config_of_paths,
    )
    from nxdplug.config.validation import core_config_problems
    from nxdplug.engine import (
        Engine,
        EngineFullError,
        RequestError,
        RequestOutput,
        SamplingSettings,
    )
    from nxdplug.engine.cache_space import CacheSpace, CacheUsage
    from nxdplug.engine.ranks import StepBroadcaster, follow_steps
    from nxdplug.engine.requests import MAX_TOP_LOGPROBS, Request
    from nxdplug.engine.runner import EveryRank
    from nxdplug.engine.speculative import (
        DraftTree,
        Proposer,
        SpeculationMetrics,
        SpeculativeConfig,
        chain_length,
        draft_ranks,
        tree_nodes,
    )
    from nxdplug.errors import (
        CheckpointError,
        ConfigError,
        NotSupportedError,
        NxdPlugError,
        PluginError,
    )
    from nxdplug.generation.accuracy import check_accuracy, shift_right
    from nxdplug.generation.hf_adapter import HF_DEFAULTS, HuggingFaceGenerationAdapter
    from nxdplug.generation.hf_matching import (
        LOGIT_TOLERANCES,
        AccuracyReport,
        compare_with_hf,
        hf_greedy,
        left_padded,
        teacher_forced_logits,
    )
    from nxdplug.generation.logit_accuracy import check_accuracy_logits
    from nxdplug.generation.logit_validation import LogitMatchingValidationError
    from nxdplug.hookspecs import hookimpl, hookspec
    from nxdplug.lazy import resolve_ref
    from nxdplug.manager import (
        NxdPlugPluginManager,
        create_plugin_manager,
        get_plugin_manager,
        use_plugin_manager,
    )
    from nxdplug.modules.activations import activation
    from nxdplug.modules.attention import (
        NeuronAttentionBase,
        attention_head_counts,
        attention_mask_4d,
        head_dim_of,
        head_layout,
    )
    from nxdplug.modules.gqa import HeadLayout
    from nxdplug.modules.kv_cache import (
        CacheLayout,
        CacheSlot,
        KVCacheManager,
        read_prefix,
        write_positions,
    )
    from nxdplug.modules.meta_init import parameters_on_meta
    from nxdplug.modules.mlp import GatedMLP
    from nxdplug.modules.moe import ExpertMLPs, initialize_moe_module, without_router_outputs
    from nxdplug.modules.moe.checkpoint import stack_gated_experts
    from nxdplug.modules.moe.checkpoint_settings import moe_neuron_config_problems
    from nxdplug.modules.moe.parallel import rank_layout
    from nxdplug.modules.norms import RMSNorm
    from nxdplug.modules.parallel_linear import (
        ColumnParallelLinear,
        OutputDelta,
        ParallelEmbedding,
        RowParallelLinear,
        ShardedLinear,
        WeightMethod,
        all_gather,
        set_weight_method,
        shard_tensor,
        tp_rank,
        tp_world_size,
    )
    from nxdplug.modules.process_groups import group_rank, group_size
    from nxdplug.modules.rotary import SUPPORTED_ROPE_TYPES, RotaryEmbedding, rope_parameters
    from nxdplug.modules.sequence_parallel import gather_sequence, scatter_sequence
    from nxdplug.modules.step import StepInputs, current_phase, current_step
    from nxdplug.modules.tensor_parallel import end_rank_process
    from nxdplug.pipeline import (
        PipelineContext,
        PluginSelection,
        config_problems,
        requested_backend,
        select_plugins,
    )
    from nxdplug.registry import get_registry
    from nxdplug.runtime.application import NeuronBaseForCausalLM, architecture_for, from_pretrained
    from nxdplug.runtime.batch_sampler import greedy_tokens
    from nxdplug.runtime.cpp_ops import build_operator, build_operator_library, build_operators
    from nxdplug.runtime.model_base import NeuronBaseModel, last_token_states
    from nxdplug.runtime.model_wrapper import (
        FUSED_SPECULATION_MODEL_TAG,
        SPECULATION_MODEL_TAG,
        ExtendWrapper,
        ModelWrapper,
    )
    from nxdplug.runtime.outputs import CausalLMOutputWithTokens
    from nxdplug.runtime.sampling import SamplingParams
    from nxdplug.runtime.sampling_params import prepare_sampling_params
    from nxdplug.runtime.scheduled_step import ScheduledStep, compact_left, positions_from_mask
    from nxdplug.runtime.speculation import (
        AcceptanceStats,
        GeneratedRows,
        SpeculativeRequest,
        TokenChoice,
        accept,
        greedy_acceptance,
        rejection_acceptance,
    )
    from nxdplug.slots import claim_slot
    from nxdplug.types import (
        CliExtension,
        CompileBackend,
        ConfigLoader,
        Feature,
        KVCacheStrategy,
        ModelArchitecture,
        ParallelGroup,
        PhaseOutput,
        PluginRecord,
        QuantizationMethod,
        QuantizedCheckpointFormat,
        RecordKind,
        Sampler,
        SelectableRecord,
        SpeculationMode,
        StateDictConverter,
        StepInput,
        StructuredOutputBackend,
        Subcommand,
        ref_field,
    )


def _exports() -> dict[str, str]:
    """Each public name and its module, as the ``TYPE_CHECKING`` imports above give them."""
    tree = ast.parse(Path(__file__).read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    return {alias.name: node.module for node in block.body for alias in node.names}


_EXPORTS = _exports()

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_attribute_getter(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return __all__
