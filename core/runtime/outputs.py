"""What ``NeuronBaseForCausalLM.forward`` returns, with the outputs a plugin's phase adds."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from nxdplug.errors import PluginError
from nxdplug.registry import get_registry


@dataclass
class CausalLMOutputWithTokens(CausalLMOutputWithPast):
    """What NeuronBaseForCausalLM.forward returns.

    ``logits`` [batch, 1, vocab]: each row's last-token logits; None with on-device sampling
    unless ``output_logits`` is set. ``tokens`` [batch, 1]: the token the model sampled for
    each row, with on-device sampling; None otherwise.

    A plugin's phase may return outputs of its own (those a
    :class:`~nxdplug.types.PhaseOutput` record names in ``outputs``): they are keys beside the
    fields, read as ``outputs.name`` or ``outputs["name"]``; after a call that did not compute
    them, such a name reads None.
    """

    tokens: torch.LongTensor | None = None

    # transformers' ModelOutput reads the field names on every assignment and checks them in
    # __post_init__, which took a fifth of the host's time in a decode step. The same rules,
    # with the names read once: a field set to a value is also a key, in field order (the
    # dataclass __init__ assigns them in that order); old cache names mean ``cache``.

    def __post_init__(self) -> None:
        pass

    def __setattr__(self, name: str, value: Any) -> None:
        name = self._replace_old_cache_name(name)
        if name in _FIELD_NAMES and value is not None:
            OrderedDict.__setitem__(self, name, value)
        object.__setattr__(self, name, value)

    @classmethod
    def with_outputs(
        cls,
        logits: torch.Tensor | None,
        added: Mapping[str, torch.Tensor],
        tokens: torch.Tensor | None = None,
    ) -> CausalLMOutputWithTokens:
        """The logits (or tokens) with the tensors a plugin's phase adds, by name."""
        clashes = sorted({f.name for f in fields(cls)} & set(added))
        if clashes:
            raise PluginError(f"a phase's added outputs take the names of fields: {clashes}")
        outputs = cls(logits=logits, tokens=tokens)
        for name, value in added.items():
            outputs[name] = value
        return outputs

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("_") and name in added_output_names():
            return None
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


_FIELD_NAMES = frozenset(f.name for f in fields(CausalLMOutputWithTokens))


def added_output_names() -> frozenset[str]:
    """The outputs the installed plugins' phases add (their PhaseOutput records')."""
    records = get_registry().records("phase_outputs")
    return frozenset(name for record in records for name in record.outputs)


def join_outputs(parts: list[CausalLMOutputWithTokens]) -> CausalLMOutputWithTokens:
    """The outputs of consecutive row groups of one step, as one output."""
    names = ("logits", "tokens")
    joined = {
        name: None
        if getattr(parts[0], name) is None
        else torch.cat([getattr(p, name) for p in parts])
        for name in names
    }
    return CausalLMOutputWithTokens(**joined)
