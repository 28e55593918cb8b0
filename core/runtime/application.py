"""Application models: NeuronApplicationBase and NeuronBaseForCausalLM.

An application owns the config, the checkpoint path and its sub-models (``models``, a list of
ModelWrapper). ``to_cpu()`` builds the model eagerly; ``run`` (the runner) takes a
:class:`~nxdplug.runtime.scheduled_step.ScheduledStep` and calls the phase that computes it,
doing the host-side work (positions, cache masks) so the sub-models see fixed shapes only;
``forward`` builds that step from HF's padded tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from nxdplug.checkpoint.state_dict import (
    PICKLE_SUFFIXES,
    load_into_module,
    load_state_dict,
    load_tensor_file,
    replace_prefix,
    save_state_dict,
)
from nxdplug.compile.compiled_model import (
    compile_application,
    load_application,
    load_weights,
    shard_weights,
)
from nxdplug.config import CONFIG_FILE, InferenceConfig, NeuronConfig, load_pretrained_config
from nxdplug.config.checkpoint_format import checkpoint_format_reader
from nxdplug.errors import CheckpointError, ConfigError, NotSupportedError, NxdPlugError
from nxdplug.modules.meta_init import parameters_on_meta
from nxdplug.modules.step import StepInputs
from nxdplug.modules.tensor_parallel import join_launched_ranks, this_ranks_shard
from nxdplug.pipeline import (
    DEFAULT_BACKEND,
    PipelineContext,
    PluginSelection,
    current_context,
    validate,
)
from nxdplug.registry import get_registry
from nxdplug.runtime.loading_thread import LoadingThread
from nxdplug.runtime.model_wrapper import (
    CONTEXT_ENCODING_MODEL_TAG,
    TOKEN_GENERATION_MODEL_TAG,
    ExtendWrapper,
    ModelWrapper,
)
from nxdplug.runtime.outputs import CausalLMOutputWithTokens, join_outputs
from nxdplug.runtime.scheduled_step import ScheduledStep, positions_from_mask
from nxdplug.runtime.speculation import AcceptanceStats
from nxdplug.types import ModelArchitecture, QuantizationMethod

_SAVE_IT_FIRST = (
    "write it first with save_quantized_state_dict(model_path, config), before to_cpu(), "
    "compile() or load() read the weights"
)


class NeuronApplicationBase(nn.Module):
    _STATE_DICT_MODEL_PREFIX = "model."
    _NEW_STATE_DICT_MODEL_PREFIX = ""
    _model_cls: type[nn.Module] | None = None

    def __init__(
        self,
        model_path: str | Path,
        config: InferenceConfig | None = None,
        neuron_config: NeuronConfig | None = None,
    ) -> None:
        super().__init__()
        if config is None:
            config = self.config_for_path(model_path, neuron_config)
        elif neuron_config is not None:
            config.neuron_config = neuron_config
        self.context = PipelineContext(config, self.validate_config(config), self._model_cls)
        join_launched_ranks(config.neuron_config.tp_degree)
        self.context.lay_out_process_groups()
        self.config = config
        self.neuron_config = config.neuron_config
        self.model_path = str(model_path)
        self.models: list[ModelWrapper] = []
        self.is_compiled = False
        self.is_loaded_to_neuron = False
        self.backend_name: str | None = None  # what runs the sub-models once loaded
        self.loading_thread: LoadingThread | None = None  # set by load() and to_cpu()
        self.compiler_args: str | None = None

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return InferenceConfig

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        """The NeuronConfig class of this model's config class (NxD Inference's accessor)."""
        return cls.get_config_cls().get_neuron_config_cls()

    @classmethod
    def config_for_path(
        cls, model_path: str | Path, neuron_config: NeuronConfig | None = None
    ) -> InferenceConfig:
        """The config of an application built from ``model_path`` alone.

        A folder holding ``neuron_config.json`` (one ``compile()`` wrote, or
        ``InferenceConfig.save``) gives the config it was saved with, read by
        ``get_config_cls().load``, as NxD Inference reads it; ``neuron_config``, when given,
        replaces its NeuronConfig. Any other folder is a checkpoint: its ``config.json`` with
        ``neuron_config`` (or a default NeuronConfig).
        """
        config_cls = cls.get_config_cls()
        if (Path(model_path) / CONFIG_FILE).is_file():
            config = config_cls.load(model_path)
            if neuron_config is not None:
                config.neuron_config = neuron_config
            return config
        return config_cls(
            neuron_config or config_cls.get_neuron_config_cls()(),
            load_config=load_pretrained_config(model_path),
        )

    @property
    def plugins(self) -> PluginSelection:
        """The plugins this application's config selected (computed once)."""
        return self.context.selection

    @property
    def device(self) -> torch.device:
        """Where the model runs, and where every tensor made for it is made."""
        return self.context.device

    @classmethod
    def validate_config(cls, config: InferenceConfig) -> PluginSelection:
        """Check the config as a whole (core rules and every enabled plugin's checks)."""
        if getattr(config, "neuron_config", None) is None:
            raise ConfigError(["the InferenceConfig has no neuron_config; pass a NeuronConfig"])
        return validate(config)

    def get_compiler_args(self) -> str | None:
        """Arguments for the compile backend (for inductor: ``KEY=VALUE`` inductor options,
        e.g. ``"freezing=true max_autotune=true"``); ``compiler_args`` unless overridden."""
        return self.compiler_args

    def compile(
        self, compiled_model_path: str | Path, debug: bool = False, *, quiet: bool = False
    ) -> None:
        """Compile every sub-model and bucket into ``compiled_model_path`` (see
        :mod:`nxdplug.compile.compiled_model`); a folder already holding these graphs is reused."""
        self._refuse_on_cpu("compile()")
        compile_application(self, Path(compiled_model_path), debug=debug, quiet=quiet)

    def load(self, compiled_model_path: str | Path, *, quiet: bool = False) -> None:
        """Load a compiled folder made for this config, and its weights."""
        self._refuse_on_cpu("load()")
        load_application(self, Path(compiled_model_path), quiet=quiet)
        self.loading_thread = LoadingThread()

    def _refuse_on_cpu(self, action: str) -> None:
        if self.neuron_config.on_cpu:
            raise NotSupportedError(
                f"{action} with on_cpu=True: on_cpu is NxD Inference's CPU mode, where the model "
                "runs eagerly on the CPU through to_cpu() and no graphs are compiled or loaded. "
                "Call to_cpu() instead, or set on_cpu=False to compile (the inductor backend's "
                "graphs run on the CPU too)"
            )

    def load_weights(self, compiled_model_path: str | Path) -> None:
        """Swap in the weights of ``compiled_model_path`` without reloading the graphs."""
        load_weights(self, Path(compiled_model_path))

    def shard_weights(self, compiled_model_path: str | Path) -> None:
        """Write this model's weights into the compiled folder ``compiled_model_path``."""
        shard_weights(self, Path(compiled_model_path))

    def build_model(self) -> nn.Module:
        """The model with its weights: built, transformed by the enabled plugins, loaded."""
        if self._model_cls is None:
            raise NxdPlugError(f"{type(self).__name__} does not set _model_cls")
        with parameters_on_meta():
            model = self.context.build_model()
        cast_to = (
            self.neuron_config.torch_dtype if self.neuron_config.cast_type == "config" else None
        )
        with self.context.active():
            checkpoint = self.get_state_dict(self.model_path, self.config)
        state_dict = this_ranks_shard(model, checkpoint)
        load_into_module(model, state_dict, source=self.model_path, dtype=cast_to)
        return model.requires_grad_(False).eval()

    def to_cpu(self) -> None:
        """Run every sub-model eagerly on the CPU, in place of compile() and load()."""
        record = get_registry().get("compile_backends", DEFAULT_BACKEND)
        self.context.run_on(record)
        model = record.load("implementation")().prepare(self.build_model())
        for wrapper in self.models:
            wrapper.model = wrapper.phase_module(model)
            wrapper.fixed_widths = False
        self.backend_name = DEFAULT_BACKEND
        self.context.bind(self)
        self.loading_thread = LoadingThread()
        self.reset()

    @classmethod
    def get_state_dict(cls, model_path: str | Path, config: InferenceConfig) -> dict[str, Any]:
        """The checkpoint converted for this model: the HF checkpoint at ``model_path``, or, with
        ``quantized``, the quantized one at ``quantized_checkpoints_path`` (a folder or a
        ``.pt``/``.bin`` file). Another tool's quantized checkpoint (``quantization_config``)
        is read as stored and converted by its format's reader first."""
        neuron_config = config.neuron_config
        dtype = neuron_config.torch_dtype if neuron_config.cast_type == "config" else None
        reader = checkpoint_format_reader(config)
        if neuron_config.quantized or reader is not None:
            state_dict = cls._read_checkpoint_at(cls.weights_source(model_path, config))
        else:
            state_dict = load_state_dict(model_path, dtype=dtype)
        if reader is not None:
            state_dict = reader.convert(state_dict, config)
        state_dict = replace_prefix(
            state_dict, cls._STATE_DICT_MODEL_PREFIX, cls._NEW_STATE_DICT_MODEL_PREFIX
        )
        return cls.convert_hf_to_neuron_state_dict(state_dict, config)

    @staticmethod
    def weights_source(model_path: str | Path, config: InferenceConfig) -> Path:
        """Where the weights are read from: ``model_path``, or with ``quantized`` the checkpoint
        at ``quantized_checkpoints_path``, an error when that is not there. It is looked for
        only when the weights are read (compile() looks first, before the graphs): the guide
        builds the application first and writes the checkpoint with
        ``save_quantized_state_dict`` after."""
        if not config.neuron_config.quantized:
            return Path(model_path)
        source = Path(config.neuron_config.quantized_checkpoints_path)
        if not source.exists():
            raise CheckpointError(
                f"quantized_checkpoints_path {source} does not exist; {_SAVE_IT_FIRST}"
            )
        return source

    @staticmethod
    def _read_checkpoint_at(source: Path) -> dict[str, Any]:
        """The quantized checkpoint at ``source`` as stored (its float32 scales are not cast to
        torch_dtype; loading casts what the model's modules do not keep)."""
        if not source.is_dir():
            return load_tensor_file(source)
        try:
            return load_state_dict(source)
        except CheckpointError as exc:
            raise CheckpointError(f"quantized_checkpoints_path: {exc} Or {_SAVE_IT_FIRST}") from exc

    @classmethod
    def convert_hf_to_neuron_state_dict(
        cls, state_dict: dict[str, Any], config: InferenceConfig
    ) -> dict[str, Any]:
        """Run the state-dict converter chain the config selects (model renames first)."""
        for converter in current_context(config).selection.converters:
            state_dict = converter.load("converter")(state_dict, config)
        return state_dict

    @classmethod
    def load_hf_model(cls, model_path: str | Path, **kwargs: Any) -> nn.Module:
        """The transformers model for the same checkpoint (the accuracy oracle)."""
        architecture = architecture_for(model_path)
        if architecture.hf_model_class is None:
            raise NotSupportedError(f"no transformers class is registered for {model_path}")
        return architecture.load("hf_model_class").from_pretrained(str(model_path), **kwargs)

    @classmethod
    def generate_quantized_state_dict(
        cls, model_path: str | Path, config: InferenceConfig
    ) -> dict[str, torch.Tensor]:
        """The checkpoint's state dict quantized by the method the config names.

        The method is the ``quantization_methods`` record called
        ``<quantization_dtype>-<per_tensor|per_channel>`` (e.g. ``int8-per_channel``).
        """
        name = QuantizationMethod.name_for(config.neuron_config)
        method = get_registry().get("quantization_methods", name).load("implementation")()
        state_dict = load_state_dict(model_path, dtype=torch.float32)
        return method.quantize_state_dict(state_dict, config)

    @classmethod
    def prepare_quantized_state_dict(cls, hf_model_quant: nn.Module) -> dict[str, torch.Tensor]:
        """The state dict of a model quantized with torch's qint8 tensors, as int8 tensors with
        float32 ``<name>_scale`` tensors beside them (per tensor or per output channel)."""
        prepared = {}
        for name, tensor in hf_model_quant.state_dict().items():
            if not (isinstance(tensor, torch.Tensor) and tensor.is_quantized):
                prepared[name] = tensor
                continue
            prepared[name] = tensor.int_repr()
            if tensor.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
                prepared[f"{name}_scale"] = tensor.q_per_channel_scales().float()
            else:
                prepared[f"{name}_scale"] = torch.tensor([tensor.q_scale()], dtype=torch.float32)
        return prepared

    @classmethod
    def save_quantized_state_dict(cls, model_path: str | Path, config: InferenceConfig) -> None:
        """Quantize the checkpoint and save it to ``quantized_checkpoints_path``."""
        target = config.neuron_config.quantized_checkpoints_path
        if not target:
            raise ConfigError(["save_quantized_state_dict needs quantized_checkpoints_path"])
        target = Path(target)
        if target.suffix not in (*PICKLE_SUFFIXES, ".safetensors"):
            target.mkdir(parents=True, exist_ok=True)
            target = target / "model.safetensors"
        save_state_dict(cls.generate_quantized_state_dict(model_path, config), target)

    def reset(self) -> None:
        """Reset the model state; nothing to do at this level."""


