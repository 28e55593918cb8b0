"""ModelWrapper: one sub-model (a phase) with its buckets, its batch size and its padding.

Everything data-dependent happens here, on the host: choosing the smallest bucket that fits,
padding inputs up to it, padding the batch up to the compiled batch size. The model itself then
sees only the fixed shapes of one bucket, so each bucket can be traced once.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nxdplug.errors import NxdPlugError
from nxdplug.modules.step import Phase, StepInputs, in_phase
from nxdplug.runtime.outputs import CausalLMOutputWithTokens

if TYPE_CHECKING:
    from nxdplug.config import InferenceConfig
    from nxdplug.pipeline import PipelineContext
    from nxdplug.types import StepInput

CONTEXT_ENCODING_MODEL_TAG = "context_encoding_model"
TOKEN_GENERATION_MODEL_TAG = "token_generation_model"
# The speculation plugins' verification phases, under NxD Inference's tags.
SPECULATION_MODEL_TAG = "speculation_model"
FUSED_SPECULATION_MODEL_TAG = "fused_speculation_model"
# An eager model takes prompts of any width: it pads them to a multiple of this many tokens
# rather than to their bucket, whose padding it would compute like the prompt (a 512-token
# prompt in the default 1024-token bucket took twice HF's time to first token).
EAGER_PROMPT_WIDTH_STEP = 32


class ModelWrapper(nn.Module):
    # Whether the phase takes the step inputs that name no phase (sampling, ...); a plugin's
    # phase with inputs of its own may say no (it still gets those naming its tag).
    takes_step_inputs = True
    # A forward() keyword that routes a prompt here instead of to the core's context encoding
    # (a plugin's context-encoding phase with outputs of its own: a PhaseOutput record's name).
    selected_by: str | None = None

    def __init__(
        self,
        config: InferenceConfig,
        model_cls: type[nn.Module],
        tag: str = "",
        compiler_args: str | None = None,
        tokens_per_step: int = 1,
        is_context_encoding: bool | None = None,
        batch_size: int | None = None,
    ) -> None:
        """``tokens_per_step``: the tokens each row feeds per call outside context encoding (1
        for token generation, k+1 to verify k speculated tokens); ``application.forward``
        routes a call by it. 0 marks a phase only its plugin calls (a Medusa tree, a fused
        EAGLE step), which ``forward`` never routes to. ``is_context_encoding``: the phase
        encodes prompts (context buckets); by default, when ``tag`` is the core's
        context-encoding tag. ``batch_size``: rows per call; by default ctx_batch_size for
        context encoding and tkg_batch_size otherwise (a speculation plugin passes its own)."""
        super().__init__()
        self.config = config
        self.neuron_config = config.neuron_config
        self.model_cls = model_cls
        self.tag = tag
        self.compiler_args = compiler_args
        self.model: nn.Module | None = None
        if is_context_encoding is None:
            is_context_encoding = tag == CONTEXT_ENCODING_MODEL_TAG
        self.is_context_encoding = is_context_encoding
        self.tokens_per_step = tokens_per_step
        self.buckets = self._buckets()
        if batch_size is None:
            batch_size = (
                self.neuron_config.ctx_batch_size
                if is_context_encoding
                else self.neuron_config.tkg_batch_size
            )
        self.batch_size = batch_size
        self.context: PipelineContext | None = None
        self.step_inputs: tuple[StepInput, ...] = ()
        # Whether the model runs graphs of one bucket's shapes (compiled) or any shape (eager).
        self.fixed_widths = True

    def attach(self, context: PipelineContext) -> None:
        """Join an application's pipeline context: the step inputs the enabled plugins add to
        this phase (what its graphs take after the core's four)."""
        self.context = context
        self.step_inputs = context.step_inputs_for(self.tag, self.takes_step_inputs)

    @property
    def phase(self) -> Phase:
        """What :func:`~nxdplug.modules.step.current_phase` says while this sub-model runs."""
        return Phase(self.tag, self.is_context_encoding)

    @property
    def extra_input_names(self) -> tuple[str, ...]:
        """The names of the plugins' step inputs, in the order the graphs take them."""
        return tuple(name for record in self.step_inputs for name in record.inputs)

    def _buckets(self) -> list[int]:
        neuron_config = self.neuron_config
        if self.is_context_encoding:
            configured, largest = (
                neuron_config.context_encoding_buckets,
                neuron_config.max_context_length,
            )
        else:
            configured, largest = neuron_config.token_generation_buckets, neuron_config.seq_len
        if neuron_config.enable_bucketing and configured:
            return sorted(configured)
        return [largest]

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.context is None else self.context.device

    def input_length(self, bucket: int) -> int:
        """Tokens per row in this phase's inputs: the bucket for context encoding, else
        ``tokens_per_step``."""
        return bucket if self.is_context_encoding else self.tokens_per_step

    def phase_module(self, model: nn.Module) -> nn.Module:
        """What this phase runs, given the application's model: the model itself here; a
        speculation plugin's wrapper may return a module that calls it differently (its own
        outputs, extra heads). Such a module keeps the model as its ``model`` attribute and
        adds no parameters or buffers of its own: every phase shares the model's weights."""
        return model

    def example_extra(self) -> dict[str, torch.Tensor]:
        """Example tensors of the plugins' step inputs, for tracing."""
        extra: dict[str, torch.Tensor] = {}
        for record in self.step_inputs:
            builder = self.context.step_input_builder(record)
            extra |= builder.example(self.batch_size, self.device)
        return extra

    def input_generator(self) -> list[StepInputs]:
        """Example inputs, one step per bucket (for tracing)."""
        batch, device = self.batch_size, self.device
        extra = self.example_extra()
        inputs = []
        for bucket in self.buckets:
            length = self.input_length(bucket)
            inputs.append(
                StepInputs(
                    torch.zeros(batch, length, dtype=torch.long, device=device),
                    torch.ones(batch, bucket, dtype=torch.long, device=device),
                    torch.arange(bucket - length, bucket, dtype=torch.long, device=device)
                    .expand(batch, length)
                    .contiguous(),
                    torch.arange(batch, dtype=torch.long, device=device),
                    extra,
                )
            )
        return inputs

    def bucket_for(self, length: int) -> int:
        """The smallest bucket holding ``length`` positions."""
        for bucket in self.buckets:
            if length <= bucket:
                return bucket
        what = "prompt" if self.is_context_encoding else "sequence"
        limit = "max_context_length" if self.is_context_encoding else "seq_len"
        raise NxdPlugError(
            f"the {what} needs {length} positions but the largest {self.tag} bucket is "
            f"{self.buckets[-1]}; use a shorter {what} or raise {limit} (and the buckets)"
            + (", or set allow_input_truncation=True to cut it" if self.is_context_encoding else "")
        )

    def forward(self, step: StepInputs) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Pad to a bucket and to the batch size, run the model, drop the padding rows."""
        rows = step.rows
        self.check_ready(rows)
        if self.is_context_encoding:
            step = self.truncate_prompt(step)
        needed = step.input_ids.shape[-1] if self.is_context_encoding else None
        step = self.pad_to_bucket(step, needed)
        if rows > self.batch_size:  # context encoding only (check_ready)
            return self.run_sub_batches(step)
        return self.run_padded(rows, step)

    def run_sub_batches(self, step: StepInputs) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Encode a batch larger than the phase's batch size (ctx_batch_size) in sub-batches
        of that many rows, in order, as NxD Inference does; the outputs are joined.

        A short last sub-batch is padded with cache rows no sequence of the whole batch uses;
        when there are too few, it is filled with the rows just before it instead (encoded
        again: the same inputs write the same cache contents), their outputs dropped."""
        rows, size = step.rows, self.batch_size
        free = self.neuron_config.max_batch_size - rows
        reserved = set(step.seq_ids.tolist())
        parts = []
        for start in range(0, rows, size):
            stop = min(start + size, rows)
            first = start if stop - start + free >= size else stop - size

            def take(t: torch.Tensor, first: int = first, stop: int = stop) -> torch.Tensor:
                return t[first:stop]

            chunk = step.map_rows(take).replace(seq_ids=take(step.seq_ids))
            outputs = self.run_padded(chunk.rows, chunk, reserved)
            parts.append(_rows_from(outputs, start - first))
        if isinstance(parts[0], torch.Tensor):
            return torch.cat(parts)
        return tuple(torch.cat(column) for column in zip(*parts, strict=True))

    def run_padded(
        self, rows: int, step: StepInputs, reserved: set[int] | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Run ``step`` (already of a bucket's width) padded to the batch size, and return the
        outputs of its first ``rows`` rows. ``reserved``: cache rows padding must not use
        (besides the step's own)."""
        with in_phase(self.phase):
            outputs = self.model(self.pad_batch(step, reserved))
        if isinstance(outputs, torch.Tensor):
            return outputs[:rows]
        return tuple(output[:rows] for output in outputs)

    def output_of(
        self, outputs: torch.Tensor | tuple[torch.Tensor, ...]
    ) -> CausalLMOutputWithTokens:
        """What ``application.forward`` returns for this phase's outputs: the logits, or the
        tokens an output stage chose (and the logits, when it returns them too)."""
        if isinstance(outputs, torch.Tensor):
            return CausalLMOutputWithTokens(logits=outputs)
        tokens, *logits = outputs
        return CausalLMOutputWithTokens(logits=logits[0] if logits else None, tokens=tokens)

    def check_ready(self, rows: int) -> None:
        """Refuse a call before the model is loaded, or with more rows than the batch size
        (context encoding: than the cache rows, max_batch_size; it runs sub-batches)."""
        if self.model is None:
            raise NxdPlugError(
                f"{self.tag} is not loaded: call to_cpu() (or compile() then load()) first"
            )
        if self.is_context_encoding and rows > self.batch_size:
            limit = self.neuron_config.max_batch_size
            if rows > limit:
                raise NxdPlugError(
                    f"{rows} sequences were given but the KV cache holds {limit} "
                    "(max_batch_size); raise batch_size"
                )
            return
        if rows > self.batch_size:
            raise NxdPlugError(
                f"{rows} sequences were given but {self.tag} runs batches of at most "
                f"{self.batch_size}; raise batch_size (or ctx/tkg/spec_batch_size)"
            )

    def truncate_prompt(self, step: StepInputs) -> StepInputs:
        """A prompt wider than the largest bucket cut to its first columns, with a warning,
        when ``allow_input_truncation`` says so (NxD Inference's rule); else unchanged (and
        :meth:`bucket_for` refuses it)."""
        largest = self.buckets[-1]
        width = step.input_ids.shape[-1]
        if width <= largest or not self.neuron_config.allow_input_truncation:
            return step
        warnings.warn(
            f"Truncating input ({width} tokens) to max_context_length ({largest} tokens) "
            "because allow_input_truncation is set; the outputs continue the cut prompt",
            stacklevel=2,
        )
        return step.replace(
            input_ids=step.input_ids[:, :largest],
            attention_mask=step.attention_mask[:, :largest],
            position_ids=step.position_ids[:, :largest],
        )

    def get_target_bucket(self, *args: torch.Tensor, strategy: str = "first_fit") -> int:
        """NxD Inference's bucket choice for ``args`` (input_ids, attention_mask, ...), by the
        attention mask's width: ``"first_fit"`` the smallest bucket holding it (the one
        :meth:`forward` runs), ``"second_fit"`` the bucket after that (or the largest).
        Past the largest bucket: the largest with ``allow_input_truncation``, else ValueError.
        """
        if strategy not in ("first_fit", "second_fit"):
            raise ValueError(f"strategy must be 'first_fit' or 'second_fit'; got {strategy!r}")
        width = args[1].shape[1]
        fitting = [i for i, bucket in enumerate(self.buckets) if width <= bucket]
        if not fitting:
            if self.neuron_config.allow_input_truncation:
                return self.buckets[-1]
            raise ValueError(
                f"Input len {width} exceeds largest bucket ({self.buckets[-1]}) for {self.tag}; "
                "set allow_input_truncation=True to cut it"
            )
        step_up = 1 if strategy == "second_fit" else 0
        return self.buckets[min(fitting[0] + step_up, len(self.buckets) - 1)]

    def pad_inputs(self, *args: Any, pad_type: str = "first_fit") -> tuple[Any, ...]:
        """NxD Inference's padding of a phase's positional inputs (input_ids, attention_mask,
        position_ids, then the rest, returned unchanged) to a bucket: ``"max"`` the largest,
        ``"first_fit"`` / ``"second_fit"`` as :meth:`get_target_bucket` chooses.

        Context encoding pads input_ids with the pad token (0 without one), the mask with 0
        and position_ids with 1; the other phases pad the mask only. Inputs wider than the
        bucket are cut to it, with a warning, when ``allow_input_truncation`` is set, and
        refused with ValueError otherwise."""
        if pad_type not in ("max", "first_fit", "second_fit"):
            raise ValueError(
                f"pad_type must be 'max', 'first_fit' or 'second_fit'; got {pad_type!r}"
            )
        if pad_type == "max":
            bucket = self.buckets[-1]
        else:
            bucket = self.get_target_bucket(*args, strategy=pad_type)
        to_pad = args[:3] if self.is_context_encoding else args[1:2]
        self._check_width(max(tensor.shape[1] for tensor in to_pad), bucket)
        if self.is_context_encoding:
            pad_token = getattr(self.config, "pad_token_id", None) or 0
            padded = [
                _pad_or_cut(tensor, bucket, value)
                for tensor, value in zip(to_pad, (pad_token, 0, 1), strict=True)
            ]
            return (*padded, *args[3:])
        input_ids, attention_mask, *rest = args
        return (input_ids, _pad_or_cut(attention_mask, bucket, 0), *rest)

    def _check_width(self, width: int, bucket: int) -> None:
        """Refuse inputs wider than ``bucket``, or warn that they are cut with
        ``allow_input_truncation``."""
        if width <= bucket:
            return
        limit = "max_context_length" if self.is_context_encoding else "max_length"
        if not self.neuron_config.allow_input_truncation:
            raise ValueError(
                f"Inputs supplied ({width} positions) are longer than {limit} ({bucket} "
                f"positions) for {self.tag}. To truncate inputs, set allow_input_truncation=True."
            )
        warnings.warn(
            f"Truncating input ({width} positions) to {limit} ({bucket} positions). This may "
            "cause unexpected outputs.",
            stacklevel=3,
        )

    def pad_to_bucket(self, step: StepInputs, needed: int | None = None) -> StepInputs:
        """The step with its mask widened to the smallest bucket holding ``needed`` positions
        (the mask's width by default); in context encoding the tokens and positions too. An
        eager model's prompts are widened only to a multiple of EAGER_PROMPT_WIDTH_STEP."""
        attention_mask = step.attention_mask
        width = attention_mask.shape[-1] if needed is None else needed
        bucket = self.bucket_for(width)
        if self.is_context_encoding and not self.fixed_widths:
            step_size = EAGER_PROMPT_WIDTH_STEP
            bucket = min(bucket, -(-width // step_size) * step_size)
        mask_pad = bucket - attention_mask.shape[-1]
        step = step.replace(attention_mask=nn.functional.pad(attention_mask, (0, mask_pad)))
        if not self.is_context_encoding:
            return step
        token_pad = bucket - step.input_ids.shape[-1]
        last = step.position_ids[:, -1:]
        extra = last + torch.arange(1, token_pad + 1, device=last.device)
        return step.replace(
            input_ids=nn.functional.pad(step.input_ids, (0, token_pad), value=0),
            position_ids=torch.cat([step.position_ids, extra], dim=-1),
        )

    def pad_batch(self, step: StepInputs, reserved: set[int] | None = None) -> StepInputs:
        """``step`` with as many rows as the batch size: padding rows repeat row 0's inputs and
        write to cache rows no real sequence uses (neither the step's nor ``reserved``). With
        continuous batching every other line may hold a running sequence, so padding rows
        repeat row 0's cache line too, and the model has them write row 0's very keys and
        values (``CacheSlot.writer_rows``)."""
        rows = step.rows
        missing = self.batch_size - rows
        if missing == 0:
            return step
        seq_ids = step.seq_ids
        if self.neuron_config.is_continuous_batching:
            return step.map_rows(lambda t: _repeat_first_row(t, missing)).replace(
                seq_ids=_repeat_first_row(seq_ids, missing)
            )
        taken = set(seq_ids.tolist()) | (reserved or set())
        free_rows = [r for r in range(self.neuron_config.max_batch_size) if r not in taken]
        if len(free_rows) < missing:
            raise NxdPlugError(
                f"cannot pad a batch of {rows} to {self.batch_size}: only {len(free_rows)} free "
                f"cache rows (max_batch_size={self.neuron_config.max_batch_size})"
            )
        pad_seq_ids = torch.tensor(free_rows[:missing], dtype=seq_ids.dtype, device=seq_ids.device)

        return step.map_rows(lambda t: _repeat_first_row(t, missing)).replace(
            seq_ids=torch.cat([seq_ids, pad_seq_ids])
        )


def _pad_or_cut(tensor: torch.Tensor, width: int, value: int) -> torch.Tensor:
    """``tensor`` [rows, columns] padded on the right with ``value``, or cut, to ``width``."""
    return nn.functional.pad(tensor, (0, width - tensor.shape[1]), value=value)


def _repeat_first_row(tensor: torch.Tensor, times: int) -> torch.Tensor:
    return torch.cat([tensor, tensor[:1].expand(times, *tensor.shape[1:])])


def _rows_from(
    outputs: torch.Tensor | tuple[torch.Tensor, ...], first: int
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The outputs from row ``first`` on."""
    if isinstance(outputs, torch.Tensor):
        return outputs[first:]
    return tuple(output[first:] for output in outputs)


EXTEND_MODEL_TAG = "extend_model"


class LastNewTokenLogits(nn.Module):
    """The model run on new tokens over cached positions, returning what ``output_stage``
    makes of the logits of each row's last real new token, [batch, 1, vocab]: a prompt's suffix
    or chunk needs no other logits (the last position the mask holds is that token's)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, step: StepInputs) -> torch.Tensor | tuple[torch.Tensor, ...]:
        hidden = self.model.hidden_states(step)
        last = step.attention_mask.sum(dim=-1) - 1 - step.position_ids[:, 0]
        index = last.clamp(min=0)[:, None, None].expand(-1, 1, hidden.shape[-1])
        logits = self.model.lm_head(hidden.gather(1, index)).float()
        return self.model.output_stage(logits, step)


class ExtendWrapper(ModelWrapper):
    """Up to ``new_tokens`` new tokens per row over the row's cached positions: a prompt's
    suffix after a cached prefix, or one chunk of a long prompt. The buckets are the cache
    widths (token generation's); each size of new tokens is a sub-model of its own, so the
    graphs form NxD Inference's two-dimensional buckets (new tokens x positions; with
    ``prefix_buckets``, a cached prefix's length plus the new tokens). Rows may
    have fewer real tokens than ``new_tokens``: the padding continues their positions, where
    the cache mask leaves them out (a cache that lends blocks writes them nowhere)."""

    def __init__(
        self,
        config: InferenceConfig,
        model_cls: type[nn.Module],
        new_tokens: int,
        widths: list[int] | None = None,
        batch_size: int | None = None,
    ) -> None:
        """``widths``: the cache widths (buckets) of its graphs; token generation's by
        default. ``batch_size``: rows per call, ctx_batch_size by default."""
        # tokens_per_step 0: forward() never routes a decode here; the runner picks it.
        super().__init__(
            config,
            model_cls,
            tag=f"{EXTEND_MODEL_TAG}_{new_tokens}",
            tokens_per_step=0,
            is_context_encoding=False,
            batch_size=batch_size or config.neuron_config.ctx_batch_size,
        )
        self.new_tokens = new_tokens
        if widths is not None:
            self.buckets = sorted(widths)

    def input_length(self, bucket: int) -> int:
        return self.new_tokens

    def phase_module(self, model: nn.Module) -> nn.Module:
        return LastNewTokenLogits(model)

    def input_generator(self) -> list[StepInputs]:
        """Example steps: the new tokens at the end of each width (at its start when the width
        is the smaller)."""
        steps = []
        for step in super().input_generator():
            width = step.attention_mask.shape[-1]
            first = max(width - self.new_tokens, 0)
            positions = torch.arange(first, first + self.new_tokens, device=self.device)
            steps.append(step.replace(position_ids=positions.expand_as(step.input_ids).clone()))
        return steps

    def forward(self, step: StepInputs) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Pad the tokens to ``new_tokens`` (positions continuing), the mask to a width bucket,
        and the rows to the batch size."""
        self.check_ready(step.rows)
        pad = self.new_tokens - step.input_ids.shape[-1]
        if pad:
            last = step.position_ids[:, -1:]
            more = last + torch.arange(1, pad + 1, device=last.device)
            step = step.replace(
                input_ids=nn.functional.pad(step.input_ids, (0, pad), value=0),
                position_ids=torch.cat([step.position_ids, more], dim=-1),
            )
        return self.run_padded(step.rows, self.pad_to_bucket(step))
