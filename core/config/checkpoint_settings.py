"""NeuronConfig settings a checkpoint decides (a MoE model's expert numerics, a quantized
checkpoint's format): the NeuronConfig is made to agree with the checkpoint, or a contradiction
is refused."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, TypeVar

import attrs

from nxdplug.errors import ConfigError

Config = TypeVar("Config")


def agree_with_checkpoint(
    neuron_config: Config, settings: Mapping[str, tuple[Any, str]], model: str
) -> Config:
    """``neuron_config`` with each of ``settings`` (field -> (value, where the checkpoint says
    so)) set to the checkpoint's value.

    A field left at its class's default (a feature's setting: unset, None) follows the
    checkpoint; a field set to anything else must already agree, or a ConfigError names every
    contradiction and the value to use. (A value equal to the class default cannot be told from
    an unset one, and so follows the checkpoint.) The caller's object is left alone: a copy is
    returned when anything changes.
    """
    defaults = {field.name: field.default for field in attrs.fields(type(neuron_config))}
    updates, problems = {}, []
    for name, (value, origin) in settings.items():
        current = getattr(neuron_config, name, None)
        if current == value:
            continue
        if current == defaults.get(name):
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
