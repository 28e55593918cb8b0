"""NxD Inference's ``DynamicTokenTree``: the tensor helpers of a draft tree grown while drafting.

Unlike a ``token_tree_config`` tree (:class:`~nxdplug.plugin_api.TokenTree`), a dynamic tree's
shape is chosen step by step: draft step 0 gives the root ``branching_factor`` children, and each
later step gives ``num_inputs`` chosen nodes of the previous step ``branching_factor`` children
each. Nodes are numbered in drafting order (the root 0, step 0's children ``1..bf``, then step
s's ``bf * num_inputs`` children after step s-1's), so ``step`` steps draft
``1 + bf + (step - 1) * num_inputs * bf`` nodes, the tree's speculation length.

Per batch row the tree is held as tensors:

- an attention mask ``[bs, 1, n, n]``: row i marks the nodes node i sees (its ancestors, and
  itself once it has been expanded or :meth:`DynamicTokenTree.update_attention_mask_for_leaf`
  ran);
- an adjacency matrix ``[bs, n, n]``: ``adj[p, c]`` set when node c is a child of node p.

Positions given to the helpers (``input_position_ids``, ``position_ids``) are node ids plus
``position_ids_offset`` (a ``[bs, 1]`` tensor or a number), which they subtract. The names,
arguments and results (shapes and dtypes) are NxD Inference's; one result differs on purpose
(:meth:`DynamicTokenTree.compute_cumulative_draft_prob` counts every ancestor).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

PARAMS = {
    "step": "draft steps (the tree's depth below the root)",
    "branching_factor": "children per expanded node",
    "num_inputs": "nodes expanded per step after the first",
    "num_verification_token": "nodes the target verifies",
}
Offset = torch.Tensor | int


def _params_listing() -> str:
    return ", ".join(f"{name!r} ({meaning})" for name, meaning in PARAMS.items())


def _level_nodes(step: int, branching_factor: int, num_inputs: int) -> range:
    """The node ids drafted at ``step``."""
    if step == 0:
        return range(1, 1 + branching_factor)
    first = 1 + branching_factor + (step - 1) * branching_factor * num_inputs
    return range(first, first + branching_factor * num_inputs)


def _batch_index(tensor: torch.Tensor, dims: int) -> torch.Tensor:
    """``arange(bs)`` shaped to index a tensor's batch next to ``dims`` index dimensions."""
    return torch.arange(tensor.shape[0], device=tensor.device).view(-1, *([1] * dims))


