"""Sub-configs (sampling, LoRA, MoE router, ...) given as an instance or as a plain dict.

NxD Inference accepts ``NeuronConfig(on_device_sampling_config={"top_k": 5})`` as well as an
``OnDeviceSamplingConfig``, and a saved ``neuron_config.json`` holds the dict form, so every
sub-config field converts a dict to its class. A key the class does not know is an error with a
did-you-mean hint, not a silently ignored setting.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from nxdplug.config.suggestions import did_you_mean
from nxdplug.errors import ConfigError


def build_section(section_cls: type, values: Mapping[str, Any], where: str) -> Any:
    """``section_cls(**values)``; unknown or missing keys are reported together as a ConfigError.

    ``where`` names the setting being built (``"on_device_sampling_config"``) in the messages.
    """
    known = {field.alias for field in attrs.fields(section_cls)}
    unknown = [key for key in values if key not in known]
    if unknown:
        raise ConfigError(
            f"{where}: {section_cls.__name__} has no setting {key!r}{did_you_mean(key, known)}; "
            f"its settings are: {', '.join(sorted(known))}"
            for key in unknown
        )
    try:
        return section_cls(**values)
    except TypeError as exc:  # a required setting is missing
        raise ConfigError([f"{where}: {section_cls.__name__}: {exc}"]) from exc


def section_converter(section_cls: type, where: str) -> Callable[[Any], Any]:
    """An attrs converter: ``None`` and instances pass through, a dict builds ``section_cls``."""

    def convert(value: Any) -> Any:
        if value is None or isinstance(value, section_cls):
            return value
        if isinstance(value, Mapping):
            return build_section(section_cls, value, where)
        raise ConfigError(
            [
                f"{where} must be a {section_cls.__name__} or a dict of its settings; "
                f"got {type(value).__name__} {value!r}"
            ]
        )

    return convert
