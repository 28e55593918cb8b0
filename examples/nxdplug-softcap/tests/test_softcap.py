"""Soft-capped logits against HF transformers' raw logits of the same tiny Llama checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from nxdplug import NeuronConfig, from_pretrained
from nxdplug.errors import ConfigError, NxdPlugError
from nxdplug.testing import (
    LOGIT_TOLERANCES,
    fresh_plugin_manager,
    hf_greedy,
    random_prompts,
    teacher_forced_logits,
)
from transformers import AutoModelForCausalLM

from nxdplug_softcap import hooks

CAP = 2.0  # well inside the tiny model's logit range, so capping changes every step
STEPS = 4
CALLBACKS = ("validate", "cap_the_head")  # in the order nxdplug calls them


def neuron_config(**options: Any) -> NeuronConfig:
    return NeuronConfig(
        batch_size=2, seq_len=32, max_context_length=16, torch_dtype="float32", **options
    )


@attrs.frozen
class Reference:
    """HF transformers' greedy run: prompts, the tokens it chose and its raw logits."""

    prompts: torch.Tensor
    mask: torch.Tensor
    tokens: torch.Tensor
    logits: torch.Tensor


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> Reference:
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prompts, mask = random_prompts(hf_model.config.vocab_size, (7, 13))
    run = hf_greedy(hf_model, prompts, mask, STEPS)
    logits = torch.stack([step.float() for step in run.logits], dim=1)
    return Reference(prompts, mask, run.sequences[:, prompts.shape[1] :], logits)


def assert_logits(app: Any, reference: Reference, expected: torch.Tensor) -> None:
    """``app``'s logits, teacher-forced on HF's tokens, equal ``expected`` (float32 tolerance)."""
    actual = teacher_forced_logits(app, reference.prompts, reference.mask, reference.tokens)
    atol, rtol = LOGIT_TOLERANCES[torch.float32]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def capped(logits: torch.Tensor, cap: float) -> torch.Tensor:
    return cap * torch.tanh(logits / cap)


def recording(name: str, function: Callable[..., Any], calls: list[str]) -> Callable[..., Any]:
    def recorded(*args: Any) -> Any:
        calls.append(name)
        return function(*args)

    return recorded


@pytest.fixture
def callback_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the feature's callbacks nxdplug calls during the test, in order."""
    calls: list[str] = []
    for name in CALLBACKS:
        monkeypatch.setattr(hooks, name, recording(name, getattr(hooks, name), calls))
    return calls


def test_logits_are_softcapped(softcap_plugin, callback_calls, tiny_llama, reference) -> None:
    assert (reference.logits.abs() > 2 * CAP).any(), "the cap would change nothing"
    app = from_pretrained(tiny_llama, neuron_config(final_logit_softcapping=CAP))
    app.to_cpu()
    assert [feature.name for feature in app.plugins.features] == ["logit-softcap"]
    assert callback_calls == list(CALLBACKS)
    assert_logits(app, reference, capped(reference.logits, CAP))


def test_unset_calls_no_callback(softcap_plugin, callback_calls, tiny_llama, reference) -> None:
    app = from_pretrained(tiny_llama, neuron_config())
    app.to_cpu()
    assert callback_calls == []
    assert app.plugins.features == ()
    assert_logits(app, reference, reference.logits)


@pytest.mark.parametrize("value", [0, 0.0, -1.0, float("nan"), float("inf"), "30", True, [30]])
def test_invalid_caps_are_refused(softcap_plugin, tiny_llama, value) -> None:
    with pytest.raises(ConfigError) as error:
        from_pretrained(tiny_llama, neuron_config(final_logit_softcapping=value))
    (problem,) = error.value.problems
    assert problem.startswith(f"final_logit_softcapping={value!r} is not a positive finite number")
    assert "or unset it" in problem


def test_setting_is_unknown_without_the_plugin(tiny_llama) -> None:
    with fresh_plugin_manager(deny=frozenset({"softcap"})), pytest.raises(ConfigError) as error:
        from_pretrained(tiny_llama, neuron_config(final_logit_softcapping=CAP))
    assert any(
        "unknown NeuronConfig attribute 'final_logit_softcapping'" in p
        for p in error.value.problems
    )


def test_compiled_graphs_are_softcapped(softcap_plugin, tiny_llama, reference, tmp_path) -> None:
    folder = tmp_path / "compiled"
    app = from_pretrained(tiny_llama, neuron_config(final_logit_softcapping=CAP))
    app.compile(folder, quiet=True)
    app.load(folder, quiet=True)
    assert_logits(app, reference, capped(reference.logits, CAP))
    # the cap is part of the config the folder was compiled for
    other = from_pretrained(tiny_llama, neuron_config(final_logit_softcapping=2 * CAP))
    with pytest.raises(NxdPlugError, match="final_logit_softcapping"):
        other.load(folder, quiet=True)
