"""Which modules weight quantization touches: one rule, by name, for checkpoints and models.

The quantizer sees checkpoint keys (``model.layers.0.self_attn.q_proj.weight``), the model
transform sees module names (``layers.0.self_attn.q_proj``); deciding both from the name keeps a
checkpoint written here in step with the model built here, whatever the model family.

Quantized by default: the linear projections of attention (``q_proj``, ``k_proj``, ``v_proj``,
fused ``qkv_proj``, ``o_proj``), of the gated MLP (``gate_proj``, ``up_proj``, ``down_proj``)
and ``lm_head``, as NxD Inference does (its default quantizes every linear layer). Embeddings,
norms and biases stay in full precision: they are not matrix products, and are small next to
the projections in all but the tiniest models.
"""

from __future__ import annotations

from collections.abc import Iterable

QUANTIZED_PROJECTIONS = frozenset(
    {"q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    | {"lm_head"}
)
FUSED_PROJECTION = "qkv_proj"
SCALE_SUFFIX = "_scale"
ZERO_POINT_SUFFIX = "_zero_point"  # int4 checkpoints of other tools: W = (Q - zero_point) * scale


def names_module(entry: str, module_name: str) -> bool:
    """Whether a ``modules_to_not_convert`` entry names ``module_name`` or one of its parents.

    Whole dotted components match: ``"layers.0.self_attn"`` names ``layers.0.self_attn.q_proj``
    and the checkpoint's ``model.layers.0.self_attn.q_proj``, never ``layers.10.self_attn``.
    """
    return f".{entry.strip('.')}." in f".{module_name}."


def is_quantized_module(module_name: str, modules_to_not_convert: Iterable[str] | None) -> bool:
    """Whether the module called ``module_name`` holds an 8-bit weight and its scale."""
    if module_name.rpartition(".")[2] not in QUANTIZED_PROJECTIONS:
        return False
    return not any(names_module(entry, module_name) for entry in modules_to_not_convert or ())


def has_row_scales(module_name: str, per_channel: bool) -> bool:
    """Whether the module's scale has one element per output row rather than one in all.

    A fused ``qkv_proj`` always has: its q, k and v parts were quantized apart, with
    different per-tensor scales.
    """
    return per_channel or module_name.rpartition(".")[2] == FUSED_PROJECTION
