"""The inductor backend's prepacked linear weights: the op, the graph rewrite, the loaded form."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nxdplug.plugins.inductor_backend import prepacked_linear as packing
from nxdplug.plugins.inductor_backend.backend import InductorBackend
from nxdplug.plugins.inductor_backend.bf16_linear import SWITCH
from nxdplug.plugins.inductor_backend.fused_linears import StackableOp

pytestmark = pytest.mark.skipif(
    not packing.prepacking_available(), reason="this torch has no oneDNN"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_op_multiplies_plain_and_prepacked_weights_as_linear(dtype, rows) -> None:
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, 96, generator=generator).to(dtype)
    weight = torch.randn(80, 96, generator=generator).to(dtype)
    bias = torch.randn(80, generator=generator).to(dtype)
    expected = F.linear(x.double(), weight.double(), bias.double())
    packed = packing.prepack(weight)
    assert packed.is_mkldnn and not weight.is_mkldnn
    for form in (weight, packed):
        out = packing.prepacked_linear(x, form, bias)
        assert out.dtype == dtype and out.shape == (2, rows, 80)
        # float32: both accumulate in float32; bf16: one rounding of the float32 sum
        tolerance = 1e-4 if dtype == torch.float32 else 2**-7
        assert torch.allclose(out.double(), expected, rtol=tolerance, atol=tolerance * 10)
    assert torch.equal(packing.prepacked_linear(x, weight, None), F.linear(x, weight))


class TiedAndPlain(nn.Module):
    """Weights: 0 a projection, 1 an embedding table also used as the output projection, 2 a
    bias, 3 unused, 4 a projection by a 1-row weight used twice."""

    def forward(self, weights, ids):
        projection, table, bias, _, gate = weights
        h = F.embedding(ids, table)
        h = F.linear(h, projection, bias)
        h = F.linear(h, gate) * F.linear(h, gate)
        return F.linear(h.expand(-1, -1, table.shape[1]), table)


def tied_and_plain_weights() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = [(16, 16), (40, 16), (16,), (3, 3), (1, 16)]
    return [torch.randn(s, generator=generator) for s in shapes]


def test_rewrite_prepacks_only_weights_read_by_linears_alone() -> None:
    weights, ids = tied_and_plain_weights(), torch.tensor([[1, 7, 3]])
    program = torch.export.export(TiedAndPlain(), (weights, ids), strict=False)
    metadata = packing.use_prepacked_linears(program, len(weights))
    assert metadata == {
        packing.PREPACKED_METADATA: "0,4",
        packing.OTHER_USE_METADATA: "1,2",
        packing.FUSED_METADATA: "",  # no two linears of one input
        packing.STACKED_METADATA: "",
    }
    rewritten = [
        node
        for node in program.graph.nodes
        if node.target is torch.ops.nxdplug.prepacked_linear.default
    ]
    assert len(rewritten) == 3  # projection, and gate's two uses; the tied table stays aten
    linears = [n for n in program.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert len(linears) == 1
    assert torch.equal(program.module()(weights, ids), TiedAndPlain()(weights, ids))


def _compiled(tmp_path, compiler_args: str | None):
    backend = InductorBackend()
    weights, ids = tied_and_plain_weights(), torch.tensor([[1, 7, 3]])
    function = TiedAndPlainGraph()
    backend.compile_graph(
        function,
        (weights, [], ids),
        tmp_path / "graph.pt2",
        debug=False,
        compiler_args=compiler_args,
    )
    graph = backend.load_graph(tmp_path / "graph.pt2", weights_in_graph=False)
    return backend, graph, weights, ids


def formed(backend: InductorBackend, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """``weights`` in the form the backend's loaded graphs take them (a new list)."""
    weights = list(weights)
    backend.form_graph_weights(weights)
    return weights


class TiedAndPlainGraph(nn.Module):
    """TiedAndPlain as a graph function: ``forward(weights, caches, *inputs)``."""

    def forward(self, weights, caches, ids):
        return TiedAndPlain()(weights, ids)


def test_loaded_graph_takes_the_prepacked_weights_it_names(tmp_path) -> None:
    backend, graph, weights, ids = _compiled(tmp_path, None)
    loaded = formed(backend, weights)
    assert [w.is_mkldnn for w in loaded] == [True, False, False, False, True]
    assert all(loaded[i] is weights[i] for i in (1, 2, 3))
    expected = TiedAndPlain()(weights, ids)
    assert torch.allclose(graph(loaded, [], ids), expected, rtol=1e-5, atol=1e-5)
    # the same graph on the plain weights (a weight some other graph reads otherwise stays so)
    assert torch.allclose(graph(weights, [], ids), expected, rtol=1e-5, atol=1e-5)


