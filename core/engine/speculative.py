"""Speculative decoding in the engine, configured as vLLM's ``speculative_config``.

Each step, every decoding request with room gets up to k proposed tokens from the speculation
mode's proposer (n-gram lookup in its own tokens, a draft model, ...). The target then scores
each request's last token and its proposals in one call: k+1 new tokens over the cached
positions. The engine takes the target's token at each position exactly as a decode step
would (the request's adjustments, sampler and random generator), and keeps going while it
equals the proposal there.

A fused speculator (EAGLE, Medusa) may propose a tree rather than a chain
(:class:`DraftTree`): the engine then walks from the root, choosing the target's token at the
current node as a decode step would, and moves to the child that holds that token; siblings
hold distinct tokens, so at most one does. A chain is the tree whose node j follows node j-1.

This is lossless: greedy outputs are the target's own. A sampled token is drawn from the same
distribution with the same draw of the request's generator as without speculation, so a
seeded request's tokens do not change either. For proposals that are not sampled (a lookup, a
draft's argmax) it is also vLLM's rejection rule: accept a proposal with the target's
probability of it, else draw from the rest.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import torch

from nxdplug.config.token_tree import TokenTreeError, sorted_paths, tree_config_of_paths
from nxdplug.engine.requests import Request
from nxdplug.errors import ConfigError

if TYPE_CHECKING:
    from nxdplug.engine.runner import EveryRank
    from nxdplug.modules.kv_cache import KVCacheManager
    from nxdplug.runtime.application import NeuronBaseForCausalLM
    from nxdplug.runtime.outputs import CausalLMOutputWithTokens
    from nxdplug.runtime.scheduled_step import ScheduledStep

# vLLM's ``speculative_config`` keys that nxdplug reads; any other key is refused by name.
KEYS = (
    "method",
    "num_speculative_tokens",
    "model",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "speculative_token_tree",
    "draft_tensor_parallel_size",
)
TREE_EXAMPLE = '"[(0,), (1,), (0, 0)]"'
# vLLM's default n-gram sizes when neither bound is given.
DEFAULT_NGRAM = 5


@attrs.frozen
class SpeculativeConfig:
    """vLLM's ``speculative_config``: ``method`` (``ngram``, ``draft_model``, ``eagle``, ...),
    ``num_speculative_tokens`` (k, at most the model's ``speculation_length``; None: that
    length; a tree's nodes below its root), ``model`` (the draft's folder, for
    ``draft_model`` and ``eagle``; the heads' folder, for ``medusa``), for ``ngram`` the
    n-gram sizes looked up, longest first (``prompt_lookup_min`` .. ``prompt_lookup_max``),
    ``speculative_token_tree``, a tree's rank paths (``[(0,), (1,), (0, 0)]``: the best
    and second-best next tokens, and the best after the best), depth first then by rank, and
    ``draft_tensor_parallel_size``, the ranks the draft runs on (see :func:`draft_ranks`)."""

    method: str
    num_speculative_tokens: int | None = None
    model: str | None = None
    prompt_lookup_min: int = DEFAULT_NGRAM
    prompt_lookup_max: int = DEFAULT_NGRAM
    speculative_token_tree: tuple[tuple[int, ...], ...] | None = None
    draft_tensor_parallel_size: int | None = None

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str) -> SpeculativeConfig:
        """The config of a JSON object as vLLM takes it; a ConfigError naming each bad key
        (``source`` says where it came from)."""
        problems = [
            f"{key!r} is not a speculative_config key nxdplug reads (it reads {', '.join(KEYS)})"
            for key in values
            if key not in KEYS
        ]
        method = values.get("method") or ("draft_model" if values.get("model") else None)
        if not isinstance(method, str):
            problems.append(
                "'method' is missing: give one of ngram, draft_model, eagle, eagle3, medusa "
                "(or 'model', a draft's folder, for draft_model)"
            )
        count = values.get("num_speculative_tokens")
        if count is not None and not _is_positive(count):
            problems.append(f"'num_speculative_tokens' must be a whole number >= 1, got {count!r}")
        low, high = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        low, high = low if low is not None else high, high if high is not None else low
        low, high = low or DEFAULT_NGRAM, high or DEFAULT_NGRAM
        if not (_is_positive(low) and _is_positive(high) and low <= high):
            problems.append(
                f"'prompt_lookup_min' ({low!r}) and 'prompt_lookup_max' ({high!r}) must be whole "
                "numbers with 1 <= min <= max"
            )
        model = values.get("model")
        if model is not None and not isinstance(model, str):
            problems.append(f"'model' must be a folder (the draft's, or the heads'), got {model!r}")
        draft_tp = values.get("draft_tensor_parallel_size")
        if draft_tp is not None and not _is_positive(draft_tp):
            problems.append(
                "'draft_tensor_parallel_size' must be 1 (the draft on the first rank alone) or "
                f"the target's tp_degree, got {draft_tp!r}"
            )
        tree = values.get("speculative_token_tree")
        paths = None
        if tree is not None:
            paths, problem = _tree_paths(tree)
            if problem is not None:
                problems.append(problem)
            elif count is not None and count != len(paths):
                problems.append(
                    f"'num_speculative_tokens' ({count}) must count speculative_token_tree's "
                    f"{len(paths)} paths (its nodes below the root), as vLLM's does"
                )
            else:
                count = len(paths)
        if problems:
            raise ConfigError(problems, source=source)
        return cls(method, count, model, low, high, paths, draft_tp)


def _tree_paths(value: object) -> tuple[tuple[tuple[int, ...], ...], str | None]:
    """``speculative_token_tree``'s paths, ordered as a tree numbers its nodes, or why it is
    not a tree (as vLLM, a Python literal in a string; a JSON list of lists too)."""
    wrong = (
        f"'speculative_token_tree' must list the tree's paths of ranks, e.g. {TREE_EXAMPLE}; "
        f"got {value!r}"
    )
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return (), wrong
    if not isinstance(value, (list, tuple)) or not value:
        return (), wrong
    for path in value:
        if not isinstance(path, (list, tuple)) or not path:
            return (), wrong
        if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path):
            return (), wrong
    try:
        tree_config_of_paths(value)
    except TokenTreeError as error:
        return (), f"'speculative_token_tree': {error.problems[0]}"
    return sorted_paths(value), None


def _is_positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@attrs.frozen
class DraftTree:
    """One request's proposals in a verification: node j (1..n) holds ``tokens[j-1]`` and
    follows node ``parents[j-1]``; node 0, the root, is the request's last token. The
    verification scores the root at position 0 and node j at position j. Nodes are numbered
    level by level (no node is shallower than one before it), and siblings hold distinct
    tokens. The chain d_1..d_k is the tree whose node j follows node j-1."""

    tokens: tuple[int, ...] = attrs.field(converter=tuple)
    parents: tuple[int, ...] = attrs.field(converter=tuple)
    depths: tuple[int, ...] = attrs.field(init=False)

    @depths.default
    def _depths(self) -> tuple[int, ...]:
        if len(self.tokens) != len(self.parents):
            raise ValueError(
                f"a draft tree needs one parent per token: {len(self.tokens)} tokens, "
                f"{len(self.parents)} parents"
            )
        depth = [0]
        for node, parent in enumerate(self.parents, start=1):
            if not 0 <= parent < node:
                raise ValueError(f"node {node}'s parent {parent} is not an earlier node")
            depth.append(depth[parent] + 1)
        if depth != sorted(depth):
            raise ValueError(f"the draft tree's nodes are not numbered level by level: {depth}")
        return tuple(depth[1:])

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        return cls(tokens, range(len(tokens)))

    def up_to(self, depth: int) -> DraftTree:
        """The nodes at most ``depth`` below the root (the same numbers)."""
        count = sum(1 for d in self.depths if d <= depth)
        return DraftTree(self.tokens[:count], self.parents[:count])

    def child(self, node: int, token: int) -> int | None:
        """The child of ``node`` holding ``token``; None when none does."""
        for child, (parent, held) in enumerate(zip(self.parents, self.tokens, strict=True), 1):
            if parent == node and held == token:
                return child
        return None


class Proposer(Protocol):
    """The engine side of a speculation mode (a ``SpeculationMode.engine_proposer``), built
    with ``(application, speculative_config, draft, every_rank)``; ``draft`` is the draft
    application for ``draft_model``, else None; ``every_rank``
    (:class:`~nxdplug.engine.runner.EveryRank`) runs calls on the engine's ranks (a draft
    sharded over them runs its calls through ``every_rank.of(draft)``)."""

    def propose(self, requests: Sequence[Request], k: int) -> list[list[int]]:
        """At most ``k`` tokens to follow each request's tokens so far (``token_ids``; its
        line holds all but the last); an empty list where it has none to offer. A proposer
        keeps what it needs between steps in ``request.proposer_state``, which the engine
        clears when the request loses its line."""


class FusedSpeculator(Protocol):
    """The engine side of a speculation mode whose own phases draft and verify in one call
    (fused EAGLE, Medusa), built with ``(application, speculative_config, draft,
    every_rank)``; it refuses, with a ConfigError, a config it cannot serve. It encodes its
    requests' prompts (its prompt phase feeds its draft too), and each step drafts a chain or
    a tree per request and scores it; the engine takes the tokens as it takes a
    verification's. Its state per request lives in ``request.proposer_state``. It runs its
    sub-models, and changes to the cache, through ``every_rank``
    (:class:`~nxdplug.engine.runner.EveryRank`), so that with tensor parallelism every rank
    runs them together."""

    # Cache positions its calls write past a request's prompt plus max_tokens.
    positions_past_end: int
    # The most drafted tokens one path of its proposals holds (a chain's k, a tree's levels).
    draft_depth: int

    def encode(self, requests: Sequence[Request], step: ScheduledStep) -> CausalLMOutputWithTokens:
        """Encode ``step`` (the requests' whole prompts into their lines); each request's
        last-token logits [rows, 1, vocab]."""

    def verify(self, requests: Sequence[Request]) -> tuple[list[DraftTree], torch.Tensor]:
        """Each request's drafts after its tokens so far, and the target's logits at its
        last token (the root) and at each node [rows, n+1, vocab]."""

    def taken(self, requests: Sequence[Request], paths: Sequence[Sequence[int]]) -> None:
        """What each request took of the last verification: ``paths[i]``, the root 0 and
        the nodes the engine went on to, one token added at each (the token chosen at the
        last node is the request's newest)."""


@attrs.define
class SpeculationMetrics:
    """vLLM's speculative-decoding counters: ``drafts`` (request steps that proposed
    tokens), ``draft_tokens`` (proposed), ``accepted_tokens`` (kept), and
    ``accepted_per_position[i]`` (how often the proposal at position i was kept; in a tree,
    the kept node at depth i+1)."""

    k: int
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = attrs.field()

    @accepted_per_position.default
    def _zeros(self) -> list[int]:
        return [0] * self.k

    def record(self, proposed: int, accepted: int) -> None:
        """One request's verification: ``proposed`` tokens offered, the first ``accepted``
        of them kept."""
        if not proposed:
            return
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1


@attrs.define
class Speculation:
    """An engine's speculation: its config, k (the most tokens one path proposes), its mode's
    proposer (or fused speculator) and the counters."""

    config: SpeculativeConfig
    k: int
    proposer: Proposer | None
    fused: FusedSpeculator | None
    metrics: SpeculationMetrics


def engine_speculation(
    application: NeuronBaseForCausalLM,
    config: SpeculativeConfig | None,
    draft: NeuronBaseForCausalLM | None,
    every_rank: EveryRank,
) -> Speculation | None:
    """The engine's speculation for ``application`` under ``config``; None when neither asks
    for any. ``every_rank`` runs a fused speculator's calls on the engine's ranks. A
    ConfigError saying what to change when they disagree or the mode cannot run in the
    engine."""
    mode = application.plugins.speculation_mode
    k = application.neuron_config.speculation_length
    source = "the engine's speculative_config"
    if config is None and mode is None:
        return None
    if config is None:
        method = mode.engine_methods[0] if mode.engine_methods else "ngram"
        raise ConfigError(
            [
                f"the model's config selects the {mode.name!r} speculation mode, so its decode "
                "steps verify proposed tokens, but nothing proposes them: pass "
                'speculative_config (nxdplug serve: --speculative-config \'{"method": '
                f'"{method}"}}\'), or build the model without speculation'
            ],
            source=source,
        )
    if mode is None or (mode.engine_fused is None and not k):
        raise ConfigError(
            [
                f"method {config.method!r} needs the target's verification phase: build it "
                "with speculation_length=k (nxdplug serve sets it from "
                "num_speculative_tokens)"
            ],
            source=source,
        )
    if (
        config.method not in mode.engine_methods
        or (mode.engine_proposer or mode.engine_fused) is None
    ):
        served = ", ".join(mode.engine_methods) or "no method"
        raise ConfigError(
            [
                f"method {config.method!r} does not run in the serving engine yet: the model's "
                f"{mode.name!r} speculation mode serves {served} there"
            ],
            source=source,
        )
    if application.neuron_config.on_device_sampling_config is not None:
        raise ConfigError(
            [
                f"method {config.method!r}: the engine chooses a verification's tokens on the "
                "host from the target's logits, and this model samples in its graph: build it "
                "without on_device_sampling_config"
            ],
            source=source,
        )
    ranks = draft_ranks(config, application.neuron_config.tp_degree)
    if mode.engine_fused is not None:
        if ranks != application.neuron_config.tp_degree:
            raise ConfigError(
                [
                    f"draft_tensor_parallel_size={ranks}: method {config.method!r}'s draft is "
                    "part of the target's graphs, sharded as they are: leave it out, or give "
                    f"the target's tp_degree ({application.neuron_config.tp_degree})"
                ],
                source=source,
            )
        fused = mode.load("engine_fused")(application, config, draft, every_rank)
        depth = fused.draft_depth
        return Speculation(config, depth, None, fused, SpeculationMetrics(depth))
    if config.speculative_token_tree is not None:
        raise ConfigError(
            [
                f"speculative_token_tree: method {config.method!r} proposes one chain; leave "
                "the tree out (num_speculative_tokens sets the chain's length)"
            ],
            source=source,
        )
    wanted = chain_length(config, k)
    proposer = mode.load("engine_proposer")(application, config, draft, every_rank)
    return Speculation(config, wanted, proposer, None, SpeculationMetrics(wanted))


def draft_ranks(config: SpeculativeConfig, tp_degree: int) -> int:
    """The ranks a draft runs on beside a target of ``tp_degree`` ranks, as vLLM's
    ``draft_tensor_parallel_size``: the target's (the default: every rank holds a shard of
    the draft, and runs its calls with the others) or 1 (the first rank holds the whole draft
    and runs it alone). A ConfigError for any other value."""
    ranks = config.draft_tensor_parallel_size
    if ranks is None:
        return tp_degree
    if ranks not in (1, tp_degree):
        raise ConfigError(
            [
                f"draft_tensor_parallel_size={ranks}: a draft runs on the target's "
                f"{tp_degree} rank(s), sharded as the target is, or on the first rank alone: "
                f"give {tp_degree} (the default) or 1"
            ],
            source="the engine's speculative_config",
        )
    return ranks


def chain_length(config: SpeculativeConfig, k: int) -> int:
    """The drafts a chain proposes: ``num_speculative_tokens``, at most the model's k (None:
    k); a ConfigError when it asks for more."""
    wanted = config.num_speculative_tokens or k
    if wanted > k:
        raise ConfigError(
            [
                f"num_speculative_tokens={wanted} is more than the model verifies per call "
                f"(speculation_length={k}); give at most {k}, or build it with more"
            ],
            source="the engine's speculative_config",
        )
    return wanted


def tree_nodes(config: SpeculativeConfig, paths: Sequence[Sequence[int]]) -> int:
    """The nodes below the root of the model's tree (``paths``, its rank paths): what
    ``num_speculative_tokens`` counts when given (vLLM's rule for a tree), and what
    ``speculative_token_tree`` lists when given. A ConfigError when either says otherwise."""
    ordered = sorted_paths(paths)
    problems = []
    wanted, given = config.num_speculative_tokens, config.speculative_token_tree
    if given is not None and given != ordered:
        problems.append(
            f"speculative_token_tree {_literal(given)} is not the tree the model was built "
            f"with, {_literal(ordered)}: build the model with it (nxdplug serve does), or "
            "leave it out"
        )
    elif wanted is not None and wanted != len(ordered):
        problems.append(
            f"num_speculative_tokens={wanted}, but the model drafts a token tree of "
            f"{len(ordered)} nodes below its root, which num_speculative_tokens counts (vLLM's "
            f"rule for a tree): give {len(ordered)}, or leave it out"
        )
    if problems:
        raise ConfigError(problems, source="the engine's speculative_config")
    return len(ordered)


def _literal(paths: Sequence[Sequence[int]]) -> str:
    return repr([tuple(path) for path in paths])


def move_kept_paths(
    kv_mgr: KVCacheManager,
    lines: Sequence[int],
    roots: Sequence[int],
    paths: Sequence[Sequence[int]],
) -> None:
    """Move the kept path of each row's verified tree to consecutive cache positions: node j
    of line ``lines[i]`` was written at position ``roots[i] + j``, and the path's n-th node
    goes to ``roots[i] + n``. Paths already in place (the root alone, a chain's) stay."""
    moving = [
        (line, root, list(path))
        for line, root, path in zip(lines, roots, paths, strict=True)
        if list(path) != list(range(len(path)))
    ]
    if not moving:
        return
    width = max(len(path) for _, _, path in moving)
    source, destination = [], []
    for _, root, path in moving:
        padding = width - len(path)  # the last move again: the same rows to the same place
        source.append([root + node for node in path] + [root + path[-1]] * padding)
        destination.append([root + n for n in range(len(path))] + [root + len(path) - 1] * padding)
    device = kv_mgr.position_buffers()[0].device
    kv_mgr.move_positions(
        torch.tensor([line for line, _, _ in moving], device=device),
        torch.tensor(source, device=device),
        torch.tensor(destination, device=device),
    )
