"""The compute ceiling of context encoding: the FLOPs one prefill needs and this CPU's GEMM peak.

A prompt of ``P`` tokens multiplies every weight matrix by ``P`` activation rows, so prefill is
bound by arithmetic rather than by reading weights as decoding is. Its floor is the FLOPs the
model needs divided by the best FLOP/s a large matmul reaches in the model's dtype on torch's
current threads; a measured time to first token is then a fraction of that floor.

The count is what the model needs, the same for every implementation: each weight matrix once
per prompt token (of routed experts, those a token is routed to), causal attention's QK^T and
PV over the positions each query sees, and the LM head for each row's last token only, the one
whose logits pick the first new token. (nxdplug's context encoding computes just those logits;
HF's ``generate()`` asks for them alone through ``logits_to_keep``.) Embedding lookups, norms,
activations, softmax and biases are left out: they are not matmuls and cost little next to them.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch import nn

from nxdplug.plugin_api import ParallelEmbedding, head_dim_of

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig

GEMM_SIZE = 2048
GEMM_REPEATS = 5
OUTPUT_WEIGHT = "lm_head.weight"


@attrs.frozen
class PrefillFlops:
    """FLOPs of one context encoding of a batch, by where they are spent."""

    weights: int  # every weight matrix but the LM head, for every prompt token
    attention: int  # QK^T and PV of the causal prompt
    lm_head: int  # each row's last token only

    @property
    def total(self) -> int:
        return self.weights + self.attention + self.lm_head


def matmul_parameters_per_token(module: nn.Module) -> int:
    """Weight-matrix elements one token is multiplied by, the LM head left out.

    Every parameter of two or more dimensions counts, except embedding tables (looked up, not
    multiplied) and ``lm_head.weight``. Submodules that use part of their weights per token
    (routed experts) say how much through ``decode_weight_bytes(batch_size, dtype)``: one token
    in a one-byte dtype gives its element count.
    """
    partial = {
        name: sub
        for name, sub in module.named_modules()
        if name and callable(getattr(sub, "decode_weight_bytes", None))
    }
    outermost = [n for n in partial if not any(n.startswith(f"{o}.") for o in partial)]
    skipped = tuple(f"{name}." for name in outermost) + tuple(
        f"{name}." for name, sub in module.named_modules() if _is_embedding(sub)
    )
    whole = sum(
        parameter.numel()
        for name, parameter in module.named_parameters()
        if parameter.dim() >= 2 and not name.startswith(skipped) and name != OUTPUT_WEIGHT
    )
    return whole + sum(partial[n].decode_weight_bytes(1, torch.uint8) for n in outermost)


def _is_embedding(module: nn.Module) -> bool:
    return isinstance(module, nn.Embedding | ParallelEmbedding)


def causal_attention_flops(config: InferenceConfig, batch_size: int, prompt_length: int) -> int:
    """QK^T and PV of a causal prompt: query ``i`` (1-based) meets ``i`` keys in each query
    head of each layer, 2 * head_dim FLOPs per product, twice (scores, then values).

    Every layer is taken as full attention; a sliding window would need fewer.
    """
    pairs = prompt_length * (prompt_length + 1) // 2
    heads = config.num_attention_heads * config.num_hidden_layers
    return batch_size * heads * 2 * 2 * head_dim_of(config) * pairs


def prefill_flops(
    skeleton: nn.Module, config: InferenceConfig, batch_size: int, prompt_length: int
) -> PrefillFlops:
    """What one context encoding of ``batch_size`` prompts of ``prompt_length`` tokens needs,
    counted on the model's weights (``skeleton``, e.g. built on the meta device)."""
    output = skeleton.get_parameter(OUTPUT_WEIGHT)
    return PrefillFlops(
        weights=2 * matmul_parameters_per_token(skeleton) * prompt_length * batch_size,
        attention=causal_attention_flops(config, batch_size, prompt_length),
        lm_head=2 * output.numel() * batch_size,
    )


def measure_gemm_flops(
    dtype: torch.dtype, size: int = GEMM_SIZE, repeats: int = GEMM_REPEATS
) -> float:
    """This CPU's matmul peak in FLOP/s: the best of ``repeats`` timed ``size``-cubed products
    in ``dtype`` on torch's current threads, after one untimed call each, by ``torch.mm`` and,
    where torch has oneDNN, by its linear on a weight reordered into its blocked layout (what
    the inductor backend's graphs call; in float32 it is several times torch.mm's speed on
    some builds, which would otherwise put a prefill above its ceiling).

    Large square operands leave the GEMM kernel compute-bound, the best case a prefill's
    matmuls can reach.
    """
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(dtype)
    b = torch.randn(size, size, generator=generator).to(dtype)
    products = [lambda: torch.mm(a, b)]
    if torch.backends.mkldnn.is_available():
        reordered = torch.ops.mkldnn._reorder_linear_weight(b, size)
        products.append(
            lambda: torch.ops.mkldnn._linear_pointwise(a, reordered, None, "none", [], "")
        )
    best = math.inf
    for product in products:
        product()
        for _ in range(repeats):
            start = time.perf_counter()
            product()
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


@attrs.frozen
class PrefillCeiling:
    """The compute floor of one context encoding: its FLOPs at the measured GEMM peak."""

    gemm_flops_per_s: float
    flops: PrefillFlops

    @property
    def ttft_floor(self) -> float:
        """Seconds a prefill would take if every FLOP ran at the GEMM peak."""
        return self.flops.total / self.gemm_flops_per_s

    def to_dict(self, ttfts: dict[str, float]) -> dict[str, Any]:
        """The ceiling, and each system's fraction of it from its TTFT in seconds."""
        return {
            "gemm_gflop_per_s": self.gemm_flops_per_s / 1e9,
            "prefill_flops": {**attrs.asdict(self.flops), "total": self.flops.total},
            "ttft_floor_ms": self.ttft_floor * 1e3,
            "fraction_of_ceiling": {name: self.ttft_floor / t for name, t in ttfts.items()},
        }
