"""NxD Inference's ``TokenTree`` (``nxdplug.nxdi.modules.eagle.token_tree``): its tables, as
NxD Inference's own unit tests check them on perfect and irregular trees, the verification's
mask and acceptance, and the errors of a config that is not a tree."""

from __future__ import annotations

import json

import pytest
import torch

from nxdplug import NeuronConfig
from nxdplug.config.token_tree import TokenTreeError
from nxdplug.errors import ConfigError
from nxdplug.nxdi.modules.eagle.token_tree import TokenTree


def perfect_tree(branches: int, depth: int) -> dict[str, list[str]]:
    """A perfect ``branches``-ary tree of ``depth`` levels, in JSON's string form."""
    tree, next_id, level = {}, 1, [0]
    for _ in range(depth - 1):
        children_level = []
        for node in level:
            children = list(range(next_id, next_id + branches))
            next_id += branches
            tree[str(node)] = [str(c) for c in children]
            children_level += children
        level = children_level
    return tree


IRREGULAR = [
    {0: [1, 2, 3], 1: [4, 5], 2: [6]},
    {0: [1, 2], 1: [3, 4, 5], 2: [6], 4: [7], 6: [8, 9], 8: [10]},
    {0: [1], 1: [2], 2: [3]},  # a chain
    {0: [1, 2, 3, 4], 1: [5, 6], 3: [7], 5: [8], 7: [9]},
]


def leaf_paths(tree: TokenTree) -> list[list[int]]:
    """Every root-to-leaf path, depth first, children in their order (walked by hand)."""
    paths = []

    def walk(node: int, path: list[int]) -> None:
        children = tree.tree_config[node]
        if not children:
            paths.append([*path, node])
        for child in children:
            walk(child, [*path, node])

    walk(0, [])
    return paths


@pytest.mark.parametrize("branches", [2, 3, 5])
def test_perfect_tree_tables(branches: int) -> None:
    tree = TokenTree(perfect_tree(branches, 3))
    assert tree.depth == 3
    assert tree.node_nums == 1 + branches + branches**2
    assert tree.width == branches**2 and tree.width_wo_leaf == branches
    assert tree.drafted_nums == [0, 1, 1 + branches, 1 + branches + branches**2]
    expected_paths = [
        [0, 1 + a, 1 + branches + a * branches + b]
        for a in range(branches)
        for b in range(branches)
    ]
    assert tree.path.tolist() == expected_paths
    assert tree.parent_path.tolist() == expected_paths
    assert tree.rotary_position_id_offset.tolist() == [0] + [1] * branches + [2] * branches**2
    for level in range(2):
        assert tree.position_id_offset[level] == [
            tree.drafted_nums[level] + j for j in range(tree.width)
        ]
    assert tree.topk_permute_index[0] == list(range(branches))
    assert tree.topk_permute_index[1] == list(range(branches**2))
    assert tree.draft_hidden_gather_index[1] == [
        i for i in range(branches) for _ in range(branches)
    ]


