"""CausalLMOutputWithTokens keeps transformers' ModelOutput rules with its faster assignment."""

import pytest
import torch
from torch.utils import _pytree as pytree
from transformers.modeling_outputs import CausalLMOutputWithPast

from nxdplug.runtime.outputs import CausalLMOutputWithTokens


@pytest.mark.parametrize(
    "given",
    [
        {"logits": torch.ones(2, 1, 3)},
        {"loss": torch.tensor(1.0), "logits": torch.ones(2, 1, 3)},
        {"logits": torch.ones(2, 1, 3), "hidden_states": (torch.zeros(1),)},
        {},
    ],
    ids=["logits", "loss-first", "hidden", "empty"],
)
def test_outputs_behave_as_transformers_model_outputs(given):
    ours, theirs = CausalLMOutputWithTokens(**given), CausalLMOutputWithPast(**given)
    assert list(ours.keys()) == list(theirs.keys())
    assert len(ours.to_tuple()) == len(theirs.to_tuple())
    for mine, reference in zip(ours.to_tuple(), theirs.to_tuple(), strict=True):
        assert mine is reference
    for name in ("loss", "logits", "cache", "hidden_states", "attentions"):
        assert getattr(ours, name) is getattr(theirs, name)
    assert ours.tokens is None


def test_tokens_and_later_assignments_become_keys_in_field_order():
    logits, tokens = torch.ones(1, 1, 4), torch.tensor([[2]])
    outputs = CausalLMOutputWithTokens(tokens=tokens, logits=logits)
    assert list(outputs.keys()) == ["logits", "tokens"]
    assert outputs[0] is logits and outputs["tokens"] is tokens
    outputs.attentions = (logits,)
    assert list(outputs.keys()) == ["logits", "tokens", "attentions"]
    outputs.logits = None  # as ModelOutput: a None attribute leaves the key
    assert outputs["logits"] is logits and outputs.logits is None


def test_old_cache_names_mean_cache():
    reference = CausalLMOutputWithPast()
    reference.past_key_values = "cached"
    outputs = CausalLMOutputWithTokens()
    outputs.past_key_values = "cached"
    assert outputs.cache == reference.cache == "cached"
    assert list(outputs.keys()) == list(reference.keys()) == ["cache"]


def test_outputs_flatten_as_a_pytree():
    outputs = CausalLMOutputWithTokens(logits=torch.ones(1, 1, 2), tokens=torch.tensor([[1]]))
    leaves, spec = pytree.tree_flatten(outputs)
    assert len(leaves) == 2
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert isinstance(rebuilt, CausalLMOutputWithTokens)
    assert rebuilt.logits is leaves[0] and rebuilt.tokens is leaves[1]