def test_compiled_graph_calls_onednn_without_calling_python_back(tmp_path) -> None:
    """The op is lowered to oneDNN's linear: the Python function runs in eager runs only."""
    backend, graph, weights, ids = _compiled(tmp_path, None)
    loaded = formed(backend, weights)
    with torch.profiler.profile() as profile:
        out = graph(loaded, [], ids)
    called = {event.name for event in profile.events()}
    assert "nxdplug::prepacked_linear" not in called
    with torch.profiler.profile() as profile:
        packing.prepacked_linear(ids.float() @ torch.ones(3, 5), torch.ones(2, 5), None)
    assert "nxdplug::prepacked_linear" in {event.name for event in profile.events()}
    assert torch.allclose(out, TiedAndPlain()(weights, ids), rtol=1e-5, atol=1e-5)


def test_prepack_weights_false_keeps_plain_weights(tmp_path) -> None:
    backend, graph, weights, ids = _compiled(tmp_path, "prepack_weights=false")
    assert all(a is b for a, b in zip(formed(backend, weights), weights, strict=True))
    assert torch.equal(graph(weights, [], ids), TiedAndPlain()(weights, ids))


class SharedInputs(nn.Module):
    """Weights: 0-2 Q/K/V-like projections of one input with biases 3-5; 6, 7 gate and up of
    two other inputs (no bias; as a loop unrolled in the graph); 8 a projection of one of those
    also read otherwise (its norm)."""

    def forward(self, weights, caches, x):
        q, k, v, bq, bk, bv, gate, up, shared = weights
        h = F.linear(x, q, bq) + F.linear(x, k, bk).sum(-1, keepdim=True) * F.linear(x, v, bv)
        out = 0
        for step in range(2):
            h = h * (step + 1)
            out = out + F.silu(F.linear(h, gate)) * F.linear(h, up)
        return out + F.linear(h, shared).sum(-1, keepdim=True) * shared.norm()