def _mask_rows(mask: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """Rows ``nodes`` [bs, m] of a [bs, 1, n, n] mask, as [bs, 1, m, n]."""
    return mask[_batch_index(mask, 1), 0, nodes][:, None]


class DynamicTokenTree:
    """A dynamic tree's sizes (``dynamic_tree_params``) and its tensor helpers (static)."""

    def __init__(self, dynamic_tree_params: Mapping[str, int]) -> None:
        if not isinstance(dynamic_tree_params, Mapping):
            raise ValueError(
                "DynamicTokenTree: dynamic_tree_params must be a dict with "
                f"{_params_listing()}; it is {dynamic_tree_params!r}"
            )
        self.dynamic_tree_params = dynamic_tree_params
        for name in PARAMS:
            value = dynamic_tree_params.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"DynamicTokenTree: dynamic_tree_params[{name!r}] ({PARAMS[name]}) must be "
                    f"a whole number >= 1; it is {value!r}. Give {_params_listing()}"
                )
        self.step = dynamic_tree_params["step"]
        self.branching_factor = dynamic_tree_params["branching_factor"]
        self.num_inputs = dynamic_tree_params["num_inputs"]
        self.num_verification_token = dynamic_tree_params["num_verification_token"]
        self.spec_len = self.get_spec_len()

    def get_spec_len(self) -> int:
        """Nodes of the full tree, the root included."""
        return _level_nodes(self.step - 1, self.branching_factor, self.num_inputs).stop

    @staticmethod
    def update_attention_mask(
        step: int,
        input_position_ids: torch.Tensor,
        prev_attn_mask: torch.Tensor,
        branching_factor: int,
        num_inputs: int,
        position_ids_offset: Offset,
    ) -> torch.Tensor:
        """The mask after draft step ``step``: the parents (``input_position_ids`` [bs, m]) see
        themselves and none of each other (:meth:`set_eye_at_indices`), then the step's new
        nodes, ``branching_factor`` per parent in parent order, copy their parent's row."""
        parents = input_position_ids - position_ids_offset
        new_nodes = _level_nodes(step, branching_factor, num_inputs)
        mask = DynamicTokenTree.set_eye_at_indices(prev_attn_mask, parents)
        inherited = _mask_rows(mask, parents).repeat_interleave(branching_factor, dim=2)
        if inherited.shape[2] < len(new_nodes) or new_nodes.stop > mask.shape[2]:
            raise ValueError(
                f"update_attention_mask: step {step} drafts nodes {new_nodes.start}.."
                f"{new_nodes.stop - 1}, but {parents.shape[1]} parents give "
                f"{inherited.shape[2]} children and the mask holds {mask.shape[2]} nodes"
            )
        mask[:, :, new_nodes.start : new_nodes.stop] = inherited[:, :, : len(new_nodes)]
        return mask

    @staticmethod
    def set_eye_at_indices(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """``b`` [bs, 1, n, n] with the rows and columns ``a`` [bs, m] lists set to the identity
        where they cross (each listed node sees itself, no other listed node); a new tensor of
        b's dtype promoted with the default float dtype, as NxD Inference's."""
        n = b.shape[-1]
        listed = torch.zeros(b.shape[0], n, dtype=torch.bool, device=b.device)
        listed[_batch_index(b, 1), a] = True
        crossing = (listed[:, :, None] & listed[:, None, :])[:, None]
        dtype = torch.promote_types(b.dtype, torch.get_default_dtype())
        return torch.where(crossing, torch.eye(n, dtype=dtype, device=b.device), b)

    @staticmethod
    def get_draft_attention_mask(
        attn_mask: torch.Tensor, input_position_ids: torch.Tensor, position_ids_offset: Offset
    ) -> torch.Tensor:
        """The mask rows of the draft's inputs: [bs, 1, m, n]."""
        return _mask_rows(attn_mask, input_position_ids - position_ids_offset)

    @staticmethod
    def get_draft_rotary_position_ids(
        attn_mask: torch.Tensor, input_position_ids: torch.Tensor, position_ids_offset: Offset
    ) -> torch.Tensor:
        """How many nodes each draft input sees (its rotary position): [bs, m], the sum's dtype
        of the mask (float for a float mask)."""
        return _mask_rows(attn_mask, input_position_ids - position_ids_offset)[:, 0].sum(-1)

    @staticmethod
    def replace_with_indices(
        original_tensor: torch.Tensor, values_to_replace: torch.Tensor
    ) -> torch.Tensor:
        """For each value of ``values_to_replace`` [bs, k, m], the first index of its row of
        ``original_tensor`` [bs, n] that holds it, n where none does: int64 [bs, k, m]."""
        values = values_to_replace.to(original_tensor.device)
        hits = values[..., None] == original_tensor[:, None, None, :]
        first = hits.to(torch.uint8).argmax(-1)
        return torch.where(hits.any(-1), first, original_tensor.shape[-1])

    @staticmethod
    def get_path(attention_mask: torch.Tensor, verified_position_ids: torch.Tensor) -> torch.Tensor:
        """Each verified node's path (``verified_position_ids`` [bs, V], node ids of the mask),
        as indices into the verified list: float32 [bs, V, V].

        A row lists the verified nodes its mask row sees (of the V highest node ids it sees,
        mapped to their first index in the list), ascending; a seen node missing from the list
        counts as V. The rest of the row is :meth:`generate_and_fill_tensor`'s at the same
        places: with every seen node listed once, the indices not on the path, ascending.
        """
        num_verified = verified_position_ids.shape[1]
        n = attention_mask.shape[-1]
        if num_verified > n:
            raise ValueError(
                f"get_path: {num_verified} verified nodes, more than the mask's {n} nodes"
            )
        seen = _mask_rows(attention_mask, verified_position_ids)[:, 0] == 1  # [bs, V, n]
        seen_later = seen.flip(-1).cumsum(-1).flip(-1) - seen.long()
        kept = seen & (seen_later < num_verified)
        nodes = torch.arange(n, device=attention_mask.device).expand(len(seen), 1, n)
        list_index = DynamicTokenTree.replace_with_indices(verified_position_ids, nodes)
        on_path = torch.where(kept, list_index, num_verified).sort(-1).values[..., :num_verified]
        rest = DynamicTokenTree.generate_and_fill_tensor(on_path, num_verified)
        slots = torch.arange(num_verified, device=attention_mask.device)
        return torch.where(slots < kept.sum(-1, keepdim=True), on_path.float(), rest)

    @staticmethod
    def get_selected_path(all_path: torch.Tensor, selected_idx: torch.Tensor) -> torch.Tensor:
        """Path ``selected_idx`` [bs, 1] of ``all_path`` [bs, paths, L]: [bs, L]."""
        return all_path[_batch_index(all_path, 1), selected_idx].squeeze(1)

    @staticmethod
    def generate_and_fill_tensor(input_tensor: torch.Tensor, n: int) -> torch.Tensor:
        """Per row of ``input_tensor`` [a, b, m] (read as int64): -1 for each of 0..n-1 the row
        holds, then the others ascending: float32 [a, b, n]."""
        values = input_tensor.long()
        candidates = torch.arange(n, device=values.device)
        held = (values[..., None, :] == candidates[:, None]).any(-1)
        return torch.where(held, -1, candidates).sort(-1).values.float()

    @staticmethod
    def get_target_cache_scatter_index(path: torch.Tensor) -> torch.Tensor:
        """Where each node's cache row goes when a path is kept, per path [bs, paths, L] of
        node ids: the path's j-th node to j, a node off it (a shorter path) stays: int64."""
        slots = torch.arange(path.shape[-1], device=path.device).expand_as(path)
        return slots.scatter(2, path, slots)

    @staticmethod
    def get_draft_hidden(
        all_hidden: torch.Tensor, input_position_ids: torch.Tensor, position_ids_offset: Offset
    ) -> torch.Tensor:
        """The hidden states ``all_hidden`` [bs, n, H] of the draft's inputs: [bs, m, H]."""
        return all_hidden[_batch_index(all_hidden, 1), input_position_ids - position_ids_offset]

    @staticmethod
    def get_parent_position_ids(
        attention_mask: torch.Tensor, position_ids: torch.Tensor, position_ids_offset: Offset
    ) -> torch.Tensor:
        """Each node's parent, read from the mask: the last column its row marks (the largest
        value, rightmost), plus the offset; [bs, m]. That is the parent while the node's row
        does not see itself (as :meth:`update_attention_mask` leaves a new node), the node
        itself once it does."""
        rows = _mask_rows(attention_mask, position_ids - position_ids_offset)[:, 0]
        columns = torch.arange(rows.shape[-1], device=rows.device)
        marked = rows == rows.amax(-1, keepdim=True)
        return (marked * columns).amax(-1) + position_ids_offset

    @staticmethod
    def new_get_parent_position_ids(
        adj: torch.Tensor, position_ids: torch.Tensor, position_ids_offset: Offset
    ) -> torch.Tensor:
        """Each node's parent in the adjacency matrix ``adj`` [bs, n, n]: the first row holding
        its column's largest value (0 for the root), plus the offset; [bs, m]."""
        children = position_ids - position_ids_offset
        columns = adj.transpose(1, 2)[_batch_index(adj, 1), children]  # [bs, m, n]
        if columns.dtype == torch.bool:
            columns = columns.to(torch.uint8)
        return columns.argmax(-1) + position_ids_offset

    @staticmethod
    def update_adj_matrix(
        prev_adj_matrix: torch.Tensor,
        input_position_ids: torch.Tensor,
        new_position_id: torch.Tensor,
        position_ids_offset: Offset,
    ) -> torch.Tensor:
        """A copy of ``prev_adj_matrix`` [bs, n, n] with an edge from every parent
        (``input_position_ids`` [bs, a]) to every new node (``new_position_id`` [bs, b], node
        ids, no offset)."""
        parents = input_position_ids - position_ids_offset
        updated = prev_adj_matrix.clone()
        updated[_batch_index(updated, 2), parents[:, :, None], new_position_id[:, None, :]] = 1
        return updated

    @staticmethod
    def compute_cumulative_draft_prob(
        adj_matrix: torch.Tensor, node_values: torch.Tensor
    ) -> torch.Tensor:
        """Each node's value (``node_values`` [bs, n]) times its ancestors' in ``adj_matrix``
        [bs, n, n]: float32 [bs, n], summed as logs (of value + 1e-10), a value counted once
        per path to the node.

        Unlike NxD Inference's, every ancestor counts: it sums the adjacency's powers only up
        to floor(log2 n) + 1, so a node deeper than that (a chain of 5 nodes already) misses
        its highest ancestors. The two agree on trees no deeper than that.
        """
        edges = adj_matrix.to(torch.float32)
        logs = torch.log(node_values.to(torch.float32) + 1e-10)[:, None, :]  # [bs, 1, n]
        total = logs
        reached = logs
        for _ in range(node_values.shape[-1] - 1):  # a path has at most n - 1 edges
            reached = torch.bmm(reached, edges)  # logs carried one more edge down
            total = total + reached
        return torch.exp(total[:, 0])

    @staticmethod
    def convert_logits_to_prob(logits: torch.Tensor) -> torch.Tensor:
        """``logits`` divided by their sum over the last dimension (no softmax: the inputs are
        taken as non-negative scores), float32."""
        scores = logits.to(torch.float32)
        return scores / scores.sum(-1, keepdim=True)

    @staticmethod
    def get_generated_token_position_ids(
        step: int, branching_factor: int, num_inputs: int, bs: int
    ) -> torch.Tensor:
        """The node ids draft step ``step`` creates, for each of ``bs`` rows: int64."""
        nodes = _level_nodes(step, branching_factor, num_inputs)
        return torch.arange(nodes.start, nodes.stop).expand(bs, -1)

    @staticmethod
    def get_target_active_mask(
        matrix: torch.Tensor, input_indices: torch.Tensor, indices_offset: Offset
    ) -> torch.Tensor:
        """The mask ``matrix`` [bs, 1, n, n] between the verified nodes (``input_indices``
        [bs, V]): [bs, 1, V, V]."""
        nodes = input_indices - indices_offset
        picked = matrix[_batch_index(matrix, 2), 0, nodes[:, :, None], nodes[:, None, :]]
        return picked[:, None]

    @staticmethod
    def get_draft_input_ids(
        candidate_input_ids: torch.Tensor,
        input_position_ids: torch.Tensor,
        position_ids_offset: Offset,
    ) -> torch.Tensor:
        """The tokens ``candidate_input_ids`` [bs, n] of the draft's inputs: [bs, m]."""
        nodes = input_position_ids - position_ids_offset
        return candidate_input_ids[_batch_index(candidate_input_ids, 1), nodes]

    @staticmethod
    def get_comp(
        candidate_input_ids: torch.Tensor, target_tokens: torch.Tensor, paths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafted and the target's tokens ([bs, n] each) along each path [bs, paths, L],
        to compare: two [bs, paths, L]."""
        batch = _batch_index(paths, 2)
        return candidate_input_ids[batch, paths], target_tokens[batch, paths]

    @staticmethod
    def update_attention_mask_for_leaf(attn_mask: torch.Tensor) -> torch.Tensor:
        """``attn_mask`` [..., n, n] as booleans, each node seeing itself (the leaves, which
        were never expanded)."""
        n = attn_mask.shape[-1]
        if attn_mask.shape[-2] != n:
            raise ValueError(
                f"update_attention_mask_for_leaf: the mask must be square; it is "
                f"{tuple(attn_mask.shape)}"
            )
        return (attn_mask != 0) | torch.eye(n, dtype=torch.bool, device=attn_mask.device)
