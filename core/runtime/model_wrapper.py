"""ModelWrapper: one sub-model (a phase) with its buckets, its batch size and its padding.

Everything data-dependent happens here, on the host: choosing the smallest bucket that fits,
padding inputs up to it, padding the batch up to the compiled batch size. The model itself then
sees only the fixed shapes of one bucket, so each bucket can be traced once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nxdplug.errors import NxdPlugError
from nxdplug.runtime.sampling import example_sampling_inputs

CONTEXT_ENCODING_MODEL_TAG = "context_encoding_model"
TOKEN_GENERATION_MODEL_TAG = "token_generation_model"
SPECULATION_MODEL_TAG = "speculation_model"


class ModelWrapper(nn.Module):
    def __init__(
        self,
        config: Any,
        model_cls: type[nn.Module],
        tag: str = "",
        compiler_args: str | None = None,
        tokens_per_step: int = 1,
        is_context_encoding: bool | None = None,
    ) -> None:
        """``tokens_per_step``: the tokens each row feeds per call outside context encoding (1
        for token generation, k+1 to verify k speculated tokens); ``application.forward``
        routes a call by it. 0 marks a phase only its speculation plugin calls (a Medusa tree,
        a fused EAGLE step), which ``forward`` never routes to. ``is_context_encoding``: the
        phase encodes prompts (context buckets, ctx_batch_size); by default, when ``tag`` is
        the core's context-encoding tag."""
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
        self.batch_size = self._batch_size()

    def _batch_size(self) -> int:
        """ctx_batch_size for context encoding, tkg_batch_size for one token per step, and
        spec_batch_size for speculation phases (several tokens per step, or driven by their
        plugin)."""
        neuron_config = self.neuron_config
        if self.is_context_encoding:
            return neuron_config.ctx_batch_size
        if self.tokens_per_step == 1:
            return neuron_config.tkg_batch_size
        return neuron_config.spec_batch_size

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

    def input_generator(self) -> list[tuple[torch.Tensor, ...]]:
        """Example inputs, one tuple per bucket, in forward's argument order (for tracing);
        with on-device sampling, the sampling inputs close each tuple."""
        sampling_config = self.neuron_config.on_device_sampling_config
        batch = self.batch_size
        sampling = ()
        if sampling_config is not None:
            sampling = example_sampling_inputs(batch, sampling_config)
        inputs = []
        for bucket in self.buckets:
            length = self.input_length(bucket)
            inputs.append(
                (
                    torch.zeros(batch, length, dtype=torch.long),
                    torch.ones(batch, bucket, dtype=torch.long),
                    torch.arange(bucket - length, bucket, dtype=torch.long)
                    .expand(batch, length)
                    .contiguous(),
                    torch.arange(batch, dtype=torch.long),
                    *sampling,
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
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        seq_ids: torch.Tensor,
        sampling_params: torch.Tensor | None = None,
        sampling_noise: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Pad to a bucket and to the batch size, run the model, drop the padding.

        The sampling inputs, given with on-device sampling, are padded like the other rows.
        """
        rows = input_ids.shape[0]
        self.check_ready(rows)
        needed = attention_mask.shape[-1]
        if self.is_context_encoding:
            needed = input_ids.shape[-1]
        bucket = self.bucket_for(needed)
        input_ids, attention_mask, position_ids = self._pad_to_bucket(
            bucket, input_ids, attention_mask, position_ids
        )
        sampling = tuple(t for t in (sampling_params, sampling_noise) if t is not None)
        seq_ids, (input_ids, attention_mask, position_ids, *sampling) = self._pad_batch(
            rows, seq_ids, (input_ids, attention_mask, position_ids, *sampling)
        )
        outputs = self.model(input_ids, attention_mask, position_ids, seq_ids, *sampling)
        if isinstance(outputs, torch.Tensor):
            return outputs[:rows]
        return tuple(output[:rows] for output in outputs)

    def check_ready(self, rows: int) -> None:
        """Refuse a call before the model is loaded, or with more rows than the batch size."""
        if self.model is None:
            raise NxdPlugError(
                f"{self.tag} is not loaded: call to_cpu() (or compile() then load()) first"
            )
        if rows > self.batch_size:
            raise NxdPlugError(
                f"{rows} sequences were given but {self.tag} runs batches of at most "
                f"{self.batch_size}; raise batch_size (or ctx/tkg/spec_batch_size)"
            )

    def _pad_to_bucket(
        self,
        bucket: int,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mask_pad = bucket - attention_mask.shape[-1]
        attention_mask = nn.functional.pad(attention_mask, (0, mask_pad), value=0)
        if self.is_context_encoding:
            token_pad = bucket - input_ids.shape[-1]
            input_ids = nn.functional.pad(input_ids, (0, token_pad), value=0)
            last = position_ids[:, -1:]
            extra = last + torch.arange(1, token_pad + 1, device=last.device)
            position_ids = torch.cat([position_ids, extra], dim=-1)
        return input_ids, attention_mask, position_ids

    def _pad_batch(
        self, rows: int, seq_ids: torch.Tensor, per_row: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """``seq_ids`` and the ``per_row`` inputs padded to the batch size."""
        missing = self.batch_size - rows
        if missing == 0:
            return seq_ids, per_row
        # Padding rows repeat row 0's inputs and write to cache rows no real sequence uses.
        taken = set(seq_ids.tolist())
        free_rows = [r for r in range(self.neuron_config.max_batch_size) if r not in taken]
        pad_seq_ids = torch.tensor(free_rows[:missing], dtype=seq_ids.dtype)
        if len(pad_seq_ids) < missing:
            raise NxdPlugError(
                f"cannot pad a batch of {rows} to {self.batch_size}: only {len(free_rows)} free "
                f"cache rows (max_batch_size={self.neuron_config.max_batch_size})"
            )

        def pad(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t[:1].expand(missing, *t.shape[1:])])

        return torch.cat([seq_ids, pad_seq_ids]), tuple(pad(t) for t in per_row)
