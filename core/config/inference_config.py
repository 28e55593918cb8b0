"""InferenceConfig: a NeuronConfig plus the model's own attributes (hidden_size, ...).

Model attributes come from keyword arguments and from a ``load_config`` hook, usually
:func:`nxdplug.config.load_pretrained_config`. The config is written to ``neuron_config.json``
in the compiled-model folder and read back with :meth:`InferenceConfig.load`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from nxdplug.config.fused_spec import FusedSpecNeuronConfig
from nxdplug.config.neuron_config import NeuronConfig
from nxdplug.config.sections import build_section
from nxdplug.config.serialization import (
    dumps,
    parse_json_object,
    read_json_object,
    to_jsonable,
    write_text_atomic,
)
from nxdplug.config.value_object import ComparedByValue
from nxdplug.errors import ConfigError

CONFIG_FILE = "neuron_config.json"

Self = TypeVar("Self", bound="InferenceConfig")


class MissingAttributesError(ConfigError, AssertionError):
    """Required config attributes not set: what NxD Inference's ``validate_config`` raises."""


class InferenceConfig(ComparedByValue):
    """A NeuronConfig (``neuron_config``) and the model's attributes, as plain attributes.

    ``attribute_map`` lists aliases (alias -> attribute): getting or setting an alias reaches the
    attribute it names. A config loaded through ``load_pretrained_config`` takes the map of the
    model's transformers config class.
    """

    attribute_map: dict[str, str] = {}

    def __init__(
        self,
        neuron_config: NeuronConfig | Mapping[str, Any] | None,
        fused_spec_config: FusedSpecNeuronConfig | Mapping[str, Any] | None = None,
        load_config: Callable[[InferenceConfig], None] | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if "attribute_map" in kwargs:  # first, so that the other keywords may use the aliases
            self.attribute_map = dict(kwargs.pop("attribute_map"))
        self.neuron_config = self._as_neuron_config(neuron_config)
        self.fused_spec_config = self._as_fused_spec_config(fused_spec_config)
        if load_config is not None:
            load_config(self)
        else:
            self.load_config()
        self.metadata = metadata
        for name, value in kwargs.items():
            setattr(self, name, value)
        self.add_derived_config()
        self.validate_config()

    # -- attribute aliases --------------------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        if name != "attribute_map":
            name = self.attribute_map.get(name, name)
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # Called only when the normal lookup fails, so real attributes are never redirected.
        target = self.attribute_map.get(name)
        if target is not None and target != name:
            return getattr(self, target)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- hooks for subclasses -----------------------------------------------------------------

    def load_config(self) -> None:
        """Load model attributes; runs during ``__init__`` when no ``load_config`` hook is given.

        Does nothing by default; a model's config class may override it.
        """

    def add_derived_config(self) -> None:
        """Compute attributes from the loaded ones; runs after the keyword overrides.

        Does nothing by default; a model's config class may override it (as in NxD Inference).
        """

    def get_required_attributes(self) -> list[str]:
        """Names that must be set for the config to validate; dotted names reach into values."""
        return []

    def validate_config(self) -> None:
        """Raise a ConfigError (an AssertionError, as NxD Inference's assert) listing every
        required attribute that is not set."""
        missing = [
            name for name in self.get_required_attributes() if not _has_attribute_path(self, name)
        ]
        if missing:
            raise MissingAttributesError(
                f"{type(self).__name__} requires the attribute {name!r}, which is not set: pass "
                "it as a keyword argument or load the model's attributes with "
                "load_config=load_pretrained_config(model_path)"
                for name in missing
            )

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        """The NeuronConfig class that loading builds; a subclass may return a subclass of it."""
        return NeuronConfig

    # -- serialization ------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Every attribute as plain JSON data; nested configs become dicts."""
        return to_jsonable(vars(self), type(self).__name__)

    def to_json_string(self) -> str:
        return dumps(self.to_dict())

    def to_json_file(self, json_file: str | os.PathLike[str]) -> None:
        """Write the config to ``json_file`` atomically."""
        write_text_atomic(json_file, self.to_json_string() + "\n")

    def save(self, model_path: str | os.PathLike[str]) -> None:
        """Write ``neuron_config.json`` in the folder ``model_path`` (created if needed)."""
        os.makedirs(model_path, exist_ok=True)
        self.to_json_file(Path(model_path) / CONFIG_FILE)

    @classmethod
    def load(cls: type[Self], model_path: str | os.PathLike[str], **kwargs: Any) -> Self:
        """Read ``neuron_config.json`` from ``model_path``; ``kwargs`` override its attributes."""
        config_file = Path(model_path) / CONFIG_FILE
        if not config_file.is_file():
            raise ConfigError(
                [
                    f"no {CONFIG_FILE} in {model_path}: give the folder a compiled model was "
                    "saved to (InferenceConfig.save or compile writes this file)"
                ],
                str(model_path),
            )
        return cls.from_json_file(config_file, **kwargs)

    @classmethod
    def from_json_file(cls: type[Self], json_file: str | os.PathLike[str], **kwargs: Any) -> Self:
        """Read a config from ``json_file``; ``kwargs`` override its attributes."""
        return cls._from_data(read_json_object(json_file), str(json_file), kwargs)

    @classmethod
    def from_json_string(cls: type[Self], json_string: str, **kwargs: Any) -> Self:
        """Read a config from a JSON string; ``kwargs`` override its attributes."""
        return cls._from_data(parse_json_object(json_string, "JSON string"), None, kwargs)

    @classmethod
    def from_dict(cls: type[Self], data: Mapping[str, Any], **kwargs: Any) -> Self:
        """Build a config from the form :meth:`to_dict` returns; ``kwargs`` override it."""
        return cls._from_data(data, None, kwargs)

    @classmethod
    def _from_data(
        cls: type[Self], data: Mapping[str, Any], source: str | None, overrides: Mapping[str, Any]
    ) -> Self:
        merged = {**data, **overrides}
        if "neuron_config" not in merged:
            raise ConfigError(
                ["there is no 'neuron_config' entry; is this a file InferenceConfig.save wrote?"],
                source,
            )
        try:
            return cls(**merged)
        except ConfigError as exc:  # the same type (NxD Inference's, for some), with the file
            raise type(exc)(exc.problems, exc.source or source) from exc
        except (TypeError, ValueError, KeyError) as exc:
            raise ConfigError([f"cannot build {cls.__name__}: {exc}"], source) from exc

    # -- nested configs given as dicts --------------------------------------------------------

    def _as_neuron_config(self, value: Any) -> Any:
        if isinstance(value, Mapping):
            return self.get_neuron_config_cls()(**value)
        return value

    def _as_fused_spec_config(self, value: Any) -> Any:
        if not isinstance(value, Mapping):
            return value
        values = dict(value)
        draft = values.get("draft_config")
        if isinstance(draft, Mapping):
            values["draft_config"] = type(self)(**draft)
        return build_section(FusedSpecNeuronConfig, values, "fused_spec_config")


def _has_attribute_path(obj: Any, dotted_name: str) -> bool:
    for part in dotted_name.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True
