"""The record of the inductor backend's own hook (:mod:`.hookspecs`)."""

from __future__ import annotations

import attrs

from nxdplug.plugin_api import PluginRecord


def _operator_name(instance: object, attribute: attrs.Attribute, value: str) -> None:
    namespace, separator, name = value.partition("::") if isinstance(value, str) else ("", "", "")
    if not (separator and namespace.isidentifier() and name.isidentifier()):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must name an operator as "
            f"'namespace::name' (torch.library's form, e.g. 'my_kernels::int8_matmul'); got "
            f"{value!r}"
        )


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be a positive int")


@attrs.frozen(kw_only=True)
class StackableLinear(PluginRecord):
    """A plugin's operator that multiplies an input as a linear does, so that compiled graphs
    may stack the calls of one input (Q, K and V; gate and up) into one call, as they stack
    bf16 linears (:mod:`nxdplug.plugins.inductor_backend.fused_linears`).

    ``operator`` names the operator as ``torch.library`` does (``"namespace::name"``; its
    default overload); a graph can only call it once it is registered, so the backend looks
    only at those registered when it compiles. Its output's last dimension has one value per
    row of the tensors at
    ``row_arguments`` (the weight first; then bias, scales, zero points: each a weight or
    None); their row counts must be multiples of ``row_multiple``. ``input_argument`` is the
    multiplied input. Calls whose other arguments differ are not stacked.
    """

    operator: str = attrs.field(validator=_operator_name)
    input_argument: int = 0
    row_arguments: tuple[int, ...] = attrs.field(converter=tuple)
    row_multiple: int = attrs.field(default=1, validator=_positive)
