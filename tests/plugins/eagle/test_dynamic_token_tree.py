"""NxD Inference's ``DynamicTokenTree`` (``nxdplug.nxdi.modules.eagle.dynamic_token_tree``): the
cases of its unit tests (test_dynamic_tree_utils.py), with expected values worked out by hand
from the helpers' documented meaning, and a tree grown over two draft steps."""

from __future__ import annotations

import pytest
import torch

from nxdplug.nxdi.modules.eagle.dynamic_token_tree import DynamicTokenTree


def seen(n: int, rows: dict[int, list[int]], batch: int = 1) -> torch.Tensor:
    """A [batch, 1, n, n] float mask in which row i marks the nodes ``rows[i]`` (no others)."""
    mask = torch.zeros(n, n)
    for row, columns in rows.items():
        mask[row, columns] = 1
    return mask.expand(batch, 1, n, n).clone()


def test_the_namespace_gives_the_eagle_plugins_objects() -> None:
    from nxdplug.nxdi.modules.eagle import dynamic_token_tree, hidden_state
    from nxdplug.plugins.eagle import dynamic_token_tree as plugin_tree
    from nxdplug.plugins.eagle import hidden_state as plugin_state

    assert dynamic_token_tree.DynamicTokenTree is plugin_tree.DynamicTokenTree
    assert hidden_state.HiddenStateRollingBuffer is plugin_state.HiddenStateRollingBuffer
    assert hidden_state.rolling_buffer_set_state is plugin_state.rolling_buffer_set_state


def test_params_and_speculation_length() -> None:
    params = {"step": 3, "branching_factor": 4, "num_inputs": 2, "num_verification_token": 6}
    tree = DynamicTokenTree(params)
    # The root, 4 children, then 2 expanded nodes x 4 children at each of the 2 later steps.
    assert tree.spec_len == 1 + 4 + 8 + 8 == tree.get_spec_len()
    assert (tree.step, tree.branching_factor, tree.num_inputs) == (3, 4, 2)
    assert tree.num_verification_token == 6 and tree.dynamic_tree_params is params
    with pytest.raises(ValueError, match=r"\['num_inputs'\] .* it is None"):
        DynamicTokenTree({"step": 3, "branching_factor": 4, "num_verification_token": 6})
    with pytest.raises(ValueError, match=r"\['step'\] .* whole number >= 1; it is 0"):
        DynamicTokenTree(params | {"step": 0})
    with pytest.raises(ValueError, match="must be a dict"):
        DynamicTokenTree([3, 4, 2, 6])


# --- update_attention_mask (bs 2, 20 nodes, branching factor 4, 2 inputs per step) ---

BF, NUM_INPUTS, N = 4, 2, 20


def test_step_0_gives_the_root_four_children_that_see_it() -> None:
    result = DynamicTokenTree.update_attention_mask(
        0,
        torch.tensor([[0], [0]]),
        torch.zeros(2, 1, N, N),
        BF,
        NUM_INPUTS,
        torch.tensor([[0], [0]]),
    )
    # The root now sees itself; nodes 1-4 copy its row.
    assert torch.equal(result, seen(N, {0: [0], 1: [0], 2: [0], 3: [0], 4: [0]}, batch=2))
    assert result.dtype == torch.float32
    # The same through an offset: positions 1 less the offset 1 are the root.
    shifted = DynamicTokenTree.update_attention_mask(
        0,
        torch.tensor([[1], [1]]),
        torch.zeros(2, 1, N, N),
        BF,
        NUM_INPUTS,
        torch.tensor([[1], [1]]),
    )
    assert torch.equal(shifted, result)


def test_step_1_gives_each_parent_four_children_after_step_0s() -> None:
    result = DynamicTokenTree.update_attention_mask(
        1, torch.tensor([[1, 2], [2, 3]]), torch.zeros(2, 1, N, N), BF, NUM_INPUTS, 0
    )
    # Step 1 drafts nodes 5-12: 5-8 under the first parent, 9-12 under the second; each parent
    # sees itself and not the other.
    for row, (first, second) in enumerate([(1, 2), (2, 3)]):
        rows = {first: [first], second: [second]}
        rows |= {child: [first] for child in range(5, 9)}
        rows |= {child: [second] for child in range(9, 13)}
        assert torch.equal(result[row], seen(N, rows)[0])