@pytest.mark.parametrize("config", IRREGULAR, ids=lambda c: f"{len(c)}-parents")
def test_irregular_tree_tables(config: dict[int, list[int]]) -> None:
    tree = TokenTree(config)
    nodes = set(config) | {c for children in config.values() for c in children}
    assert tree.node_nums == len(nodes)
    assert sum(tree.level_node_count) == tree.node_nums
    assert tree.drafted_nums[-1] == tree.node_nums
    parent = {c: p for p, children in config.items() for c in children}

    def chain(node: int) -> list[int]:
        return [0] if node == 0 else [*chain(parent[node]), node]

    # Each path runs root to leaf through parent-child edges, level by level, then the
    # nodes off it ascending; the leaves are all covered, in depth-first order.
    assert [row.tolist()[: len(p)] for row, p in zip(tree.path, leaf_paths(tree), strict=True)] == (
        leaf_paths(tree)
    )
    for row, path in zip(tree.path_permute_mask.tolist(), leaf_paths(tree), strict=True):
        assert row == path + sorted(nodes - set(path))
        assert tree.path_permute_mask.shape[1] == tree.node_nums
    for scatter, path in zip(tree.cache_scatter_indices, leaf_paths(tree), strict=True):
        assert [scatter[node] for node in path] == list(range(len(path)))
        assert sorted(scatter) == list(range(tree.node_nums))
    # Node i sees exactly its ancestors and itself.
    for node in nodes:
        assert tree.full_tree_attn_mask[node].nonzero().flatten().tolist() == chain(node)
    for level, ids in enumerate(tree.level_node_ids[:-1]):
        rows = tree.draft_tree_attn_mask[level]
        for i, node in enumerate(ids):
            assert rows[i].nonzero().flatten().tolist() == chain(node)[:-1]
    assert tree.rotary_position_id_offset.tolist() == [len(chain(n)) - 1 for n in sorted(nodes)]
    # The level's top-k outputs (k the widest node's children) picked as the next level.
    for level, ids in enumerate(tree.level_node_ids[:-1]):
        widest = max(tree.level_child[level])
        picked = tree.topk_permute_index[level]
        sources = tree.draft_hidden_gather_index[level]
        expected = [
            (i, rank) for i, node in enumerate(ids) for rank in range(len(tree.tree_config[node]))
        ]
        assert [(p // widest, p % widest) for p in picked] == expected
        assert sources == [i for i, _ in expected]
    assert tree.level_internal_node_count == [
        sum(1 for n in ids if tree.tree_config[n]) for ids in tree.level_node_ids
    ]


def test_json_configs_with_string_ids_and_omitted_leaves(tmp_path) -> None:
    as_ints = TokenTree({0: [1, 2], 1: [3], 2: [], 3: []})
    as_json = TokenTree(json.loads(json.dumps({"0": ["1", "2"], "1": ["3"]})))
    assert as_json.tree_config == as_ints.tree_config == {0: [1, 2], 1: [3], 2: [], 3: []}
    assert torch.equal(as_json.full_tree_attn_mask, as_ints.full_tree_attn_mask)
    path = tmp_path / "tree.json"
    path.write_text(json.dumps({"0": [1, 2], "1": [3]}))
    config = NeuronConfig(token_tree_config=str(path))
    assert config.enable_token_tree and TokenTree(config.token_tree_config).node_nums == 4
    assert not NeuronConfig().enable_token_tree
    with pytest.raises(ConfigError, match="not a readable JSON file"):
        NeuronConfig(token_tree_config=str(tmp_path / "missing.json"))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({}, "must map each node to its children"),
        ([[0], [1]], "must map each node to its children"),
        ({1: [2]}, "no root"),
        ({0: [1, 2], 1: [2]}, "child of node 0 and of node 1"),
        ({0: [1], 1: [0]}, "child of the root"),
        ({0: [2, 1]}, "level by level"),
        ({0: [1, 2], 1: [4], 2: [3]}, "level by level"),
        ({0: [1], 5: [6]}, r"nodes \[5, 6\] are not reachable"),
        ({0: []}, "only the root"),
        ({0: ["x"]}, "not a whole number"),
        ({0: [-1]}, "negative"),
        ({0: 1}, "must list the node's children"),
    ],
)
def test_configs_that_are_not_trees_are_refused(config, message) -> None:
    with pytest.raises(TokenTreeError, match=message):
        TokenTree(config)


def test_mask_and_acceptance_follow_the_tree() -> None:
    tree = TokenTree({0: [1, 2], 1: [3, 4], 3: [5]})
    mask = tree.attention_mask(torch.tensor([2, 0]), 9)
    # Row 0: node j at slot 2 + j sees slots 0-1 and its ancestors' slots.
    assert mask[0, 5].nonzero().flatten().tolist() == [0, 1, 2, 3, 5, 7]
    assert mask[0, 2].nonzero().flatten().tolist() == [0, 1, 2, 4]
    assert mask[1, 4].nonzero().flatten().tolist() == [0, 1, 4]
    tokens = torch.tensor([[9, 10, 11, 12, 13, 14], [9, 10, 11, 12, 13, 14]])
    # Row 0: the target follows 0 -> 1 (10) -> 3 (12) -> 5 (14); row 1: it picks node 2.
    targets = torch.tensor([[10, 12, 0, 14, 0, 7], [11, 0, 3, 0, 0, 0]])
    best, depth = tree.accept(tokens, targets)
    assert best.tolist() == [5, 2] and depth.tolist() == [3, 1]
    assert tree.path_to(best).tolist() == [[0, 1, 3, 5], [0, 2, 2, 2]]
    targets[0, 0] = 99  # nothing agrees: the root alone
    assert tree.accept(tokens, targets)[0].tolist() == [0, 2]


def test_rank_paths_and_the_tree_they_give() -> None:
    from nxdplug.config.token_tree import sorted_paths, tree_config_of_paths

    tree = TokenTree({0: [1, 2], 1: [3, 4, 5], 2: [6], 4: [7]})
    paths = ((0,), (1,), (0, 0), (0, 1), (0, 2), (1, 0), (0, 1, 0))
    assert tree.rank_paths() == paths
    shuffled = [list(p) for p in reversed(paths)]
    assert sorted_paths(shuffled) == paths
    assert TokenTree(tree_config_of_paths(shuffled)).tree_config == tree.tree_config
    # Medusa's ranks may skip: the root's children are its 1st and 3rd best tokens.
    assert tree_config_of_paths([[0], [2], [2, 1]]) == {0: [1, 2], 2: [3]}
    with pytest.raises(TokenTreeError, match=r"\[0, 1\] needs its prefix \[0\]"):
        tree_config_of_paths([[1], [0, 1]])
    with pytest.raises(TokenTreeError, match=r"repeat \[\[1\]\]"):
        tree_config_of_paths([[1], [0], [1]])
