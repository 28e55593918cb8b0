"""Projections of one input fused into one GEMM: Q, K and V; an MLP's gate and up.

Decoding multiplies one row by each weight, and oneDNN's GEMV has a fixed cost per call and
reads a narrow weight (a 256-row K or V projection) well below the memory bandwidth. After the
prepacked-linear rewrite, weights that nothing but linears read, and that multiply the same
inputs, are stacked along their output rows: each input gets one linear by the stacked weight,
followed by a slice per projection. The first weight's input takes the stacked weight (its
declared shape widened to match); the other weights' inputs are no longer read. The package
lists each group (AOTInductor metadata), and the loaded model stacks those weights once, in
the first one's place.

Measured on a graph of 12 Llama-120m layers' seven projections at batch 1 (bf16, prepacked):
2.43 ms a step with one call per projection, 1.42 ms with Q/K/V/gate/up stacked.

Other plugins' operators that multiply as a linear does (the quantization plugin's int8 and int4
matmuls) are stacked alike when a ``nxdplug_stackable_linears`` record describes them
(:class:`~nxdplug.plugins.inductor_backend.records.StackableLinear`): their weights, scales and
zero points are stacked along their rows, each set in its first member's place, and their other
arguments must agree.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

from nxdplug.plugin_api import get_registry

FUSED_METADATA = "nxdplug.fused_linear_weights"
STACKED_METADATA = "nxdplug.stacked_operands"

# Ops that give a view of their input with the same values: linears of two such views of one
# tensor, taken alike, read the same input.
VIEW_OPS = {
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.flatten.using_ints,
}


@dataclass(frozen=True)
class StackableOp:
    """An operator that multiplies ``input_argument`` as a linear does: its output's last
    dimension is one value per row of the tensors at ``row_arguments`` (the weight first; then
    a bias, scales, zero points, each a weight input or None), whose row counts are multiples
    of ``row_multiple`` (a layout in tiles of rows stacks whole tiles)."""

    op: torch._ops.OpOverload
    input_argument: int
    row_arguments: tuple[int, ...]
    row_multiple: int = 1


def prepacked_linear_op() -> StackableOp:
    """``nxdplug::prepacked_linear(x, weight, bias)``."""
    return StackableOp(torch.ops.nxdplug.prepacked_linear.default, 0, (1, 2))


def declared_stackable_ops() -> list[StackableOp]:
    """The operators plugins declare stackable (``nxdplug_stackable_linears`` records) that
    are registered in this process (a graph calls no other)."""
    ops = []
    for record in get_registry().records("stackable_linears"):
        namespace, name = record.operator.split("::")
        try:
            op = getattr(getattr(torch.ops, namespace), name).default
        except (AttributeError, RuntimeError):  # not registered: no graph calls it
            continue
        arguments = (record.input_argument, record.row_arguments, record.row_multiple)
        ops.append(StackableOp(op, *arguments))
    return ops


# Conversions that are the identity when the dtype is already the one asked for (``x.float()``
# of a float32 x: the traced code goes on with the conversion's output in place of x).
CONVERSION_OPS = {
    torch.ops.aten.to.dtype,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.alias.default,
}


def _is_identity(node: torch.fx.Node) -> bool:
    if node.target not in CONVERSION_OPS or not isinstance(node.args[0], torch.fx.Node):
        return False
    before, after = node.args[0].meta.get("val"), node.meta.get("val")
    return before is not None and after is not None and before.dtype == after.dtype


def _input_key(node: torch.fx.Node) -> tuple[torch.fx.Node, str]:
    """What a linear reads: the tensor under any views and identity conversions, and the
    views taken."""
    views = []
    while node.op == "call_function" and (node.target in VIEW_OPS or _is_identity(node)):
        if node.target in VIEW_OPS:
            views.append(f"{node.target}{node.args[1:]}")
        node = node.args[0]
    return node, ";".join(views)


def _argument(call: torch.fx.Node, index: int) -> object:
    return call.args[index] if index < len(call.args) else None


def _linears_of(weight: torch.fx.Node, spec: StackableOp) -> list[torch.fx.Node] | None:
    """The calls of ``spec``'s operator by ``weight``, if nothing else reads it, each reads it
    as its weight alone and each reads another input."""
    linears = list(weight.users)
    weight_argument = spec.row_arguments[0]
    if not linears or any(
        u.target is not spec.op
        or _argument(u, weight_argument) is not weight
        or sum(a is weight for a in u.args) != 1
        for u in linears
    ):
        return None
    inputs = [_input_key(linear.args[spec.input_argument]) for linear in linears]
    return linears if len(set(inputs)) == len(inputs) else None


def _operands_of(
    linears: list[torch.fx.Node], spec: StackableOp, weights: Container[torch.fx.Node]
) -> tuple[torch.fx.Node | None, ...]:
    """The one value of each further row argument (bias, scales, ...) that all of a weight's
    ``linears`` take: None, or a weight input they alone read. LookupError otherwise."""
    operands = []
    for index in spec.row_arguments[1:]:
        values = {_argument(linear, index) for linear in linears}
        if len(values) != 1:
            raise LookupError("different operands")
        (value,) = values
        if value is not None and not (value in weights and set(value.users) == set(linears)):
            raise LookupError("an operand read elsewhere")
        operands.append(value)
    return tuple(operands)


def _rows_stack(parts: list[torch.fx.Node], spec: StackableOp) -> bool:
    """Whether each of ``parts`` holds whole tiles of the operator's layout, so that stacking
    them along their rows keeps it."""
    fakes = [part.meta["val"] for part in parts]
    return all(fake.shape[0] % spec.row_multiple == 0 for fake in fakes)


def fuse_linears_sharing_input(
    program: ExportedProgram, weights: list[torch.fx.Node], spec: StackableOp
) -> list[list[list[int]]]:
    """Rewrite ``program`` so that calls of ``spec``'s operator on one input by weights that
    only those calls read are one call; returns each group's row arguments' weight indices (a
    list per row argument: the weights, then e.g. the biases), in the order their outputs are
    stacked. ``weights``: the graph's weight inputs, by index.

    Weights are stacked when they multiply the same inputs (one call each per input: a loop
    unrolled in the graph multiplies its weights once per iteration), take the same further
    arguments, have their other row arguments alike (each its own, or None for all) with one
    row per output, and have one dtype. They stack in index order, so every graph of a model
    that stacks them stacks them alike."""
    index_of = {node: i for i, node in enumerate(weights)}
    candidates: dict[tuple, list[tuple[int, tuple[torch.fx.Node | None, ...]]]] = {}
    taken = {*spec.row_arguments, spec.input_argument}
    for index, weight in enumerate(weights):
        linears = _linears_of(weight, spec)
        if linears is None:
            continue
        try:
            operands = _operands_of(linears, spec, index_of)
        except LookupError:
            continue
        present = [weight, *(o for o in operands if o is not None)]
        rows = weight.meta["val"].shape[0]
        if any(o.meta["val"].shape[0] != rows for o in present) or not _rows_stack(present, spec):
            continue
        others = {
            tuple(a for i, a in enumerate(linear.args) if i not in taken) for linear in linears
        }
        if len(others) != 1:
            continue
        inputs = frozenset(_input_key(linear.args[spec.input_argument]) for linear in linears)
        layout = tuple(
            None if o is None else (o.meta["val"].dtype, tuple(o.meta["val"].shape[1:]))
            for o in (weight, *operands)
        )
        signature = (inputs, *others, layout)
        candidates.setdefault(signature, []).append((index, operands))

    position = {node: i for i, node in enumerate(program.graph.nodes)}
    groups = []
    for members in candidates.values():
        if len(members) < 2:
            continue
        parts = [weights[i] for i, _ in members]
        sizes = [part.meta["val"].shape[0] for part in parts]
        by_input: dict[tuple, list[torch.fx.Node]] = {}
        for part in parts:
            for linear in part.users:
                by_input.setdefault(_input_key(linear.args[spec.input_argument]), []).append(linear)
        for linears in by_input.values():
            _stack(linears, sizes, position, spec)
        first_operands = [parts[0], *members[0][1]]
        for node in first_operands:
            if node is not None:
                _widen(node, sum(sizes))
        group = [[i for i, _ in members]]
        for k, first in enumerate(members[0][1]):
            if first is not None:
                group.append([index_of[operands[k]] for _, operands in members])
        groups.append(group)
    return groups


def _stack(
    linears: list[torch.fx.Node], sizes: list[int], position: dict, spec: StackableOp
) -> None:
    """One call by the stacked operands (the first call's, widened by the caller) in place of
    ``linears``, each replaced by its slice of the output."""
    graph = linears[0].graph
    first = min(linears, key=position.__getitem__)
    x = first.args[spec.input_argument]
    arguments = list(linears[0].args)
    arguments[spec.input_argument] = x
    with graph.inserting_before(first):
        stacked = graph.call_function(spec.op, tuple(arguments))
    out = linears[0].meta["val"]
    stacked.meta["val"] = out.new_empty((*out.shape[:-1], sum(sizes)))
    start = 0
    for linear, size in zip(linears, sizes, strict=True):
        with graph.inserting_before(linear):
            part = graph.call_function(
                torch.ops.aten.slice.Tensor, (stacked, -1, start, start + size)
            )
        part.meta["val"] = linear.meta["val"]
        linear.replace_all_uses_with(part)
        graph.erase_node(linear)
        start += size


def _widen(node: torch.fx.Node, rows: int) -> None:
    fake = node.meta["val"]
    node.meta["val"] = fake.new_empty((rows, *fake.shape[1:]))


def groups_text(groups: Iterable[Iterable[Iterable[int]]]) -> str:
    """``[[[0, 1, 2], [3, 4, 5]], [[7, 8]]]`` -> ``"0+1+2|3+4+5;7+8"``."""
    return ";".join(
        "|".join("+".join(str(i) for i in indices) for indices in group) for group in groups
    )


def parse_groups(text: str | None) -> list[tuple[tuple[int, ...], ...]]:
    """The groups of :func:`groups_text`; a group without ``|`` (written before stacked
    operators took several row arguments) is one list of weights, then biases."""
    return [
        tuple(tuple(int(i) for i in indices.split("+")) for indices in group.split("|"))
        for group in (text or "").split(";")
        if group
    ]