def test_parents_stop_seeing_each_other_and_keep_their_ancestors() -> None:
    before = seen(6, {0: [0], 1: [0, 1, 2], 2: [0, 2, 1]})
    result = DynamicTokenTree.set_eye_at_indices(before.long(), torch.tensor([[1, 2]]))
    assert torch.equal(result, seen(6, {0: [0], 1: [0, 1], 2: [0, 2]}))
    assert result.dtype == torch.float32  # a long mask comes back as floats, as NxD Inference's


# --- a tree grown over two steps (branching factor 2, one input per step: 5 nodes) ---


def grown_tree() -> torch.Tensor:
    """Step 0 drafts nodes 1-2 under the root; step 1 expands node 2 into nodes 3-4."""
    mask = torch.zeros(1, 1, 5, 5)
    mask = DynamicTokenTree.update_attention_mask(0, torch.tensor([[0]]), mask, 2, 1, 0)
    return DynamicTokenTree.update_attention_mask(1, torch.tensor([[2]]), mask, 2, 1, 0)


def test_a_grown_tree_reads_back_its_parents_positions_and_paths() -> None:
    mask = grown_tree()
    assert torch.equal(mask, seen(5, {0: [0], 1: [0], 2: [0, 2], 3: [0, 2], 4: [0, 2]}))
    nodes = torch.tensor([[1, 3, 4]])
    # A node not yet expanded does not see itself: its last marked column is its parent.
    assert DynamicTokenTree.get_parent_position_ids(mask, nodes + 7, 7).tolist() == [[7, 9, 9]]
    rotary = DynamicTokenTree.get_draft_rotary_position_ids(mask, nodes, 0)
    assert rotary.tolist() == [[1.0, 2.0, 2.0]] and rotary.dtype == torch.float32
    assert torch.equal(
        DynamicTokenTree.get_draft_attention_mask(mask, nodes, 0),
        torch.tensor([[[[1.0, 0, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 1, 0, 0]]]]),
    )
    full = DynamicTokenTree.update_attention_mask_for_leaf(mask[:, 0])
    assert full.dtype == torch.bool
    assert full[0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 0, 1, 1, 0],
        [1, 0, 1, 0, 1],
    ]
    # Verifying nodes 0, 2, 4: node 4's path is 0 -> 2 -> 4, i.e. list indices 0, 1, 2.
    paths = DynamicTokenTree.get_path(full[:, None].float(), torch.tensor([[0, 2, 4]]))
    assert paths.tolist() == [[[0, 1, 2], [0, 1, 2], [0, 1, 2]]]
    paths = DynamicTokenTree.get_path(full[:, None].float(), torch.tensor([[0, 1, 2, 4]]))
    # Node 1 sees the root: [0, 1], then the others; node 4 sees 0, 2, 4: [0, 2, 3], then 1.
    assert paths.tolist() == [[[0, 1, 2, 3], [0, 1, 2, 3], [0, 2, 1, 3], [0, 2, 3, 1]]]


# --- the draft's inputs ---


def test_get_draft_attention_mask_and_rotary_positions() -> None:
    mask = seen(6, {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 2, 4], 5: [0, 2, 4, 5]}, 2)
    rows = DynamicTokenTree.get_draft_attention_mask(
        mask, torch.tensor([[0, 1, 2], [1, 3, 5]]), torch.tensor([[0], [1]])
    )
    assert rows.shape == (2, 1, 3, 6)
    assert rows[0, 0].tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0]]
    assert rows[1, 0].tolist() == [[1, 0, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0], [1, 0, 1, 0, 1, 0]]
    rotary = DynamicTokenTree.get_draft_rotary_position_ids(
        mask, torch.tensor([[0, 1, 2], [0, 3, 5]]), 0
    )
    assert rotary.tolist() == [[1, 2, 2], [1, 3, 4]] and rotary.shape == (2, 3)


