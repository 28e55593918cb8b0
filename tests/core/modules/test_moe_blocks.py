"""The MoE building blocks against direct computations written out token by token."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from nxdplug.config import MoENeuronConfig, RoutedExpertsMLPOpsConfig
from nxdplug.config.moe import routed_mlp_problems
from nxdplug.errors import ConfigError
from nxdplug.modules.moe import ExpertMLPs, MoE, RouterTopK, SharedExperts
from nxdplug.modules.moe.grouped_linear import grouped_linear

EXPERTS, TOP_K, HIDDEN, INNER = 8, 2, 16, 24


def experts_config(**overrides) -> RoutedExpertsMLPOpsConfig:
    settings = {
        "num_experts": EXPERTS,
        "hidden_size": HIDDEN,
        "intermediate_size": INNER,
        "top_k": TOP_K,
        "hidden_act": "silu",
        "glu_mlp": True,
    }
    return RoutedExpertsMLPOpsConfig(**(settings | overrides))


def random_experts(config: RoutedExpertsMLPOpsConfig, seed: int = 0, **sharding) -> ExpertMLPs:
    torch.manual_seed(seed)
    experts = ExpertMLPs(config, **sharding)
    for parameter in experts.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return experts


def one_expert(experts: ExpertMLPs, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e``'s MLP on one token, written out from the reference's definitions."""
    c = experts.config
    h = F.linear(x, experts.gate_up_proj[e])
    if experts.gate_up_proj_bias is not None:
        h = h + experts.gate_up_proj_bias[e]
    if c.glu_mlp:
        gate, up = h.chunk(2)
        if c.gate_clamp_lower_limit is not None or c.gate_clamp_upper_limit is not None:
            gate = gate.clamp(c.gate_clamp_lower_limit, c.gate_clamp_upper_limit)
        if c.up_clamp_lower_limit is not None or c.up_clamp_upper_limit is not None:
            up = up.clamp(c.up_clamp_lower_limit, c.up_clamp_upper_limit)
        act = F.silu if c.hidden_act == "silu" else torch.sigmoid
        a = act(c.hidden_act_scaling_factor * gate)
        if c.glu_type == "swiglu":
            a = gate * a
        h = a * (up + c.hidden_act_bias)
    else:
        h = F.silu(h)
    out = F.linear(h, experts.down_proj[e])
    if experts.down_proj_bias is not None:
        out = out + experts.down_proj_bias[e]
    return out


def direct(experts, x, affinities, index, capacity=None):
    """Token by token: each chosen expert (in its queue's capacity) times its affinity."""
    c = experts.config
    taken = [0] * c.num_experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        kept = []
        for e in index[t].tolist():
            taken[e] += 1
            if capacity is None or taken[e] <= capacity:
                kept.append(e)
        weights = {e: affinities[t, e] for e in kept}
        if c.normalize_top_k_affinities:
            total = sum(weights.values())
            weights = {e: w / total for e, w in weights.items()}
        for e, w in weights.items():
            if c.early_expert_affinity_modulation:
                out[t] += one_expert(experts, e, x[t] * w)
            else:
                out[t] += w * one_expert(experts, e, x[t])
    return out


def routing(tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=generator)
    affinities = torch.softmax(torch.randn(tokens, EXPERTS, generator=generator), dim=-1)
    return x, affinities, torch.topk(affinities, TOP_K).indices


VARIANTS = {
    "glu": {},
    "normalized": {"normalize_top_k_affinities": True},
    "swiglu-scaled-biased-clamped": {
        "glu_type": "swiglu",
        "hidden_act": "sigmoid",
        "hidden_act_scaling_factor": 1.702,
        "hidden_act_bias": 1.0,
        "gate_clamp_upper_limit": 0.5,
        "up_clamp_lower_limit": -0.4,
        "up_clamp_upper_limit": 0.4,
        "bias": True,
    },
    "glu-clamped-gate-below": {"gate_clamp_lower_limit": -0.2},
    "not-gated": {"glu_mlp": False},
    "early-affinity-modulation": {"early_expert_affinity_modulation": True},
}