def shared_input_weights(dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    shapes = [(16, 16), (4, 16), (16, 16), (16,), (4,), (16,), (24, 16), (24, 16), (8, 16)]
    return [(torch.randn(s, generator=generator) / 4).to(dtype) for s in shapes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linears_of_one_input_are_one_gemm_by_stacked_weights(tmp_path, dtype, monkeypatch):
    monkeypatch.setenv(SWITCH, "onednn")  # bf16 weights in panels: test_bf16_linear.py
    weights = shared_input_weights(dtype)
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
    program = torch.export.export(SharedInputs(), (weights, [], x), strict=False)
    metadata = packing.use_prepacked_linears(program, len(weights))
    assert metadata[packing.FUSED_METADATA] == "0+1+2|3+4+5;6+7"
    assert metadata[packing.OTHER_USE_METADATA] == "8"
    calls = [
        n for n in program.graph.nodes if n.target is torch.ops.nxdplug.prepacked_linear.default
    ]
    assert [tuple(c.args[1].meta["val"].shape) for c in calls] == [(36, 16), (48, 16), (48, 16)]

    backend = InductorBackend()
    backend.compile_graph(
        SharedInputs(), (weights, [], x), tmp_path / "g.pt2", debug=False, compiler_args=None
    )
    graph = backend.load_graph(tmp_path / "g.pt2", weights_in_graph=False)
    loaded = formed(backend, weights)
    assert loaded[0].is_mkldnn and loaded[6].is_mkldnn
    assert torch.equal(loaded[3], torch.cat(weights[3:6]))
    assert [loaded[i].numel() for i in (1, 2, 4, 5, 7)] == [0] * 5  # read by no graph
    assert loaded[8] is weights[8]
    exact = SharedInputs()([w.double() for w in weights], [], x.double())
    error = (graph(loaded, [], x).double() - exact).abs().max()
    if dtype == torch.float32:
        assert error < 1e-4
    else:  # a few roundings of bf16 (8 bits) at the output's scale; a misplaced slice is O(1)
        assert error <= 2**-6 * exact.abs().max()


def test_folders_of_before_stack_their_weights_and_biases_as_then() -> None:
    """Metadata written before groups listed their row arguments apart ("0+1+2+3+4+5":
    weights, then biases, in one list) forms the same weights."""
    weights = shared_input_weights(torch.float32)
    formed = {}
    for text in ("0+1+2+3+4+5;6+7", "0+1+2|3+4+5;6+7"):
        packed = packing.PrepackedWeights()
        packed.add_graph({packing.FUSED_METADATA: text, packing.OTHER_USE_METADATA: "8"}, "a")
        formed[text] = list(weights)
        packed.form_all(formed[text])
    old, new = formed.values()
    assert torch.equal(old[3], torch.cat(weights[3:6])) and torch.equal(old[3], new[3])
    assert [w.numel() for w in old] == [w.numel() for w in new]


def test_graphs_that_disagree_on_stacking_are_refused() -> None:
    weights = packing.PrepackedWeights()
    weights.add_graph({packing.FUSED_METADATA: "0+1", packing.PREPACKED_METADATA: "2"}, "a.pt2")
    with pytest.raises(packing.ArtefactError, match=r"b\.pt2 multiplies weights together"):
        weights.add_graph({packing.PREPACKED_METADATA: "1"}, "b.pt2")


@torch.library.custom_op("nxdplug_tests::scaled_matmul", mutates_args=())
def scaled_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, shift: int
) -> torch.Tensor:
    """A plugin's linear-like operator: ``(x @ weight.T) * scale`` (per row or one), plus
    ``shift``, which calls must agree on to be stacked."""
    return (x.reshape(-1, x.shape[-1]) @ weight.T * scale + shift).reshape(*x.shape[:-1], -1)


@scaled_matmul.register_fake
def _scaled_matmul_shape(x, weight, scale, shift):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


SCALED = StackableOp(torch.ops.nxdplug_tests.scaled_matmul.default, 0, (1, 2), row_multiple=4)


class ScaledProjections(nn.Module):
    """Weights 0-2 (scales 3-5) Q/K/V-like projections of one input; 6, 7 (scales 8, 9) two
    of another with different shifts; 10, 11 (scales 12, 13) two of a third whose rows are
    not a multiple of 4; 14, 15 (scales 16, 17): per-tensor scales; 18 (scale 19) also
    multiplied by a plain linear."""

    def forward(self, weights, caches, x):
        w = weights
        op = torch.ops.nxdplug_tests.scaled_matmul
        h = op(x, w[0], w[3], 0) + op(x, w[1], w[4], 0).sum(-1, keepdim=True) * op(x, w[2], w[5], 0)
        g = op(h, w[6], w[8], 0) * op(h, w[7], w[9], 1)
        t = op(g, w[10], w[12], 0) + op(g, w[11], w[13], 0)
        u = op(t, w[14], w[16], 0) * op(t, w[15], w[17], 0)
        return op(u, w[18], w[19], 0) + F.linear(u, w[18])


def scaled_weights() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    shapes = {0: (8, 16), 1: (4, 16), 2: (8, 16), 6: (8, 8), 7: (8, 8), 10: (6, 8), 11: (6, 8)}
    shapes |= {14: (8, 6), 15: (8, 6), 18: (8, 8)}
    scale_of = {0: 3, 1: 4, 2: 5, 6: 8, 7: 9, 10: 12, 11: 13, 14: 16, 15: 17, 18: 19}
    weights: list[torch.Tensor] = [torch.empty(0)] * 20
    for index, shape in shapes.items():
        weights[index] = torch.randn(shape, generator=generator) / 3
        rows = 1 if index in (14, 15) else shape[0]  # per-tensor scales
        weights[scale_of[index]] = torch.rand(rows, generator=generator) + 0.5
    return weights


def test_a_plugins_linear_operator_stacks_with_its_scales(tmp_path) -> None:
    """Calls of a declared operator on one input stack their weights and per-row scales,
    placed in the first member's places, and give the same output; calls with other arguments,
    rows short of the operator's multiple, per-tensor scales or a weight read otherwise do not
    stack."""
    weights = scaled_weights()
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(4))
    expected = ScaledProjections()(weights, [], x)
    program = torch.export.export(ScaledProjections(), (weights, [], x), strict=False)
    metadata = packing.use_prepacked_linears(program, len(weights), [SCALED])
    assert metadata[packing.STACKED_METADATA] == "0+1+2|3+4+5"
    calls = [n for n in program.graph.nodes if n.target is SCALED.op]
    assert len(calls) == 8  # Q/K/V as one, the seven others apart

    stacked = packing.PrepackedWeights()
    stacked.add_graph(metadata, "g.pt2")
    formed = list(weights)
    stacked.form_all(formed)
    assert torch.equal(formed[0], torch.cat(weights[0:3]))
    assert torch.equal(formed[3], torch.cat(weights[3:6]))
    assert [formed[i].numel() for i in (1, 2, 4, 5)] == [0] * 4
    (out,) = program.graph_module(*formed, x)  # the rewritten graph, on the flat inputs
    # one GEMM in place of three sums in another order; a misplaced slice would be O(1)
    scale = expected.abs().max().item()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6 * scale)
