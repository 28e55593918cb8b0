"""Medusa in the serving engine (vLLM's ``medusa`` method).

The engine encodes a request's prompt by Medusa's context phase, which gives the target's
logits of the last prompt token (the request's first token) and the heads' top-k there. Each
step then verifies, per request, the tree of ``medusa_tree``: its root is the request's newest
token, its nodes the heads' candidates at the token before (head i proposes depth i+1). The
verifier writes node j at position ``length - 1 + j`` under the tree mask and returns the
target's logits and the heads' top-k at every node; the engine walks the tree (each token
chosen as a decode step chooses it), the kept path's cache rows move to consecutive positions,
and the heads' top-k at its last node propose the next tree.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from nxdplug.plugin_api import (
    CausalLMOutputWithTokens,
    ConfigError,
    DraftTree,
    Request,
    ScheduledStep,
    SpeculativeConfig,
    StepInputs,
    tree_nodes,
)
from nxdplug.plugins.medusa.hooks import HEADS_PATH_SETTING, LAYERS_SETTING
from nxdplug.plugins.medusa.submodels import MEDUSA_CONTEXT_TAG, MEDUSA_MODEL_TAG

if TYPE_CHECKING:
    from nxdplug.plugin_api import EveryRank, NeuronBaseForCausalLM

SOURCE = "the engine's speculative_config"


def engine_settings(config: SpeculativeConfig) -> dict[str, Any]:
    """The model vLLM's ``medusa`` method needs: ``is_medusa`` with the tree of
    ``speculative_token_tree``, or else vLLM's Medusa proposal, a chain of each head's best
    token (``num_speculative_tokens`` heads); as many heads as the tree is deep; the heads
    of ``model`` (a folder with a Medusa heads file; left out: the file beside the
    target's checkpoint), with its ``medusa_num_layers`` when its config.json gives it.
    Medusa verifies by its own phase, so neither the core's token generation nor the
    draft-model mode's ``speculation_length`` is built."""
    tree = config.speculative_token_tree
    if tree is None:
        if config.num_speculative_tokens is None:
            raise ConfigError(
                [
                    "method 'medusa' needs num_speculative_tokens (the heads whose best tokens "
                    "make a chain) or speculative_token_tree"
                ],
                source="--speculative-config",
            )
        tree = tuple((0,) * depth for depth in range(1, config.num_speculative_tokens + 1))
    settings = {
        "is_medusa": True,
        "medusa_tree": [list(path) for path in tree],
        "medusa_speculation_length": len(tree) + 1,
        "num_medusa_heads": max(len(path) for path in tree),
        "speculation_length": 0,
        "trace_tokengen_model": False,
    }
    if config.model is not None:
        folder = Path(config.model)
        if not folder.is_dir():
            raise ConfigError(
                [
                    f"'model' {config.model} is not a folder: give the folder of the Medusa "
                    "heads file (medusa_lm_head.safetensors, ...), or leave it out to read the "
                    "one beside the target's checkpoint"
                ],
                source="--speculative-config",
            )
        settings[HEADS_PATH_SETTING] = str(folder)
        layers = _layers_of(folder / "config.json")
        if layers is not None:
            settings[LAYERS_SETTING] = layers
    return settings


def _layers_of(config_file: Path) -> int | None:
    """The ResBlocks per head that a FasterDecoding/Medusa ``config.json`` gives."""
    if not config_file.is_file():
        return None
    layers = json.loads(config_file.read_text()).get("medusa_num_layers")
    return layers if isinstance(layers, int) else None


@attrs.define
class HeadsState:
    """A request's heads' top-k [heads, k] after its newest committed token; during a
    verification, the heads' top-k at every node [n, heads, k] and the root's cache
    position."""

    top: torch.Tensor
    scored: torch.Tensor | None = None
    root: int = 0


class MedusaEngineSpeculator:
    """The ``engine_fused`` of the ``medusa`` speculation mode."""

    def __init__(
        self,
        application: NeuronBaseForCausalLM,
        config: SpeculativeConfig,
        draft: NeuronBaseForCausalLM | None,
        every_rank: EveryRank,
    ) -> None:
        problems = []
        if draft is not None and draft is not application:
            problems.append("Medusa proposes with the model's own heads: give no draft model")
        problems += _heads_problems(application, config)
        if problems:
            raise ConfigError(problems, source=SOURCE)
        self.every_rank = every_rank
        self.device = application.submodel(MEDUSA_CONTEXT_TAG).device
        self.tree = application.submodel(MEDUSA_MODEL_TAG).tree.on(application.device)
        tree_nodes(config, self.tree.rank_paths)
        self.parents = self.tree.parent[1:].tolist()
        self.draft_depth = self.tree.max_depth
        # The verifier writes the tree's n nodes from the newest token's position on.
        self.positions_past_end = self.tree.size - 2
        application.reset()

    def encode(self, requests: Sequence[Request], step: ScheduledStep) -> CausalLMOutputWithTokens:
        inputs = StepInputs(step.input_ids, step.cache_mask(), step.positions(), step.seq_ids)
        logits, top = self.every_rank.submodel(MEDUSA_CONTEXT_TAG, inputs)
        for row, request in enumerate(requests):
            request.proposer_state = HeadsState(top[row, -1])
        return CausalLMOutputWithTokens(logits=logits, tokens=None)

    def verify(self, requests: Sequence[Request]) -> tuple[list[DraftTree], torch.Tensor]:
        tree, device = self.tree, self.device
        states: list[HeadsState] = [r.proposer_state for r in requests]
        roots = torch.tensor([r.output_ids[-1] for r in requests], device=device)
        candidates = tree.candidates(roots, torch.stack([s.top for s in states]))
        prefix = torch.tensor([r.length - 1 for r in requests], device=device)
        mask = tree.attention_mask(prefix, int(prefix.max()) + tree.size)
        slots = prefix[:, None] + torch.arange(tree.size, device=device)
        lines = torch.tensor([r.line for r in requests], device=device)
        logits, node_top = self.every_rank.submodel(
            MEDUSA_MODEL_TAG, StepInputs(candidates, mask, slots, lines)
        )
        for state, scored, root in zip(states, node_top, prefix.tolist(), strict=True):
            state.scored, state.root = scored, root
        proposed = [DraftTree(row[1:], self.parents) for row in candidates.tolist()]
        return proposed, logits

    def taken(self, requests: Sequence[Request], paths: Sequence[Sequence[int]]) -> None:
        going_on = []
        for request, path in zip(requests, paths, strict=True):
            state: HeadsState = request.proposer_state
            assert state.scored is not None
            request.proposer_state = HeadsState(state.scored[path[-1]])
            if not request.finished:
                going_on.append((request.line, state.root, path))
        if going_on:
            self.every_rank.move_kept_paths(*zip(*going_on, strict=True))


def _heads_problems(application: NeuronBaseForCausalLM, config: SpeculativeConfig) -> list[str]:
    """``model`` must name the heads the model was built with (vLLM's medusa ``model`` is
    the heads' folder; here the heads are the model's own)."""
    if config.model is None:
        return []
    built = getattr(application.neuron_config, HEADS_PATH_SETTING, None) or getattr(
        application.config, "_name_or_path", None
    )
    if built is not None and Path(built).resolve() == Path(config.model).resolve():
        return []
    return [
        f"'model' {config.model} is not the folder of the heads the model was built with "
        f"({built}): build it with {HEADS_PATH_SETTING}={config.model} (nxdplug serve does), "
        "or leave 'model' out"
    ]