@pytest.fixture(params=["grouped", "gathered"])
def path(request, monkeypatch) -> str:
    """Which computation runs: the grouped op (eager), or the experts' weights indexed in the
    graph, which compiled graphs use for up to num_experts (token, choice) pairs."""
    if request.param == "gathered":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    return request.param


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_expert_mlps_match_the_direct_computation(variant, tokens, path) -> None:
    experts = random_experts(experts_config(**VARIANTS[variant]))
    x, affinities, index = routing(tokens)
    expected = direct(experts, x, affinities, index)
    torch.testing.assert_close(experts(x, affinities, index), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.5])
def test_capacity_factor_drops_the_tokens_past_each_experts_capacity(capacity_factor) -> None:
    experts = random_experts(experts_config(capacity_factor=capacity_factor))
    tokens = 24
    x, affinities, index = routing(tokens, seed=5)
    capacity = min(math.ceil(tokens * TOP_K * capacity_factor / EXPERTS), tokens)
    expected = direct(experts, x, affinities, index, capacity=capacity)
    torch.testing.assert_close(experts(x, affinities, index), expected, rtol=1e-5, atol=1e-5)
    busiest = torch.bincount(index.flatten(), minlength=EXPERTS).max().item()
    assert busiest > capacity, "the routing must overflow an expert for the test to mean much"


@pytest.mark.parametrize("capacity_factor", [None, EXPERTS / TOP_K, 10.0])
def test_full_capacity_drops_nothing(capacity_factor) -> None:
    experts = random_experts(experts_config(capacity_factor=capacity_factor))
    x, affinities, index = routing(24, seed=5)
    expected = direct(experts, x, affinities, index)
    torch.testing.assert_close(experts(x, affinities, index), expected, rtol=1e-5, atol=1e-5)


def test_a_decode_step_reads_only_the_routed_experts(path) -> None:
    experts = random_experts(experts_config())
    x, affinities, index = routing(1)
    expected = experts(x, affinities, index)
    unrouted = [e for e in range(EXPERTS) if e not in index[0].tolist()]
    with torch.no_grad():
        experts.gate_up_proj[unrouted] = float("nan")
        experts.down_proj[unrouted] = float("nan")
    torch.testing.assert_close(experts(x, affinities, index), expected)


def test_grouped_linear_leaves_rows_past_the_groups_at_zero() -> None:
    x, weight = torch.randn(5, 4), torch.randn(3, 6, 4)
    out = grouped_linear(x, weight, torch.tensor([2, 0, 1]))
    torch.testing.assert_close(out[:2], x[:2] @ weight[0].T)
    torch.testing.assert_close(out[2], x[2] @ weight[2].T)
    assert out[3:].abs().sum() == 0


