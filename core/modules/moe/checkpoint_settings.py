"""MoENeuronConfig settings that a checkpoint decides: how a model plugin makes the
NeuronConfig agree with its checkpoint's config, or refuses a contradiction."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import attrs

from nxdplug.config import MoENeuronConfig
from nxdplug.errors import ConfigError


def agree_with_checkpoint(
    neuron_config: MoENeuronConfig, settings: Mapping[str, tuple[Any, str]], model: str
) -> MoENeuronConfig:
    """``neuron_config`` with each of ``settings`` (field -> (value, where the checkpoint says
    so)) set to the checkpoint's value.

    A field left at its class's default follows the checkpoint; a field set to anything else
    must already agree, or a ConfigError names every contradiction and the value to use. (A
    value equal to the class default cannot be told from an unset one, and so follows the
    checkpoint.) The caller's object is left alone: a copy is returned when anything changes.
    """
    defaults = {field.name: field.default for field in attrs.fields(type(neuron_config))}
    updates, problems = {}, []
    for name, (value, origin) in settings.items():
        current = getattr(neuron_config, name)
        if current == value:
            continue
        if current == defaults[name]:
            updates[name] = value
        else:
            problems.append(
                f"{name}={current!r} contradicts the checkpoint ({origin} means {name}="
                f"{value!r}): leave {name} unset or set it to {value!r}"
            )
    if problems:
        raise ConfigError([f"{model}: {problem}" for problem in problems])
    if not updates:
        return neuron_config
    agreed = copy.copy(neuron_config)
    for name, value in updates.items():
        setattr(agreed, name, value)
    return agreed


def moe_neuron_config_problems(neuron_config: Any, model: str, config_cls: str) -> list[str]:
    """A MoE model needs a MoENeuronConfig whose router takes a softmax."""
    if not isinstance(neuron_config, MoENeuronConfig):
        return [
            f"{model} needs a MoENeuronConfig (got {type(neuron_config).__name__}): build it "
            f"with {config_cls}(...) or MoENeuronConfig(...)"
        ]
    act_fn = neuron_config.router_config.act_fn
    if act_fn != "softmax":
        return [f"{model}'s router takes a softmax: router_config.act_fn is {act_fn!r}"]
    return []
