"""Linear weights prepacked once for oneDNN, shared by every graph of a model.

oneDNN multiplies by a weight reordered into its blocked layout two to four times faster than by
the plain ``[out, in]`` matrix when decoding a few rows (a GEMV reads the weight at close to the
memory bandwidth only in that layout), and 1.2-1.3x faster for prompts. Inductor gets that layout
only by freezing, which folds one prepacked copy of every weight into each graph. Here the
weights stay graph inputs: each ``aten.linear`` whose weight is a weight input becomes
``nxdplug::prepacked_linear``, which takes the weight in either layout, and the loaded model
holds one prepacked tensor per such weight in place of the plain one.

The packages say which weight inputs they multiply that way (AOTInductor metadata), so a model
prepacks exactly the weights no graph reads in another way.

In eager runs the op is a Python function. A compiled graph must not call back into Python for
every projection (about 10 us a call, measured: as much as a 512 x 512 GEMV itself), so inductor
lowers the op to oneDNN's linear (``mkldnn::_linear_pointwise``, through its AOTInductor C shim),
the call inductor makes for frozen weights; that call takes a plain weight as well.

On a CPU with AVX512-BF16, bf16 weights are stored in panels instead and the op is lowered to
nxdplug's own kernel (:mod:`bf16_linear`, faster than oneDNN's at every row count measured);
a graph compiled so takes only the panels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from nxdplug.plugin_api import ArtefactError
from nxdplug.plugins.inductor_backend.bf16_linear import takes_panels, to_panels
from nxdplug.plugins.inductor_backend.fused_linears import (
    FUSED_METADATA,
    STACKED_METADATA,
    StackableOp,
    fuse_linears_sharing_input,
    groups_text,
    parse_groups,
    prepacked_linear_op,
)

PREPACKED_METADATA = "nxdplug.prepacked_weights"
OTHER_USE_METADATA = "nxdplug.weights_read_otherwise"
PACKABLE_DTYPES = (torch.bfloat16, torch.float32)
# The row count oneDNN chooses the blocked layout for: measured on this project's CPU, the layout
# chosen for 128 rows is as fast as the one for 1 row when decoding (bf16) or faster (float32:
# 1.0 against 1.6 ms for a 32000x768 GEMV), and fastest for prompts.
PACKING_ROWS = 128


@torch.library.custom_op("nxdplug::prepacked_linear", mutates_args=())
def prepacked_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ weight.T + bias`` for a weight prepacked by :func:`prepack` or a plain one."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


@prepacked_linear.register_fake
def _prepacked_linear_shape(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def prepacking_available() -> bool:
    """Whether this torch can reorder weights for oneDNN's CPU GEMMs."""
    return torch.backends.mkldnn.is_available()


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` reordered into oneDNN's blocked layout (an opaque ``torch._mkldnn`` tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACKING_ROWS)


def _weight_inputs(program: ExportedProgram, weight_count: int) -> list[torch.fx.Node]:
    """The placeholders of the graph's first ``weight_count`` user inputs: the weights, since
    every graph function takes ``(weights, caches, *inputs)``."""
    user_inputs = {
        spec.arg.name
        for spec in program.graph_signature.input_specs
        if spec.kind == InputKind.USER_INPUT
    }
    placeholders = [
        node
        for node in program.graph.nodes
        if node.op == "placeholder" and node.name in user_inputs
    ]
    return placeholders[:weight_count]


def _is_linear_weight_use(user: torch.fx.Node, weight: torch.fx.Node) -> bool:
    return (
        user.target is torch.ops.aten.linear.default
        and len(user.args) >= 2
        and user.args[1] is weight
        and user.args[0] is not weight
        and all(arg is not weight for arg in user.args[2:])
    )


@functools.cache
def lower_prepacked_linear() -> None:
    """Make inductor compile ``nxdplug::prepacked_linear`` into a direct oneDNN linear call, or
    a call of the bf16 panel kernel for a weight that takes panels here.

    Inductor's own lowering of ``mkldnn::_linear_pointwise`` accepts only constant (frozen)
    weights, so the op gets a lowering of its own that builds the same IR node for a weight
    input. These are inductor internals (``mkldnn_ir``): pinned by the torch version the
    project tests with, and by ``tests/plugins/inductor_backend/test_prepacked_linear.py``.
    """
    from torch._inductor import ir, mkldnn_ir
    from torch._inductor.lowering import fallback_handler, register_lowering, view

    @register_lowering(torch.ops.nxdplug.prepacked_linear.default)
    def _linear(x: ir.TensorBox, weight: ir.TensorBox, bias: ir.TensorBox | None):
        if takes_panels(weight.get_dtype(), weight.get_size()):
            panel_linear = torch.ops.nxdplug_bf16_linear.linear.default
            return fallback_handler(panel_linear, add_to_fallback_set=False)(x, weight, bias)
        *rows, features = x.get_size()
        flat = view(x, [-1, features])
        out = ir.TensorBox.create(mkldnn_ir.LinearUnary.create(flat, weight, bias, "none", [], ""))
        return view(out, [*rows, weight.get_size()[0]])


def use_prepacked_linears(
    program: ExportedProgram, weight_count: int, stackable: Iterable[StackableOp] = ()
) -> dict[str, str]:
    """Rewrite ``program`` so that every linear by a 2-D bf16/float32 weight input that nothing
    else reads takes it prepacked, and linears of one input by such weights are one, as are
    calls of each ``stackable`` operator of one input (see :mod:`fused_linears`); the
    AOTInductor metadata saying which weights it takes prepacked, which stacked, and which it
    reads in another way (those stay plain in every graph)."""
    lower_prepacked_linear()
    weights = _weight_inputs(program, weight_count)
    prepacked, read_otherwise = [], []
    for index, weight in enumerate(weights):
        users = list(weight.users)
        if not users:
            continue
        value = weight.meta.get("val")
        packable = (
            isinstance(value, torch.Tensor)
            and value.dim() == 2
            and value.dtype in PACKABLE_DTYPES
            and all(_is_linear_weight_use(user, weight) for user in users)
        )
        if not packable:
            read_otherwise.append(index)
            continue
        for user in users:
            x, _, *rest = user.args
            user.target = torch.ops.nxdplug.prepacked_linear.default
            user.args = (x, weight, rest[0] if rest else None)
        prepacked.append(index)
    groups = fuse_linears_sharing_input(program, weights, prepacked_linear_op())
    operands = [g for spec in stackable for g in fuse_linears_sharing_input(program, weights, spec)]
    stacked = {i for group in (*groups, *operands) for indices in group for i in indices}
    program.graph.lint()
    program.graph_module.recompile()
    return {
        PREPACKED_METADATA: _indices_text(i for i in prepacked if i not in stacked),
        OTHER_USE_METADATA: _indices_text(i for i in read_otherwise if i not in stacked),
        FUSED_METADATA: groups_text(groups),
        STACKED_METADATA: groups_text(operands),
    }


def _indices_text(indices: Iterable[int]) -> str:
    return ",".join(str(i) for i in indices)


def _indices(text: str | None) -> set[int]:
    return {int(i) for i in (text or "").split(",") if i}


def _prepacked_if_possible(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in panels where bf16 weights take them here (see :mod:`bf16_linear`), else
    prepacked when it is a bf16/float32 matrix and this torch has oneDNN."""
    if takes_panels(weight.dtype, weight.shape):
        return to_panels(weight)
    if weight.dtype in PACKABLE_DTYPES and weight.dim() == 2 and prepacking_available():
        return prepack(weight)
    return weight


class PrepackedWeights:
    """Which weights of a model the loaded graphs take prepacked (those some graph multiplies
    as a linear weight and none reads otherwise), which stacked for one linear (every graph
    reading them multiplies them together), and which stacked as another operator's operands
    (an int8 weight and its scales, ...)."""

    def __init__(self) -> None:
        self.linear: set[int] = set()
        self.other: set[int] = set()
        self.groups: set[tuple[tuple[int, ...], ...]] = set()
        self.operands: set[tuple[tuple[int, ...], ...]] = set()

    def add_graph(self, metadata: dict[str, str], source: str) -> None:
        """Take in the metadata of one loaded package, ``source``."""
        self.linear |= _indices(metadata.get(PREPACKED_METADATA))
        self.other |= _indices(metadata.get(OTHER_USE_METADATA))
        self.groups |= set(parse_groups(metadata.get(FUSED_METADATA)))
        self.operands |= set(parse_groups(metadata.get(STACKED_METADATA)))
        stacked = [i for group in (*self.groups, *self.operands) for s in group for i in s]
        if len(stacked) != len(set(stacked)) or set(stacked) & (self.linear | self.other):
            raise ArtefactError(
                f"{source} multiplies weights together that other graphs of the model read "
                "apart; compile the model again (or with --compiler-args prepack_weights=false)"
            )

    def form(self, index: int, weight: torch.Tensor) -> torch.Tensor:
        """Weight ``index``, prepacked if the graphs take it so and this torch can."""
        if index in self.linear and index not in self.other:
            return _prepacked_if_possible(weight)
        return weight

    def form_all(self, weights: list[torch.Tensor]) -> set[int]:
        """Put ``weights`` in the form the graphs take them, in place, one at a time (a
        plain weight is freed as its replacement is made); returns the indices replaced."""
        replaced = set()
        for group in sorted(self.groups):
            if len(group) == 1:  # weights, then biases, in one list (folders of before)
                (indices,) = group
                group = tuple(
                    s
                    for s in (
                        tuple(i for i in indices if weights[i].dim() == 2),
                        tuple(i for i in indices if weights[i].dim() == 1),
                    )
                    if s
                )
            _stack_in_place(weights, group, _prepacked_if_possible)
            replaced |= {i for indices in group for i in indices}
        for group in sorted(self.operands):
            _stack_in_place(weights, group, lambda stacked: stacked)
            replaced |= {i for indices in group for i in indices}
        for index, weight in enumerate(weights):
            if index not in replaced:
                weights[index] = self.form(index, weight)
                if weights[index] is not weight:
                    replaced.add(index)
        return replaced


def _stack_in_place(
    weights: list[torch.Tensor],
    group: tuple[tuple[int, ...], ...],
    form: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Each list of ``group`` stacked along the rows in its first index's place (the first
    list, the weights, put in ``form``); the other places emptied (no graph reads them)."""
    for position, indices in enumerate(group):
        stacked = torch.cat([weights[i] for i in indices])
        for i in indices:
            weights[i] = weights[i].new_empty(0)
        weights[indices[0]] = form(stacked) if position == 0 else stacked