@pytest.mark.parametrize(("tp_degree", "ep_degree"), [(2, 1), (1, 2), (2, 2), (1, 4)])
def test_rank_shards_add_up_to_the_whole_layer(tp_degree, ep_degree) -> None:
    """Each rank's experts and intermediate slice, summed over ranks, give the unsharded
    output; the down projection's bias counted once."""
    config = experts_config(bias=True)
    whole = random_experts(config)
    full = {name: p.detach() for name, p in whole.named_parameters()}
    x, affinities, index = routing(12)
    total = torch.zeros_like(x)
    for rank in range(tp_degree * ep_degree):
        sharding = {"tp_degree": tp_degree, "ep_degree": ep_degree}
        shard = ExpertMLPs(config, tp_rank=rank % tp_degree, ep_rank=rank // tp_degree, **sharding)
        shard.load_state_dict(shard.shard_state_dict(full))
        total += shard(x, affinities, index)
    torch.testing.assert_close(total, whole(x, affinities, index), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act_fn", ["softmax", "sigmoid"])
@pytest.mark.parametrize("over_top_k", [False, True])
def test_router_affinities_and_choices(act_fn, over_top_k) -> None:
    torch.manual_seed(0)
    router = RouterTopK(EXPERTS, TOP_K, HIDDEN, act_fn=act_fn, apply_act_fn_over_topk=over_top_k)
    x = torch.randn(6, HIDDEN, dtype=torch.bfloat16)
    logits, affinities, index = router(x)
    expected_logits = x.float() @ router.linear_router.weight.T
    torch.testing.assert_close(logits, expected_logits)
    assert logits.dtype == torch.float32
    assert torch.equal(index, torch.topk(expected_logits, TOP_K).indices)
    act = (lambda v: torch.softmax(v, -1)) if act_fn == "softmax" else torch.sigmoid
    if over_top_k:
        chosen = act(torch.gather(expected_logits, 1, index))
        expected = torch.zeros_like(logits).scatter(1, index, chosen)
    else:
        expected = act(expected_logits)
    torch.testing.assert_close(affinities, expected)


def shared_reference(x, gate, up, down):
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


@pytest.mark.parametrize(
    ("fused", "transposed"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_shared_experts_layouts(fused, transposed) -> None:
    torch.manual_seed(0)
    gate, up, down = torch.randn(2 * INNER, HIDDEN), torch.randn(2 * INNER, HIDDEN), None
    down = torch.randn(HIDDEN, 2 * INNER)
    shared = SharedExperts(
        HIDDEN,
        INNER,
        2,
        "silu",
        fused_gate_up_projection=fused,
        transpose_weights=transposed,
    )
    weights = {"gate_up_proj": torch.cat([gate, up])} if fused else {"gate_proj": gate}
    weights |= {} if fused else {"up_proj": up}
    weights["down_proj"] = down
    shared.load_state_dict(
        {f"{name}.weight": w.T if transposed else w for name, w in weights.items()}
    )
    x = torch.randn(5, HIDDEN)
    torch.testing.assert_close(shared(x), shared_reference(x, gate, up, down))


def test_moe_block_returns_router_logits_and_expert_index_when_asked() -> None:
    torch.manual_seed(0)
    router = RouterTopK(EXPERTS, TOP_K, HIDDEN)
    experts = random_experts(experts_config(normalize_top_k_affinities=True))
    block = MoE(router, experts, return_router_logits=True, return_expert_index=True)
    x = torch.randn(2, 3, HIDDEN)
    out, logits, index = block(x)
    assert out.shape == x.shape and logits.shape == (6, EXPERTS) and index.shape == (6, TOP_K)
    _, affinities, expected_index = router(x.view(6, HIDDEN))
    assert torch.equal(index, expected_index)
    torch.testing.assert_close(out.view(6, HIDDEN), experts(x.view(6, HIDDEN), affinities, index))
    assert torch.is_tensor(MoE(router, experts)(x))


CONFIG_PROBLEMS = {
    "must equal tp_degree (4), the ranks the experts are laid out over: e.g. moe_tp_degree=4": {
        "tp_degree": 4,
        "moe_tp_degree": 2,
        "moe_ep_degree": 1,
    },
    "glu_type is 'geglu'": {"glu_type": "geglu"},
    "router_config.act_fn is 'relu'": {"router_config": {"act_fn": "relu"}},
    "capacity_factor must be positive": {"capacity_factor": 0.0},
    "the routed experts have no quantized form yet": {"quantized": True},
    "shared experts are not split along the sequence on their own": {
        "shared_experts_sequence_parallel_enabled": True
    },
}


@pytest.mark.parametrize("expected", sorted(CONFIG_PROBLEMS))
def test_bad_moe_settings_are_reported(expected) -> None:
    neuron_config = MoENeuronConfig(**CONFIG_PROBLEMS[expected])
    problems = routed_mlp_problems(object(), neuron_config)
    assert any(expected in p for p in problems), problems


def test_a_consistent_moe_config_has_no_problems() -> None:
    neuron_config = MoENeuronConfig(tp_degree=4, moe_tp_degree=2, moe_ep_degree=2)
    assert routed_mlp_problems(object(), neuron_config) == []


def test_expert_mlps_refuse_uneven_splits() -> None:
    with pytest.raises(ConfigError, match="num_experts by moe_ep_degree"):
        ExpertMLPs(experts_config(), ep_degree=3)


def test_moe_block_exports_and_compiles_in_bfloat16(tmp_path) -> None:
    """AOTInductor runs the block as one graph with the grouped op called back (index_add,
    which its CPU runtime cannot run in bfloat16, is avoided)."""
    torch.manual_seed(0)
    router = RouterTopK(EXPERTS, TOP_K, HIDDEN)
    block = MoE(router, random_experts(experts_config())).to(torch.bfloat16)
    x = torch.randn(2, 5, HIDDEN, dtype=torch.bfloat16)
    program = torch.export.export(block, (x,))
    package = torch._inductor.aoti_compile_and_package(
        program, package_path=str(tmp_path / "b.pt2")
    )
    compiled = torch._inductor.aoti_load_package(package)
    torch.testing.assert_close(compiled(x), block(x), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("is_prefill", "gathered"), [(True, False), (False, True), (None, False)])
@pytest.mark.parametrize("tokens", [1, 40])
def test_is_prefill_picks_the_path(monkeypatch, is_prefill, gathered, tokens) -> None:
    """NxD Inference's is_prefill: True runs the sorted pairs (prefill), False indexes each
    pair's expert weights (token generation), None decides by the pair count (eager: sorted)."""
    experts = random_experts(experts_config(is_prefill=is_prefill))
    x, affinities, index = routing(tokens)
    used = []
    for name in ("grouped", "gathered"):
        method = getattr(experts, name)
        monkeypatch.setattr(experts, name, lambda *a, _m=method, _n=name: used.append(_n) or _m(*a))

    out = experts(x, affinities, index)

    assert used == ["gathered" if gathered else "grouped"]
    torch.testing.assert_close(out, direct(experts, x, affinities, index), rtol=1e-5, atol=1e-5)


def test_is_prefill_false_with_expert_parallelism_is_refused() -> None:
    with pytest.raises(ConfigError, match="is_prefill=False"):
        ExpertMLPs(experts_config(is_prefill=False), ep_degree=2)


def test_init_methods_initialise_the_expert_weights() -> None:
    config = experts_config(
        input_layer_init_method=lambda weight: torch.nn.init.constant_(weight, 0.25),
        output_layer_init_method=lambda weight: torch.nn.init.constant_(weight, -0.5),
    )
    experts = ExpertMLPs(config)
    assert (experts.gate_up_proj == 0.25).all() and (experts.down_proj == -0.5).all()
    default = ExpertMLPs(experts_config())
    bound = 1 / math.sqrt(HIDDEN)
    assert default.gate_up_proj.abs().max() <= bound and default.gate_up_proj.std() > 0


def test_enable_spmd_rank_is_reported_as_without_effect() -> None:
    with pytest.warns(RuntimeWarning, match="enable_spmd_rank=True has no effect"):
        ExpertMLPs(experts_config(enable_spmd_rank=True))


def test_fused_tkg_settings_are_reported_as_without_effect() -> None:
    from nxdplug.config import MoEFusedTKGConfig
    from nxdplug.modules.moe.moe import fused_tkg_config

    neuron_config = MoENeuronConfig(
        quantized=True, moe_fused_nki_kernel_enabled=True, expert_mlp_nki_kernel_enabled=True
    )
    tkg_config = fused_tkg_config(neuron_config)
    assert tkg_config == MoEFusedTKGConfig(
        quantized=True, moe_fused_kernel_enabled=True, expert_mlp_kernel_enabled=True
    )
    parts = (RouterTopK(EXPERTS, TOP_K, HIDDEN), random_experts(experts_config()))
    message = "quantized=True, moe_fused_kernel_enabled=True, expert_mlp_kernel_enabled=True"
    with pytest.warns(RuntimeWarning, match=message):
        MoE(*parts, init_tkg_module=True, tkg_config=tkg_config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MoE(*parts, init_tkg_module=True, tkg_config=MoEFusedTKGConfig())
        MoE(*parts, tkg_config=tkg_config)  # no fused module asked for