def test_get_draft_hidden_and_input_ids() -> None:
    hidden = torch.arange(2 * 10 * 4).view(2, 10, 4).float()
    drafted = DynamicTokenTree.get_draft_hidden(
        hidden, torch.tensor([[1, 3, 5], [3, 5, 7]]), torch.tensor([[0], [1]])
    )
    assert drafted.shape == (2, 3, 4)
    # Row b, node p holds 40 b + 4 p .. 40 b + 4 p + 3.
    assert drafted[:, :, 0].tolist() == [[4, 12, 20], [48, 56, 64]]
    assert torch.equal(drafted[1, 2], torch.tensor([64.0, 65, 66, 67]))
    tokens = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    ids = DynamicTokenTree.get_draft_input_ids(
        tokens, torch.tensor([[2, 4], [5, 1]]), torch.tensor([[1], [1]])
    )
    assert ids.tolist() == [[11, 13], [24, 20]]


def test_get_generated_token_position_ids() -> None:
    def ids(step: int) -> torch.Tensor:
        return DynamicTokenTree.get_generated_token_position_ids(step, 3, 2, 4)

    # Step 0: the root's 3 children; then 2 inputs x 3 children a step.
    assert ids(0).tolist() == [[1, 2, 3]] * 4
    assert ids(1).tolist() == [[4, 5, 6, 7, 8, 9]] * 4
    assert ids(2).tolist() == [[10, 11, 12, 13, 14, 15]] * 4
    assert ids(3).tolist() == [list(range(16, 22))] * 4
    assert ids(2).dtype == torch.int64


# --- the tree's structure ---

NXDI_MASK_ROWS = {
    0: [0],
    1: [0, 1],
    2: [0, 2],
    3: [0, 1, 3],
    4: [0, 2, 4],
    **{row: [0, 2, 5, 6] for row in range(5, 10)},
}


def test_get_path_lists_each_verified_nodes_ancestors_first() -> None:
    """NxD Inference's test_get_path mask; its test checks only the rows' pattern, these are
    the paths: the seen verified nodes ascending, then the others ascending."""
    mask = seen(10, NXDI_MASK_ROWS, batch=2)
    result = DynamicTokenTree.get_path(mask, torch.tensor([[0, 1, 2, 4], [0, 1, 2, 3]]))
    assert result.dtype == torch.float32 and result.shape == (2, 4, 4)
    assert result[0].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 2, 1, 3], [0, 2, 3, 1]]
    assert result[1].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 2, 1, 3], [0, 1, 3, 2]]


def test_get_path_keeps_the_highest_seen_nodes_and_marks_unverified_ones() -> None:
    # Verifying nodes 0 and 4 (2 slots): node 4 sees 0, 2, 4, of which only the 2 highest
    # count; node 2 is not verified, so it shows as 2 (the number verified).
    mask = seen(10, NXDI_MASK_ROWS)
    assert DynamicTokenTree.get_path(mask, torch.tensor([[0, 4]])).tolist() == [[[0, 1], [1, 2]]]


def test_replace_with_indices_and_generate_and_fill_tensor() -> None:
    original = torch.tensor([[5, 7, 5, 9]])
    found = DynamicTokenTree.replace_with_indices(original, torch.tensor([[[5, 9, 3], [7, 7, -1]]]))
    assert found.tolist() == [[[0, 3, 4], [1, 1, 4]]] and found.dtype == torch.int64
    filled = DynamicTokenTree.generate_and_fill_tensor(torch.tensor([[[0.0, 2.0, 7.0]]]), 4)
    assert filled.tolist() == [[[-1, -1, 1, 3]]] and filled.dtype == torch.float32


def test_get_selected_path() -> None:
    all_path = torch.tensor([[[0, 1, 3, 2], [0, 1, 2, 3]], [[0, 2, 1, 3], [0, 3, 1, 2]]])
    result = DynamicTokenTree.get_selected_path(all_path, torch.tensor([[0], [1]]))
    assert result.tolist() == [[0, 1, 3, 2], [0, 3, 1, 2]]


