"""ExpertMLPs: each token through the MLPs of the experts its router chose, weighted by
affinity.

Every expert is ``down(act(gate(x)) * up(x))`` (``glu_mlp``) or ``down(act(up(x)))``. The weights
of all experts are stacked: ``gate_up_proj`` [experts, 2 * intermediate, hidden] (gate rows, then
up rows), ``down_proj`` [experts, hidden, intermediate]. Only the chosen experts' weights are
read, at decode as at prefill: the (token, chosen expert) pairs are sorted by expert and run
through ``nxdplug::grouped_linear`` (prompts, eager runs), or, in a compiled graph with no more
pairs than experts (decode), each pair's expert weights are indexed in the graph, which the
compiler fuses into the matrix-vector products (half the time of the op's calls back, measured
on the Mixtral-shaped model of docs/moe.md).

Sharding: ``ep_degree`` ranks each hold ``num_experts / ep_degree`` whole experts, and
``tp_degree`` ranks split each expert's intermediate dim; a rank computes its partial sum of
every token's output (zero for experts it does not hold) and the partial sums are added over the
``group`` of all ``tp_degree * ep_degree`` ranks.

``is_prefill`` picks the path instead: True, the sorted pairs (NxD Inference's prefill path);
False, the indexed weights (its token-generation path); None, by the pair count as above.
``input_layer_init_method`` / ``output_layer_init_method`` initialise ``gate_up_proj`` /
``down_proj`` (NxD's ``init_method(weight)``; default uniform in +-1/sqrt(fan_in)); a checkpoint's
weights replace them when the model is loaded.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from nxdplug.config import RoutedExpertsMLPOpsConfig
from nxdplug.config.moe import GLU_TYPES
from nxdplug.errors import ConfigError
from nxdplug.modules.activations import activation
from nxdplug.modules.moe.grouped_linear import grouped_linear
from nxdplug.modules.parallel_linear import TP, all_reduce_sum, shard_tensor, use_collectives

SPMD_RANK_WARNING = (
    "enable_spmd_rank=True has no effect here: each rank's graph is built with its own expert "
    "and tensor-parallel rank; reading the rank at run time (one graph for every rank) is a "
    "Neuron compile concern"
)


def expert_capacity(tokens: int, config: RoutedExpertsMLPOpsConfig) -> int | None:
    """How many tokens one expert takes in a step of ``tokens`` tokens; None: all of them.

    ``ceil(tokens * top_k * capacity_factor / num_experts)``, at most ``tokens``; a
    ``capacity_factor`` of ``num_experts / top_k`` or more can never drop a token.
    """
    factor = config.capacity_factor
    if factor is None or factor >= config.num_experts / config.top_k:
        return None
    return min(math.ceil(tokens * config.top_k * factor / config.num_experts), tokens)


def within_capacity(expert_index: torch.Tensor, capacity: int, num_experts: int) -> torch.Tensor:
    """[tokens, top_k] booleans: whether each (token, choice) pair fits in its expert.

    Tokens queue at an expert in token order; the ones after the first ``capacity`` are dropped
    (they get nothing from that expert), as NxD's capacity-factor path does.
    """
    chosen = nn.functional.one_hot(expert_index, num_experts).sum(dim=1)  # [tokens, experts]
    position = torch.cumsum(chosen, dim=0)  # 1-based place of each token in each queue
    return torch.gather(position, 1, expert_index) <= capacity


def validate_routed_experts(config: RoutedExpertsMLPOpsConfig) -> list[str]:
    problems = []
    if not 0 < config.top_k <= config.num_experts:
        problems.append(f"top_k ({config.top_k}) must be in 1..num_experts ({config.num_experts})")
    if config.glu_type not in GLU_TYPES:
        problems.append(f"glu_type is {config.glu_type!r}; expected one of {GLU_TYPES}")
    if config.normalize_top_k_affinities and config.top_k == 1:
        problems.append("normalize_top_k_affinities needs top_k > 1 (one affinity is always 1)")
    if config.capacity_factor is not None and config.capacity_factor <= 0:
        problems.append(f"capacity_factor must be positive or None; got {config.capacity_factor}")
    return problems


def clamp(x: torch.Tensor, lower: float | None, upper: float | None) -> torch.Tensor:
    return x if lower is None and upper is None else x.clamp(min=lower, max=upper)


class ExpertMLPs(nn.Module):
    def __init__(
        self,
        routed_experts_mlp_config: RoutedExpertsMLPOpsConfig,
        *,
        tp_degree: int = 1,
        tp_rank: int = 0,
        ep_degree: int = 1,
        ep_rank: int = 0,
        group: str = TP,
    ) -> None:
        super().__init__()
        config = routed_experts_mlp_config
        problems = validate_routed_experts(config)
        for size, degree, what in (
            (config.num_experts, ep_degree, "num_experts by moe_ep_degree"),
            (config.intermediate_size, tp_degree, "intermediate_size by moe_tp_degree"),
        ):
            if size % degree:
                problems.append(f"cannot split {what}: {size} % {degree} != 0")
        if config.is_prefill is False and ep_degree > 1:
            problems.append(
                "is_prefill=False (each pair's expert weights indexed) is implemented for "
                f"ep_degree 1 only; got ep_degree {ep_degree}: leave is_prefill None"
            )
        if problems:
            raise ConfigError(problems)
        if config.enable_spmd_rank:
            warnings.warn(SPMD_RANK_WARNING, RuntimeWarning, stacklevel=2)
        self.config = config
        self.act = activation(config.hidden_act)
        self.tp_degree, self.tp_rank = tp_degree, tp_rank
        self.ep_degree, self.ep_rank = ep_degree, ep_rank
        self.group = group
        self.local_experts = config.num_experts // ep_degree
        self.local_intermediate = config.intermediate_size // tp_degree
        projections = 2 if config.glu_mlp else 1
        hidden, inner = config.hidden_size, self.local_intermediate
        self.gate_up_proj = nn.Parameter(
            torch.empty(self.local_experts, projections * inner, hidden)
        )
        self.down_proj = nn.Parameter(torch.empty(self.local_experts, hidden, inner))
        self.gate_up_proj_bias = (
            nn.Parameter(torch.zeros(self.local_experts, projections * inner))
            if config.bias
            else None
        )
        self.down_proj_bias = (
            nn.Parameter(torch.zeros(self.local_experts, hidden)) if config.bias else None
        )
        for weight, fan_in, init_method in (
            (self.gate_up_proj, hidden, config.input_layer_init_method),
            (self.down_proj, inner, config.output_layer_init_method),
        ):
            if init_method is None:
                nn.init.uniform_(weight, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
            else:
                init_method(weight)

    def shard_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's experts, and its slice of each one's intermediate dim. The down
        projection's bias is added by the first tensor-parallel rank of each expert only, so that
        the sum over ranks counts it once."""
        shards = {}
        for name, tensor in full.items():
            tensor = shard_tensor(tensor, 0, self.ep_degree, self.ep_rank)
            if name.startswith("gate_up_proj"):
                parts = tensor.chunk(2 if self.config.glu_mlp else 1, dim=1)
                tensor = torch.cat(
                    [shard_tensor(p, 1, self.tp_degree, self.tp_rank) for p in parts], 1
                )
            elif name == "down_proj":
                tensor = shard_tensor(tensor, 2, self.tp_degree, self.tp_rank)
            elif name == "down_proj_bias" and self.tp_rank:
                tensor = torch.zeros_like(tensor)
            shards[name] = tensor
        return shards

    def decode_weight_bytes(self, batch_size: int, dtype: torch.dtype) -> int:
        """The weight bytes a step of ``batch_size`` single tokens reads: those of at most
        ``batch_size * top_k`` experts (fewer when the rank holds fewer)."""
        experts = min(self.local_experts, batch_size * self.config.top_k)
        per_expert = sum(p[0].numel() for p in self.parameters()) * dtype.itemsize
        return experts * per_expert

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        config = self.config
        if not config.glu_mlp:
            return self.act(h)
        gate, up = h.chunk(2, dim=-1)
        gate = clamp(gate, config.gate_clamp_lower_limit, config.gate_clamp_upper_limit)
        up = clamp(up, config.up_clamp_lower_limit, config.up_clamp_upper_limit)
        gated = self.act(config.hidden_act_scaling_factor * gate)
        if config.glu_type == "swiglu":
            gated = gate * gated
        return gated * (up + config.hidden_act_bias)

    def forward(
        self, hidden: torch.Tensor, affinities: torch.Tensor, expert_index: torch.Tensor
    ) -> torch.Tensor:
        """hidden: [tokens, hidden]; affinities: [tokens, experts]; expert_index: [tokens,
        top_k]. Returns [tokens, hidden]."""
        config = self.config
        tokens, top_k = expert_index.shape
        weights = torch.gather(affinities, 1, expert_index)
        capacity = expert_capacity(tokens, config)
        kept = (
            within_capacity(expert_index, capacity, config.num_experts)
            if capacity is not None
            else torch.ones_like(expert_index, dtype=torch.bool)
        )
        weights = weights * kept
        if config.normalize_top_k_affinities:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-12)

        if self.uses_gathered_weights(tokens * top_k):
            out = self.gathered(hidden, weights, expert_index)
        else:
            out = self.grouped(hidden, weights, expert_index, kept)
        if use_collectives(self.tp_degree * self.ep_degree, self.group):
            out = all_reduce_sum(out, self.group)
        return out

    def uses_gathered_weights(self, pairs: int) -> bool:
        """Whether ``pairs`` (token, choice) pairs take the indexed-weights path."""
        if self.config.is_prefill is not None:
            return not self.config.is_prefill
        return torch.compiler.is_compiling() and self.ep_degree == 1 and pairs <= self.local_experts

    def grouped(
        self,
        hidden: torch.Tensor,
        weights: torch.Tensor,
        expert_index: torch.Tensor,
        kept: torch.Tensor,
    ) -> torch.Tensor:
        """The (token, choice) pairs sorted by expert and multiplied expert by expert
        (``nxdplug::grouped_linear``): each routed expert's weights read once."""
        config = self.config
        tokens, top_k = expert_index.shape
        # Pairs (token, choice) sorted by local expert; pairs for no local expert go last,
        # where grouped_linear leaves them out.
        local = expert_index.flatten() - self.ep_rank * self.local_experts
        runs_here = (local >= 0) & (local < self.local_experts) & kept.flatten()
        group_of_pair = torch.where(runs_here, local, self.local_experts)
        order = torch.argsort(group_of_pair, stable=True)
        counts = group_of_pair.new_zeros(self.local_experts + 1).scatter_add(
            0, group_of_pair, torch.ones_like(group_of_pair)
        )[: self.local_experts]
        token_of_pair = order // top_k
        pair_weights = weights.flatten()[order].to(hidden.dtype).unsqueeze(-1)

        x = hidden[token_of_pair]
        if config.early_expert_affinity_modulation:
            x = x * pair_weights
        h = self.activation(grouped_linear(x, self.gate_up_proj, counts, self.gate_up_proj_bias))
        y = grouped_linear(h, self.down_proj, counts, self.down_proj_bias)
        if not config.early_expert_affinity_modulation:
            y = y * pair_weights
        # Back to (token, choice) order, then each token's choices added. (A gather rather
        # than index_add, which AOTInductor's CPU runtime cannot run in bfloat16.)
        out = y[torch.argsort(order)].view(tokens, top_k, -1).sum(dim=1)
        return out

    def gathered(
        self, hidden: torch.Tensor, weights: torch.Tensor, expert_index: torch.Tensor
    ) -> torch.Tensor:
        """Each pair's expert weights indexed in the graph (a compiled graph fuses the index
        into the matrix-vector product, reading those experts' rows in place): the decode path
        when there are no more pairs than experts. Dropped pairs have weight 0."""
        tokens, top_k = expert_index.shape
        experts = expert_index.flatten()
        hidden = computed_once(hidden)
        x = hidden.repeat_interleave(top_k, dim=0).unsqueeze(-1)  # [pairs, hidden, 1]
        pair_weights = weights.flatten().to(hidden.dtype).unsqueeze(-1)
        if self.config.early_expert_affinity_modulation:
            x = x * pair_weights.unsqueeze(-1)
        h = torch.bmm(self.gate_up_proj[experts], x).squeeze(-1)
        if self.gate_up_proj_bias is not None:
            h = h + self.gate_up_proj_bias[experts]
        h = self.activation(h).unsqueeze(-1)
        y = torch.bmm(self.down_proj[experts], h).squeeze(-1)
        if self.down_proj_bias is not None:
            y = y + self.down_proj_bias[experts]
        if not self.config.early_expert_affinity_modulation:
            y = y * pair_weights
        return y.view(tokens, top_k, -1).sum(dim=1)


def computed_once(x: torch.Tensor) -> torch.Tensor:
    """``x`` written to a buffer of its own in a compiled graph, so that the experts'
    matrix-vector products read it; inductor otherwise fuses what produces it (the layer norm)
    into their loops and recomputes it for every weight row (measured on the Mixtral-shaped
    model of docs/moe.md: 185 against 133 us for a layer's two experts). ``x`` itself when not
    compiling."""
    if not torch.compiler.is_compiling():
        return x
    from torch._inductor import inductor_prims  # noqa: F401  (registers the prim)

    return torch.ops.prims.inductor_force_stride_order(x, x.stride())
