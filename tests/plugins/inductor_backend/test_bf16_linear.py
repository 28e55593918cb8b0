"""The bf16 panel linear (``plugins/inductor_backend/bf16_linear.cpp``): the panel layout, the
kernel against float64 linears (row counts around its 8-row tiles, a last panel narrower than
32, biases), the switch, and compiled graphs calling it on the weights in panels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nxdplug import InferenceConfig, NeuronConfig
from nxdplug.config.fused_spec import FusedSpecNeuronConfig
from nxdplug.errors import NxdPlugError
from nxdplug.plugins.inductor_backend import backend as backend_module
from nxdplug.plugins.inductor_backend import bf16_linear
from nxdplug.plugins.inductor_backend.backend import InductorBackend
from nxdplug.plugins.inductor_backend.bf16_linear import PANEL, SWITCH, to_panels
from tests.fresh_process import needs_avx512_bf16


def test_panels_hold_32_outputs_with_input_pairs_outermost() -> None:
    out_features, in_features = 2 * PANEL + 5, 6
    weight = torch.arange(out_features * in_features).reshape(out_features, in_features)
    stored = to_panels(weight)  # int64: every value exact
    assert stored.shape == (out_features * in_features,)
    for row in range(out_features):
        panel, feature = divmod(row, PANEL)
        width = min(PANEL, out_features - panel * PANEL)
        for column in range(in_features):
            pair, half = divmod(column, 2)
            position = panel * PANEL * in_features + (pair * width + feature) * 2 + half
            assert stored[position] == weight[row, column]


@pytest.fixture(scope="module")
def kernel():
    assert bf16_linear.panels_in_use(), "the bf16 panel kernel did not build (see the warning)"
    return bf16_linear.bf16_linear_op()


@needs_avx512_bf16
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 70])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 96), (45, 2), (7, 1030)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_multiplies_like_linear(kernel, rows, out_features, in_features, with_bias):
    generator = torch.Generator().manual_seed(rows * out_features)
    x = torch.randn(2, rows, in_features, generator=generator).bfloat16()
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16() if with_bias else None
    out = kernel(x, to_panels(weight), bias)
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert out.dtype == torch.bfloat16 and out.shape == (2, rows, out_features)
    # float32 sums rounded once to bf16 (8 significant bits); a wrong panel or pair is O(1)
    torch.testing.assert_close(out.double(), exact, rtol=2**-7, atol=2**-7 * exact.abs().max())


def config(dtype: str = "bfloat16", draft_dtype: str | None = None, **options) -> InferenceConfig:
    target = InferenceConfig(NeuronConfig(torch_dtype=dtype, **options))
    if draft_dtype is not None:
        draft = InferenceConfig(NeuronConfig(torch_dtype=draft_dtype))
        target.fused_spec_config = FusedSpecNeuronConfig(nn.Linear, draft_config=draft)
    return target


def test_switch_values(monkeypatch) -> None:
    """The backend's versions say which layout bf16 weights take; they are part of a compiled
    folder's hash, so a folder compiled the other way is refused naming them (core's check,
    tested with versions.kv_cache in test_decode_attention)."""
    monkeypatch.setenv(SWITCH, "onednn")
    assert not bf16_linear.panels_in_use()
    assert InductorBackend().versions(config())["linear_weights"] == "onednn-linear-3"
    monkeypatch.setenv(SWITCH, "fast")
    with pytest.raises(NxdPlugError, match=r"NXDPLUG_BF16_LINEAR='fast': expected 'panels'"):
        bf16_linear.panels_in_use()


class Projections(nn.Module):
    """``forward(weights, caches, x)``: Q/K/V-like projections of x (stacked into one GEMM),
    a tied weight read otherwise (stays plain), and a projection with a bias."""

    def forward(self, weights, caches, x):
        q, k, tied, out, bias = weights
        h = F.linear(x, q) * F.linear(x, k)
        return F.linear(h, out, bias) + tied.sum()


@pytest.mark.parametrize(
    ("model", "panels"),
    [
        (config(), True),
        (config("float32"), False),  # every weight cast to float32: no panels
        (config("float32", cast_type="as-declared"), True),  # a checkpoint's bf16 weights kept
        (config("float32", draft_dtype="bfloat16"), True),  # a fused bf16 draft
    ],
)
def test_panels_are_in_the_hash_of_models_that_may_have_bf16_weights(
    monkeypatch, model, panels
) -> None:
    """So that a float32 folder compiled where panels are used loads where they are not."""
    monkeypatch.setattr(bf16_linear, "panels_in_use", lambda: True)
    monkeypatch.setattr(backend_module, "panels_in_use", lambda: True)
    linear_weights = InductorBackend().versions(model)["linear_weights"]
    assert linear_weights.startswith("bf16-panels-1") is panels
    assert linear_weights.endswith("onednn-linear-3")


@needs_avx512_bf16
def test_compiled_bf16_graph_multiplies_weights_in_panels(kernel, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(SWITCH, "panels")
    generator = torch.Generator().manual_seed(3)
    shapes = [(40, 64), (40, 64), (40, 64), (72, 40), (72,)]
    weights = [(torch.randn(s, generator=generator) / 4).bfloat16() for s in shapes]
    x = torch.randn(3, 5, 64, generator=generator).bfloat16()
    backend = InductorBackend()
    assert backend.versions(config())["linear_weights"].startswith("bf16-panels-1")
    backend.compile_graph(
        Projections(), (weights, [], x), tmp_path / "g.pt2", debug=False, compiler_args=None
    )
    graph = backend.load_graph(tmp_path / "g.pt2", weights_in_graph=False)
    loaded = list(weights)
    backend.form_graph_weights(loaded)
    assert torch.equal(loaded[0], to_panels(torch.cat(weights[:2])))  # q and k stacked
    assert torch.equal(loaded[3], to_panels(weights[3]))
    assert loaded[2] is weights[2] and loaded[4] is weights[4]
    with torch.profiler.profile() as profile:
        out = graph(loaded, [], x)
    called = [event.name for event in profile.events()]
    assert called.count("nxdplug_bf16_linear::linear") == 2
    assert "nxdplug::prepacked_linear" not in called
    exact = Projections()([w.double() for w in weights], [], x.double())
    assert (out.double() - exact).abs().max() <= 2**-6 * exact.abs().max()