def test_get_target_cache_scatter_index() -> None:
    path = torch.tensor(
        [[[0, 1, 3, 5, 2, 4], [0, 2, 4, 1, 3, 5]], [[0, 1, 2, 4, 5, 3], [0, 1, 2, 3, 4, 5]]]
    )
    result = DynamicTokenTree.get_target_cache_scatter_index(path)
    # Node path[j] goes to slot j: the inverse permutation (NxD Inference's expected values).
    assert result.tolist() == [
        [[0, 1, 4, 2, 5, 3], [0, 3, 1, 4, 2, 5]],
        [[0, 1, 2, 5, 3, 4], [0, 1, 2, 3, 4, 5]],
    ]


def test_get_parent_position_ids_on_nxd_inferences_mask() -> None:
    """NxD Inference's case and expected values. Its messages call these the parents ("second
    node should have root as parent"), but the asserted values are the nodes themselves: every
    row of that mask sees its own node, which is the last column it marks."""
    mask = seen(10, NXDI_MASK_ROWS, batch=2).long()
    positions = torch.tensor([[0, 1, 2, 4], [0, 1, 2, 3]])
    result = DynamicTokenTree.get_parent_position_ids(mask, positions, torch.tensor([[0], [0]]))
    assert result.tolist() == [[0, 1, 2, 4], [0, 1, 2, 3]]
    # A mask of other values: the rightmost of the row's largest, as NxD Inference's argmax.
    weights = torch.tensor([[[[0.0, 2.0, 1.0, 2.0, 0.5]] * 5]])
    assert DynamicTokenTree.get_parent_position_ids(weights, torch.tensor([[0]]), 0).tolist() == [
        [3]
    ]


def test_new_get_parent_position_ids_reads_the_adjacency() -> None:
    adj = torch.zeros(2, 10, 10)
    adj[:, [0, 1, 2, 3], [1, 2, 3, 4]] = 1  # the chain 0 -> 1 -> 2 -> 3 -> 4
    positions = torch.tensor([[1, 2, 3, 4], [2, 3, 4, 5]])
    result = DynamicTokenTree.new_get_parent_position_ids(adj, positions, torch.tensor([[0], [1]]))
    assert result.tolist() == [[0, 1, 2, 3], [1, 2, 3, 4]]
    # The root has no parent: row 0.
    assert (
        DynamicTokenTree.new_get_parent_position_ids(adj, torch.tensor([[0, 0]] * 2), 0).tolist()
        == [[0, 0]] * 2
    )


def test_update_adj_matrix_links_every_parent_to_every_new_node() -> None:
    before = torch.zeros(2, 10, 10, dtype=torch.long)
    for parents, offset in (
        (torch.tensor([[0], [0]]), 0),
        (torch.tensor([[0], [1]]), torch.tensor([[0], [1]])),
    ):
        result = DynamicTokenTree.update_adj_matrix(
            before, parents, torch.tensor([[1, 2], [2, 3]]), offset
        )
        assert result[0].nonzero().tolist() == [[0, 1], [0, 2]]
        assert result[1].nonzero().tolist() == [[0, 2], [0, 3]]
        assert result.dtype == torch.long and not before.any()  # a copy
    two_parents = DynamicTokenTree.update_adj_matrix(
        before[:1], torch.tensor([[1, 2]]), torch.tensor([[3, 4]]), 0
    )
    assert two_parents[0].nonzero().tolist() == [[1, 3], [1, 4], [2, 3], [2, 4]]


def test_get_target_active_mask() -> None:
    # matrix[b, 0, i, j] = 100 b + 10 i + j
    matrix = (
        torch.arange(2)[:, None, None] * 100 + torch.arange(10)[:, None] * 10 + torch.arange(10)
    )[:, None]
    indices = torch.tensor([[2, 4, 6], [3, 5, 7]])
    result = DynamicTokenTree.get_target_active_mask(matrix, indices, 2)
    assert result.shape == (2, 1, 3, 3)
    assert result[0, 0].tolist() == [[0, 2, 4], [20, 22, 24], [40, 42, 44]]
    assert result[1, 0].tolist() == [[111, 113, 115], [131, 133, 135], [151, 153, 155]]
    result = DynamicTokenTree.get_target_active_mask(matrix, indices, 0)
    assert result[0, 0].tolist() == [[22, 24, 26], [42, 44, 46], [62, 64, 66]]
    assert result[1, 0].tolist() == [[133, 135, 137], [153, 155, 157], [173, 175, 177]]


