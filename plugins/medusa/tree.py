"""The Medusa tree: which candidates one target call verifies, how they see each other, and
which branch the target accepts.

``medusa_tree`` lists paths as Medusa's mc_sim trees do: ``[a, b]`` is the a-th best token of
head 0 followed by the b-th best of head 1. Node 0 is the root, the token the target itself
chose at the previous step; the paths follow, ordered by depth then lexicographically, so every
parent comes before its children (a node at depth d comes from head d-1).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from nxdplug.plugin_api import TokenTree, sorted_paths, tree_config_of_paths

SETTING_HINT = "e.g. medusa_tree=[[0], [0, 0], [1], [0, 1]]"


def tree_problems(
    tree: Any, num_heads: Any, speculation_length: Any, vocab_size: Any = None
) -> list[str]:
    """What is wrong with ``medusa_tree`` for ``num_medusa_heads`` heads and
    ``medusa_speculation_length`` (which must be the number of paths plus one, the root)."""
    if not tree or not isinstance(tree, (list, tuple)):
        return [
            f"is_medusa=True needs medusa_tree, a non-empty list of paths ({SETTING_HINT}); "
            f"it is {tree!r}"
        ]
    problems = []
    paths = []
    for path in tree:
        valid = (
            isinstance(path, (list, tuple))
            and len(path) > 0
            and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path)
        )
        if not valid:
            problems.append(
                f"medusa_tree path {path!r} is not a non-empty list of ranks (whole numbers "
                f">= 0); {SETTING_HINT}"
            )
            continue
        paths.append(tuple(path))
    known = set(paths)
    if len(known) < len(paths):
        repeated = sorted({repr(list(p)) for p in paths if paths.count(p) > 1})
        problems.append(f"medusa_tree repeats the path(s) {', '.join(repeated)}; list each once")
    for path in sorted(known, key=lambda p: (len(p), p)):
        missing = [list(path[:i]) for i in range(1, len(path)) if path[:i] not in known]
        if missing:
            problems.append(
                f"medusa_tree path {list(path)} needs its prefix(es) {missing} in the tree too"
            )
    if isinstance(num_heads, int) and num_heads >= 1:
        too_deep = [list(p) for p in paths if len(p) > num_heads]
        if too_deep:
            problems.append(
                f"medusa_tree path(s) {too_deep[:3]} are deeper than num_medusa_heads="
                f"{num_heads} (head i proposes depth i+1); shorten them or raise num_medusa_heads"
            )
    if isinstance(vocab_size, int):
        too_far = [list(p) for p in paths if max(p) >= vocab_size]
        if too_far:
            problems.append(
                f"medusa_tree path(s) {too_far[:3]} rank beyond the vocabulary ({vocab_size})"
            )
    if not problems and speculation_length != len(tree) + 1:
        problems.append(
            f"medusa_speculation_length is {speculation_length!r} but medusa_tree has "
            f"{len(tree)} paths: set medusa_speculation_length={len(tree) + 1} (the paths "
            "plus the root)"
        )
    return problems


class MedusaTree:
    """A validated tree: its :class:`TokenTree` (``token_tree``: parents, ancestors, the mask
    and the acceptance rule) and the Medusa tables, on the CPU (:meth:`on` another device):

    ``parent`` [n], ``depth`` [n], ``ancestors`` [n, n] (the token tree's), ``head`` /
    ``rank`` [n-1] (which head's which top-k token each non-root node is), ``paths``
    [n, max_depth+1] (the nodes from the root to j, padded by repeating j); ``rank_paths``
    the tree's paths in node order.
    """

    TABLES = ("head", "rank", "paths")

    def __init__(self, paths: Iterable[Sequence[int]]) -> None:
        ordered = sorted_paths(paths)  # by depth, then rank: the level-by-level numbering
        self.rank_paths = ordered
        self.token_tree = TokenTree(tree_config_of_paths(ordered))
        self.size = self.token_tree.node_nums
        self.max_depth = max(len(p) for p in ordered)
        self.top_k = max(max(p) for p in ordered) + 1
        self.head = torch.tensor([len(p) - 1 for p in ordered], device="cpu")
        self.rank = torch.tensor([p[-1] for p in ordered], device="cpu")
        self.paths = self.token_tree.path_to(torch.arange(self.size))

    @property
    def parent(self) -> torch.Tensor:
        return self.token_tree.parent

    @property
    def depth(self) -> torch.Tensor:
        return self.token_tree.rotary_position_id_offset

    @property
    def ancestors(self) -> torch.Tensor:
        return self.token_tree.ancestors

    def on(self, device: torch.device) -> MedusaTree:
        """This tree with its tables on ``device``."""
        moved = copy.copy(self)
        moved.token_tree = self.token_tree.on(device)
        for name in self.TABLES:
            setattr(moved, name, getattr(self, name).to(device))
        return moved

    @property
    def num_nodes(self) -> int:
        """Speculated tokens per call (the root is the target's own)."""
        return self.size - 1

    def candidates(self, roots: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        """[rows, n] tokens: ``roots`` [rows], then each node's token from the heads' top-k
        ``top`` [rows, heads, k] (taken at the hidden state of the last committed token)."""
        return torch.cat([roots[:, None], top[:, self.head, self.rank]], dim=1)

    def attention_mask(self, prefix: torch.Tensor, width: int) -> torch.Tensor:
        """[rows, n, width] (long): node j of row r, written at cache slot ``prefix[r] + j``,
        sees the row's committed positions ``0..prefix[r]-1`` and its own ancestors and self."""
        return self.token_tree.attention_mask(prefix, width).long()

    def accept(
        self, tokens: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Acceptance of a verified tree (:meth:`TokenTree.accept`): ``tokens`` [rows, n] the
        candidates, ``targets`` [rows, n] the target's choice after each node. Returns the
        deepest accepted node and its depth, both [rows]."""
        return self.token_tree.accept(tokens, targets)