class NeuronBaseForCausalLM(NeuronApplicationBase):
    """Causal LM application: context encoding, then token generation, with a KV cache."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kv_cache_populated = False
        # What the last speculative generate() measured (its speculator replaces it).
        self.speculation_stats = AcceptanceStats()
        self.enable_context_encoding()
        if self.neuron_config.trace_tokengen_model:
            self.enable_token_generation()
        self.models += self.context.extra_submodels()
        for wrapper in self.models:
            wrapper.attach(self.context)

    def enable_context_encoding(self) -> None:
        self.context_encoding_model = ModelWrapper(
            self.config, self._model_cls, tag=CONTEXT_ENCODING_MODEL_TAG
        )
        self.models.append(self.context_encoding_model)

    def enable_token_generation(self) -> None:
        self.token_generation_model = ModelWrapper(
            self.config, self._model_cls, tag=TOKEN_GENERATION_MODEL_TAG
        )
        self.models.append(self.token_generation_model)

    @property
    def loaded_model(self) -> nn.Module:
        """The model the sub-models run (eager), or its compiled stand-in: its ``kv_mgr`` and
        ``kv_managers`` are the caches every phase shares."""
        model = self.context_encoding_model.model
        if model is None:
            raise NxdPlugError("the model is not loaded: call to_cpu() (or compile() then load())")
        return model

    def reset(self) -> None:
        """Start a new batch: the next call runs context encoding (and the plugins' step
        inputs reset, e.g. a sampler's generator is reseeded)."""
        self.kv_cache_populated = False
        self.context.reset()

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors every phase reads as weights, by parameter name: writing into one in
        place changes what every phase computes, eager or compiled, without recompiling. Empty
        when the weights are frozen into compiled graphs; a weight the backend holds in a form
        of its own (a layout its kernels read; projections of one input stacked in the first
        one's place, the others empty) is swapped with ``load_weights`` instead."""
        return dict(self.loaded_model.named_parameters())

    def reset_kv_cache(self) -> None:
        """Zero the KV caches."""
        for manager in self.loaded_model.kv_managers:
            manager.reset()
        self.kv_cache_populated = False

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        seq_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        sampling_params: torch.Tensor | None = None,
        prev_hidden: torch.Tensor | None = None,
        adapter_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        medusa_args: Any = None,
        return_dict: bool | None = None,
        input_capture_hook: Any = None,
        **step_keywords: Any,
    ) -> CausalLMOutputWithTokens:
        """HF's and NxD Inference's entry point: a new prompt, or more tokens of running ones,
        given as padded tensors; the same :class:`ScheduledStep` that the engine and
        ``generate()`` give :meth:`run` is built from them (a prompt where a row's positions
        start at 0 or nothing is cached yet).

        ``attention_mask`` follows the HF convention: [batch, tokens so far], 1 for real tokens,
        padding on either side. The inputs may be on any device (NxD Inference passes CPU
        tensors): they are moved to :attr:`device`, where the outputs are. Returns each row's
        last-token logits, [batch, 1, vocab]; when a plugin makes the model choose tokens
        (on-device sampling), the ``tokens`` [batch, 1] instead, and the logits only if it
        returns them too.

        ``sampling_params``, ``adapter_ids`` and any further keyword are per-row inputs of
        step-input plugins (``sampling_params`` [batch, 3] of on-device sampling, ...): each is
        handed to the enabled plugin that takes it, and refused when none does.
        A phase output's name (a :class:`~nxdplug.types.PhaseOutput` record's) set True
        encodes the prompt with the plugin's phase that computes it, whose outputs the returned
        object holds beside the logits.
        """
        unsupported = {
            "inputs_embeds": inputs_embeds,
            "labels": labels,
            "prev_hidden": prev_hidden,
            "medusa_args": medusa_args,
            "past_key_values": past_key_values,
        }
        given = [name for name, value in unsupported.items() if value is not None]
        if given:
            raise NotSupportedError(f"forward() does not accept {', '.join(given)} yet")
        if input_ids is None:
            raise NxdPlugError("forward() needs input_ids")
        if input_capture_hook is not None:
            input_capture_hook(self, [input_ids, attention_mask, position_ids, seq_ids])
        keywords = {"sampling_params": sampling_params, "adapter_ids": adapter_ids}
        keywords = {k: v for k, v in (keywords | step_keywords).items() if v is not None}
        batch = input_ids.shape[0]
        input_ids = input_ids.to(self.device)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if seq_ids is None:
            seq_ids = torch.arange(batch, dtype=torch.long, device=self.device)
        device = self.device
        attention_mask, seq_ids = attention_mask.to(device), seq_ids.to(device)
        if position_ids is None:
            position_ids = positions_from_mask(attention_mask)[:, -input_ids.shape[1] :]
        position_ids = position_ids.to(device)
        if self._is_prefill(position_ids, attention_mask, input_ids):
            scheduled = ScheduledStep.prompts(input_ids, attention_mask, keywords, seq_ids)
        else:
            scheduled = ScheduledStep.next_tokens(input_ids, position_ids[:, 0], keywords, seq_ids)
        return self.run(scheduled)

    def run(self, scheduled: ScheduledStep) -> CausalLMOutputWithTokens:
        """Run one scheduled step (the runner): the phase that computes it, given each row's
        new tokens and cached count. Prompts (nothing cached) go to context encoding (or the
        phase a selecting keyword names); rows that each add the same number of tokens over
        their cache, to token generation or a speculation phase taking that many; any other
        mix (a prompt's suffix after a cached prefix, a chunk), to the extension phase, when
        the config has one. Returns each row's last-token logits (or chosen tokens), as
        ``forward()`` does; a decode phase of several tokens returns all of theirs."""
        if self.loading_thread is not None:
            self.loading_thread.check(self.device)
        keywords = dict(scheduled.keywords)
        selected = self._phase_selected_by(keywords)
        refuse_untaken_keywords(self.context, keywords)
        if selected is not None and not scheduled.is_prompt:
            raise NxdPlugError(
                f"{selected.selected_by}=True is for a prompt's context encoding (positions "
                "from 0); this call continues sequences"
            )
        tokens, seq_ids = scheduled.input_ids, scheduled.seq_ids
        mask, positions = scheduled.cache_mask(), scheduled.positions()
        if scheduled.is_prompt:
            wrapper = selected or self.context_encoding_model
            outputs = wrapper(self._step(wrapper, tokens, mask, positions, seq_ids, keywords))
            self.kv_cache_populated = True
            return wrapper.output_of(outputs)
        wrapper = self.decode_model(scheduled.width) if scheduled.is_uniform else None
        if wrapper is None:
            wrapper = self.extend_model(scheduled)
        if isinstance(wrapper, ExtendWrapper) and scheduled.rows > wrapper.batch_size:
            return self._run_in_parts(wrapper, scheduled)
        outputs = wrapper(self._step(wrapper, tokens, mask, positions, seq_ids, keywords))
        return wrapper.output_of(outputs)

    def _run_in_parts(
        self, wrapper: ModelWrapper, scheduled: ScheduledStep
    ) -> CausalLMOutputWithTokens:
        """An extension step of more rows than its batch size, in parts of that many rows."""
        size, parts = wrapper.batch_size, []
        for start in range(0, scheduled.rows, size):
            rows = slice(start, start + size)
            keywords = {k: _rows_of(v, rows) for k, v in scheduled.keywords.items()}
            part = ScheduledStep(
                scheduled.input_ids[rows],
                scheduled.num_new[rows],
                scheduled.num_cached[rows],
                scheduled.seq_ids[rows],
                keywords,
            )
            parts.append(self.run(part))
        return join_outputs(parts)

    def extend_model(self, scheduled: ScheduledStep) -> ExtendWrapper:
        """The extension phase taking the step's longest row of new tokens (the smallest such
        size); an error saying what enables one when there is none."""
        sizes = sorted(
            (w for w in self.models if isinstance(w, ExtendWrapper)), key=lambda w: w.new_tokens
        )
        for wrapper in sizes:
            if scheduled.width <= wrapper.new_tokens:
                return wrapper
        if not sizes:
            raise NotSupportedError(
                "this step adds new tokens over cached positions in rows of different lengths "
                "(a prompt's suffix after a cached prefix, or a chunk of a prompt), which needs "
                "the extension phase: set is_block_kv_layout=True with is_prefix_caching or "
                "is_chunked_prefill"
            )
        raise NxdPlugError(
            f"a row adds {scheduled.width} new tokens over its cache but the largest extension "
            f"phase takes {sizes[-1].new_tokens}; raise the context-encoding buckets"
        )

    def selecting_keywords(self) -> frozenset[str]:
        """The forward() keywords that route a prompt to a plugin's context-encoding phase
        (the names of the phase outputs this model computes)."""
        return frozenset(w.selected_by for w in self.models if w.selected_by)

    def _phase_selected_by(self, keywords: dict[str, Any]) -> ModelWrapper | None:
        """Take the selecting keywords out of ``keywords``; the phase a true one selects. A
        phase output this model has no phase for is refused, saying how to get one."""
        if not keywords:
            return None
        chosen = [w for w in self.models if w.selected_by and keywords.pop(w.selected_by, False)]
        for record in get_registry().records("phase_outputs"):
            if keywords.pop(record.name, False):
                raise NotSupportedError(f"forward({record.name}=True): {record.missing}")
        if len(chosen) > 1:
            names = ", ".join(w.selected_by or "" for w in chosen)
            raise NxdPlugError(f"forward() was given {names}: at most one of them at a time")
        return chosen[0] if chosen else None

    def _step(
        self,
        wrapper: ModelWrapper,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        seq_ids: torch.Tensor,
        keywords: dict[str, Any],
    ) -> StepInputs:
        """One step of ``wrapper``, with the per-row inputs its step-input plugins build.
        Decode steps see each row's cache up to its last position."""
        extra: dict[str, torch.Tensor] = {}
        for record in wrapper.step_inputs:
            taken = {k: keywords[k] for k in record.keywords if k in keywords}
            builder = self.context.step_input_builder(record)
            extra |= builder.build(input_ids.shape[0], taken, self.device)
        return StepInputs(input_ids, attention_mask, position_ids, seq_ids, extra)

    def submodel(self, tag: str) -> ModelWrapper:
        """The sub-model with this tag (a plugin's, e.g. a speculation phase)."""
        for wrapper in self.models:
            if wrapper.tag == tag:
                return wrapper
        tags = ", ".join(w.tag for w in self.models)
        raise NxdPlugError(
            f"{type(self).__name__} has no {tag}; its sub-models are {tags} (the config "
            "selects which a plugin adds)"
        )

    def decode_model(self, tokens_per_step: int) -> ModelWrapper | None:
        """The sub-model that takes ``tokens_per_step`` new tokens per row after the prompt:
        token generation for 1, a speculation sub-model for k+1."""
        for wrapper in self.models:
            if not wrapper.is_context_encoding and wrapper.tokens_per_step == tokens_per_step:
                return wrapper
        return None

    def _is_prefill(
        self, position_ids: torch.Tensor, attention_mask: torch.Tensor, input_ids: torch.Tensor
    ) -> bool:
        if not self.kv_cache_populated or self.decode_model(input_ids.shape[1]) is None:
            return True
        real = attention_mask[:, -input_ids.shape[1] :] != 0
        return bool(((position_ids == 0) & real).any())


def refuse_untaken_keywords(context: PipelineContext, keywords: dict[str, Any]) -> None:
    """Refuse per-row inputs that no enabled step-input plugin takes, saying which installed
    record would take each and what enables it."""
    untaken = sorted(set(keywords) - context.step_keywords()) if keywords else None
    if not untaken:
        return
    records = get_registry().records("step_inputs")
    reasons = []
    for keyword in untaken:
        takers = [r for r in records if keyword in r.keywords]
        if takers:
            how = "; or ".join(
                f"the {r.name!r} step input, enabled by {' or '.join(r.enabled_by)}" for r in takers
            )
            reasons.append(f"{keyword} is taken by {how}: set it in the NeuronConfig")
        else:
            reasons.append(f"{keyword}: no installed plugin takes it")
    raise NotSupportedError(
        f"forward() was given inputs no enabled plugin takes: {'; '.join(reasons)}"
    )


def architecture_for(model_path: str | Path) -> ModelArchitecture:
    """The model plugin serving a checkpoint, from its config's architectures / model_type."""
    probe = InferenceConfig(NeuronConfig(), load_config=load_pretrained_config(model_path))
    return get_registry().find_architecture(
        getattr(probe, "architectures", None) or (), getattr(probe, "model_type", None)
    )


def from_pretrained(
    model_path: str | Path,
    neuron_config: NeuronConfig | None = None,
    config: InferenceConfig | None = None,
) -> NeuronApplicationBase:
    """The application for a checkpoint, its class chosen from ``config.json`` by the registry."""
    application_cls = architecture_for(model_path).load("application")
    if config is None:
        config_cls = application_cls.get_config_cls()
        config = config_cls(
            neuron_config or config_cls.get_neuron_config_cls()(),
            load_config=load_pretrained_config(model_path),
        )
    return application_cls(model_path, config)


def _rows_of(value: Any, rows: slice) -> Any:
    """A per-row step keyword's value for some rows (a tensor's rows; others as they are)."""
    return value[rows] if isinstance(value, torch.Tensor) and value.dim() > 0 else value