def test_get_comp_reads_both_token_lists_along_each_path() -> None:
    drafted = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
    target = torch.tensor([[30, 31, 32, 33], [40, 41, 42, 43]])
    paths = torch.tensor([[[0, 1, 2], [0, 2, 3], [3, 3, 0]], [[1, 0, 2], [2, 2, 2], [0, 3, 1]]])
    drafted_on, target_on = DynamicTokenTree.get_comp(drafted, target, paths)
    assert drafted_on.tolist() == [
        [[10, 11, 12], [10, 12, 13], [13, 13, 10]],
        [[21, 20, 22], [22, 22, 22], [20, 23, 21]],
    ]
    assert target_on.tolist() == [
        [[30, 31, 32], [30, 32, 33], [33, 33, 30]],
        [[41, 40, 42], [42, 42, 42], [40, 43, 41]],
    ]


def test_update_attention_mask_for_leaf() -> None:
    mask = torch.zeros(2, 4, 4)
    mask[:, :, 0] = 1
    mask[:, 1, 1] = 1
    mask[:, 2, 2] = 1
    result = DynamicTokenTree.update_attention_mask_for_leaf(mask)
    expected = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]]
    assert result.dtype == torch.bool and result.int().tolist() == [expected] * 2


# --- draft probabilities ---

# NxD Inference's two trees: 0 -> 1, 1 -> {2, 3}, 2 -> 4; and 0 -> {1, 2}, 1 -> 3, 2 -> 4.
ADJ = torch.zeros(2, 5, 5, dtype=torch.float16)
ADJ[0, [0, 1, 1, 2], [1, 2, 3, 4]] = 1
ADJ[1, [0, 0, 1, 2], [1, 2, 3, 4]] = 1


def test_cumulative_draft_prob_multiplies_each_path() -> None:
    values = torch.tensor(
        [[0.5, 0.6, 0.7, 0.8, 0.9], [0.4, 0.5, 0.6, 0.7, 0.8]], dtype=torch.float16
    )
    result = DynamicTokenTree.compute_cumulative_draft_prob(ADJ, values)
    # E.g. node 4 of the first tree: 0.5 * 0.6 * 0.7 * 0.9.
    expected = torch.tensor([[0.5, 0.3, 0.21, 0.24, 0.189], [0.4, 0.2, 0.24, 0.14, 0.192]])
    assert result.dtype == torch.float32
    torch.testing.assert_close(result, expected, rtol=1e-3, atol=1e-3)


def test_cumulative_draft_prob_counts_every_ancestor_of_a_deep_node() -> None:
    """A chain of 5 nodes: NxD Inference's sum of adjacency powers stops at floor(log2 5) + 1 =
    3 edges and gives node 4 0.6 * 0.7 * 0.8 * 0.9 = 0.3024, without the root; here every
    ancestor counts (the documented difference)."""
    chain = torch.diag(torch.ones(4), 1)[None]
    result = DynamicTokenTree.compute_cumulative_draft_prob(
        chain, torch.tensor([[0.5, 0.6, 0.7, 0.8, 0.9]])
    )
    torch.testing.assert_close(result, torch.tensor([[0.5, 0.3, 0.21, 0.168, 0.1512]]))


def test_convert_logits_to_prob_divides_by_the_sum() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [5.0, 4.0, 3.0, 2.0, 1.0], [1.0] * 5])
    prob = DynamicTokenTree.convert_logits_to_prob(logits)
    expected = torch.tensor(
        [
            [1 / 15, 2 / 15, 3 / 15, 4 / 15, 5 / 15],
            [5 / 15, 4 / 15, 3 / 15, 2 / 15, 1 / 15],
            [0.2] * 5,
        ]
    )
    assert prob.dtype == torch.float32
    torch.testing.assert_close(prob, expected)
    assert DynamicTokenTree.convert_logits_to_prob(logits.half()).dtype == torch.float32
