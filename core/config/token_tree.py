"""A draft token tree, given as NxD Inference's ``token_tree_config`` gives it.

The config maps each node to its children: ``{0: [1, 2], 1: [3, 4], 2: [5]}`` is a root
(node 0, the newest committed token) with two children, the first of which has two children of
its own and the second one. A node at depth d is drafted by the d-th draft step: the children
of a node are its draft's best tokens, in rank order. Leaves may be left out of the mapping.
Nodes are numbered level by level (breadth first, children in the order listed), so the tree's
tokens line up as one verification input ``[root, level 1, level 2, ...]``.

:class:`TokenTree` holds the tables NxD Inference's ``TokenTree`` exposes under the same names
(``nxdplug.nxdi.modules.eagle.token_tree``), which its own tests check, and the ones a
verification uses here: each node's parent, depth and ancestors, and the acceptance rule.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from nxdplug.errors import ConfigError, NotSupportedError

EXAMPLE = '{"0": [1, 2], "1": [3, 4], "2": [5]}'


def tree_attention(
    model: nn.Module, tree_mask: torch.Tensor
) -> tuple[dict[int | None, torch.Tensor], torch.Tensor]:
    """The attention masks and rotary positions of tree nodes under a [batch, n, keys] mask
    (each node sees the prefix and its ancestors): a node's rotary position is the number of
    earlier tokens it sees, its depth after the prefix."""
    if {layer.self_attn.sliding_window for layer in model.layers} != {None}:
        raise NotSupportedError("token trees cannot be verified under sliding-window attention")
    return {None: tree_mask[:, None].bool()}, tree_mask.long().sum(dim=-1) - 1


class TokenTreeError(ConfigError, ValueError):
    """A ``token_tree_config`` that is not a tree numbered level by level."""

    def __init__(self, problem: str) -> None:
        super().__init__([problem])


def parse_tree_config(tree_config: Any) -> dict[int, list[int]]:
    """The adjacency as ``{node: [children]}`` with int ids, every node listed (leaves with
    no children). Keys and children may be ints or digit strings (as JSON gives them)."""
    if not isinstance(tree_config, Mapping) or not tree_config:
        raise TokenTreeError(
            f"token_tree_config must map each node to its children, e.g. {EXAMPLE}; "
            f"it is {tree_config!r}"
        )
    parsed: dict[int, list[int]] = {}
    for key, children in tree_config.items():
        if children is None:
            children = []
        if not isinstance(children, (list, tuple)):
            raise TokenTreeError(
                f"token_tree_config[{key!r}] must list the node's children; it is {children!r}"
            )
        parsed[_node_id(key, key)] = [_node_id(child, key) for child in children]
    for children in list(parsed.values()):
        for child in children:
            parsed.setdefault(child, [])
    return parsed


def _node_id(value: Any, where: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TokenTreeError(f"token_tree_config node {value!r} (at {where!r}) is not a node id")
    try:
        node = int(value)
    except ValueError:
        raise TokenTreeError(
            f"token_tree_config node {value!r} (at {where!r}) is not a whole number"
        ) from None
    if node < 0:
        raise TokenTreeError(f"token_tree_config node {value!r} (at {where!r}) is negative")
    return node


def tree_levels(tree: Mapping[int, Sequence[int]]) -> list[list[int]]:
    """The nodes level by level from the root 0, after checking that ``tree`` is one tree
    numbered breadth first (node ids 0..n-1 in the order a level-by-level walk meets them)."""
    if 0 not in tree:
        raise TokenTreeError(f"token_tree_config has no root: node 0 is missing ({EXAMPLE})")
    parents: dict[int, int] = {}
    for node, children in tree.items():
        for child in children:
            if child == 0 or child in parents:
                first = "the root" if child == 0 else f"node {parents[child]}"
                raise TokenTreeError(
                    f"token_tree_config lists node {child} as a child of {first} and of node "
                    f"{node}; each node has one parent, and the root none"
                )
            parents[child] = node
    levels, level = [], [0]
    while level:
        levels.append(level)
        level = [child for node in level for child in tree[node]]
    order = [node for level in levels for node in level]
    unreachable = sorted(set(tree) - set(order))
    if unreachable:
        raise TokenTreeError(
            f"token_tree_config nodes {unreachable} are not reachable from the root 0"
        )
    if order != list(range(len(order))):
        raise TokenTreeError(
            "token_tree_config must number its nodes level by level: the root 0, then its "
            "children, then theirs, each level in the order its parents list them; walking "
            f"the tree level by level meets {order}"
        )
    if len(levels) < 2:
        raise TokenTreeError(
            f"token_tree_config has only the root; give it children to draft ({EXAMPLE})"
        )
    return levels


def sorted_paths(paths: Iterable[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """Rank paths by depth, then by ranks: the order in which a tree numbered level by level
    meets their nodes."""
    return tuple(sorted((tuple(path) for path in paths), key=lambda path: (len(path), path)))


def tree_config_of_paths(paths: Iterable[Sequence[int]]) -> dict[int, list[int]]:
    """The ``{node: [children]}`` of a tree given as rank paths (Medusa's ``medusa_tree``,
    vLLM's ``speculative_token_tree``): ``[a, b]`` is the a-th best token after the root, then
    the b-th best after that one. Nodes are numbered as :func:`sorted_paths` orders them (the
    root 0). A TokenTreeError when a path repeats or lacks its prefix."""
    ordered = sorted_paths(paths)
    if len(set(ordered)) < len(ordered):
        repeated = [list(p) for p in sorted({p for p in ordered if ordered.count(p) > 1})]
        raise TokenTreeError(f"the tree's paths repeat {repeated}; list each once")
    index = {(): 0} | {path: node for node, path in enumerate(ordered, start=1)}
    children: dict[int, list[int]] = {0: []}
    for path in ordered:
        if path[:-1] not in index:
            raise TokenTreeError(
                f"the tree's path {list(path)} needs its prefix {list(path[:-1])} in the tree too"
            )
        children.setdefault(index[path[:-1]], []).append(index[path])
    return children


class TokenTree:
    """A validated token tree and its tables.

    NxD Inference's attributes (lists, or CPU tensors where it has tensors):

    - ``tree_config`` {node: children}; ``depth`` (levels, the root's included);
      ``node_nums``; ``level`` / ``level_node_count`` nodes per level; ``level_node_ids``,
      ``level_node_ids_with_child``, ``level_internal_node_count``; ``level_child`` each
      node's child count per level; ``max_width`` the most children of a node; ``width`` /
      ``width_wo_leaf`` the widest level (without the last);
    - ``full_tree_attn_mask`` [n, n] float32: node i sees node j (j is i or an ancestor);
      ``draft_tree_attn_mask`` per non-last level: its nodes' rows, their own column cleared;
    - ``path`` / ``parent_path`` [leaves, depth]: each root-to-leaf path, completed by the
      lowest nodes off the path; ``path_permute_mask`` / ``parent_path_permute_mask`` [leaves,
      n]: the path, then every other node ascending; ``cache_scatter_indices``: per path,
      where each node's cache row goes when that path is kept (path nodes first, in order);
    - ``rotary_position_id_offset`` [n]: each node's depth; ``drafted_nums``: nodes before
      each level; ``position_id_offset``: per non-last level, the ``width`` slots after the
      nodes drafted before it; ``topk_permute_index`` / ``draft_hidden_gather_index``: per
      non-last level, which of the level's top-k outputs (k = its ``max`` children) are the
      next level's nodes, and which node of the level each of them comes from.

    Besides these: ``parent`` [n] (the root its own), ``ancestors`` [n, n] bool (the mask as
    booleans), :meth:`attention_mask` and :meth:`accept`.
    """

    TABLES = ("parent", "ancestors", "rotary_position_id_offset")

    def __init__(self, tree_config: Any) -> None:
        self.tree_config = parse_tree_config(tree_config)
        levels = tree_levels(self.tree_config)
        children = self.tree_config
        self.level_node_ids = levels
        self.level_node_ids_with_child = [[n for n in level if children[n]] for level in levels]
        self.level_child = [[len(children[n]) for n in level] for level in levels]
        self.level = [len(level) for level in levels]
        self.level_node_count = list(self.level)
        self.level_internal_node_count = [len(nodes) for nodes in self.level_node_ids_with_child]
        self.depth = len(levels)
        self.node_nums = sum(self.level)
        self.max_width = max(max(counts) for counts in self.level_child)
        self.width = max(self.level)
        self.width_wo_leaf = max(self.level[:-1])

        parent = [0] * self.node_nums
        for node, kids in children.items():
            for child in kids:
                parent[child] = node
        chains = [[0]]
        for node in range(1, self.node_nums):
            chains.append([*chains[parent[node]], node])
        self.node_chains = chains  # each node's nodes from the root, itself included
        self.parent = torch.tensor(parent)
        self.ancestors = torch.zeros(self.node_nums, self.node_nums, dtype=torch.bool)
        for node, chain in enumerate(chains):
            self.ancestors[node, chain] = True
        self.full_tree_attn_mask = self.ancestors.float()
        self.draft_tree_attn_mask = []
        for level in levels[:-1]:
            rows = self.full_tree_attn_mask[level].clone()
            rows[range(len(level)), level] = 0
            self.draft_tree_attn_mask.append(rows)

        leaves = [node for node in range(self.node_nums) if not children[node]]
        leaf_paths = sorted((chains[leaf] for leaf in leaves), key=self._walk_order)
        permuted = [path + sorted(set(range(self.node_nums)) - set(path)) for path in leaf_paths]
        self.path_permute_mask = torch.tensor(permuted)
        self.path = self.path_permute_mask[:, : self.depth].clone()
        self.parent_path_permute_mask = self.path_permute_mask.clone()
        self.parent_path = self.path.clone()
        self.cache_scatter_indices = [
            [order.index(node) for node in range(self.node_nums)] for order in permuted
        ]

        depth_of = [len(chain) - 1 for chain in chains]
        self.rotary_position_id_offset = torch.tensor(depth_of)
        self.drafted_nums = [0]
        for count in self.level:
            self.drafted_nums.append(self.drafted_nums[-1] + count)
        self.position_id_offset = [
            [self.drafted_nums[i] + j for j in range(self.width)] for i in range(self.depth - 1)
        ]
        self.topk_permute_index = []
        self.draft_hidden_gather_index = []
        for counts in self.level_child[:-1]:
            widest = max(counts)
            starts = [i * widest for i in range(len(counts))]
            self.topk_permute_index.append(
                [start + rank for start, n in zip(starts, counts, strict=True) for rank in range(n)]
            )
            self.draft_hidden_gather_index.append(
                [i for i, n in enumerate(counts) for _ in range(n)]
            )

    def _walk_order(self, chain: list[int]) -> list[int]:
        """Sort key that lists root-to-leaf paths depth first, children in their order."""
        return [self.tree_config[parent].index(node) for parent, node in itertools.pairwise(chain)]

    def get_hidden_scatter_index(self) -> torch.Tensor:
        """[1, depth-1, width]: for level l > 0, which node of level l (by its index in the
        level) each node of level l+1 comes from; zeros for level 0."""
        index = torch.zeros(1, self.depth - 1, self.width, dtype=torch.int64)
        for level in range(1, self.depth - 1):
            first_child = self.level_node_ids[level + 1][0]
            for i, node in enumerate(self.level_node_ids[level]):
                for child in self.tree_config[node]:
                    index[0, level, child - first_child] = i
        return index

    def get_level_child_without_leaf(self) -> list[list[int]]:
        """Per level, each node's number of children that have children of their own."""
        return [
            [sum(1 for c in self.tree_config[n] if self.tree_config[c]) for n in level]
            for level in self.level_node_ids
        ]

    def rank_paths(self) -> tuple[tuple[int, ...], ...]:
        """Each node's path below the root (nodes 1..n), as ranks: a node is its parent's
        i-th listed child (its draft's i-th best token)."""
        ranks = [()]
        for node in range(1, self.node_nums):
            parent = int(self.parent[node])
            ranks.append((*ranks[parent], self.tree_config[parent].index(node)))
        return tuple(ranks[1:])

    @property
    def num_drafted(self) -> int:
        """Drafted tokens per verification (every node but the root)."""
        return self.node_nums - 1

    def on(self, device: torch.device) -> TokenTree:
        """This tree with the tables a verification reads on ``device``."""
        moved = copy.copy(self)
        for name in self.TABLES:
            setattr(moved, name, getattr(self, name).to(device))
        return moved

    def attention_mask(self, prefix: torch.Tensor, width: int) -> torch.Tensor:
        """[rows, n, width] bool: node j of row r, written at cache slot ``prefix[r] + j``,
        sees the row's slots ``0..prefix[r]-1`` and its own ancestors and itself."""
        keys = torch.arange(width, device=prefix.device)
        committed = keys[None, None, :] < prefix[:, None, None]
        offset = keys[None, :] - prefix[:, None]  # the node a key slot holds
        in_tree = (offset >= 0) & (offset < self.node_nums)
        rows = len(prefix)
        node = offset.clamp(0, self.node_nums - 1)[:, None, :].expand(rows, self.node_nums, width)
        sees = self.ancestors.expand(rows, -1, -1).gather(2, node) & in_tree[:, None, :]
        return committed | sees

    def accept(
        self, tokens: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The deepest node whose path the target agrees with.

        ``tokens`` [rows, n] the tree's tokens, ``targets`` [rows, n] the target's choice
        after each node (argmax, or its draw when sampling). A node is kept when it and each
        of its ancestors equal the target's choice at their parent. Returns ``(best, depth)``,
        both [rows]; siblings hold distinct tokens, so at most one node per depth is kept.
        """
        match = tokens == targets[:, self.parent]
        match[:, 0] = True
        rejected_above = (~match)[:, None, :] & self.ancestors[None]
        kept = ~rejected_above.any(dim=-1)
        depth = self.rotary_position_id_offset
        order = torch.arange(self.node_nums, device=tokens.device)
        score = torch.where(kept, depth * self.node_nums + self.node_nums - order, -1)
        best = score.argmax(dim=-1)
        return best, depth[best]

    def path_to(self, nodes: torch.Tensor) -> torch.Tensor:
        """[rows, depth] the nodes from the root to ``nodes`` [rows], padded by repeating the
        node (gathers past the node's depth read it again)."""
        chain = [nodes]
        for _ in range(self.depth - 1):
            chain.append(self.parent[chain[-1]])
        steps = torch.stack(chain[::-1], dim=1)  # [rows, depth]: ..., grandparent, parent, node
        depth = self.rotary_position_id_offset[nodes]
        shift = (self.depth - 1) - depth
        index = (torch.arange(self.depth, device=nodes.device)[None, :] + shift[:, None]).clamp(
            max=self.depth - 1
        )
        return steps.gather(1, index)
