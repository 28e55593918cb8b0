"""The plugin: a ``logit-softcap`` feature, its config check and its model transform.

``NeuronConfig(final_logit_softcapping=30.0)`` switches it on; unset (``None``) leaves it off,
and then nxdplug calls neither of the feature's callbacks below.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from nxdplug.plugin_api import Feature, NotSupportedError, hookimpl

from nxdplug_softcap.softcap import add_softcap

if TYPE_CHECKING:
    from nxdplug.plugin_api import PipelineContext
    from torch import nn

NXDPLUG_API_VERSION = 2

SETTING = "final_logit_softcapping"  # the name Gemma-2's HF config uses for the same cap


@hookimpl
def nxdplug_features() -> Iterable[Feature]:
    yield Feature(
        name="logit-softcap",
        enabled_by=(SETTING,),
        # Set, not truthy: final_logit_softcapping=0 switches the feature on and is refused.
        enabled_when_set=True,
        settings={SETTING: None},
        validate=f"{__name__}:validate",
        transform_model=f"{__name__}:cap_the_head",
        description="cap final logits smoothly: cap * tanh(logits / cap) (Gemma-2)",
    )


def cap_problems(value: Any) -> list[str]:
    """What is wrong with ``value`` as a soft-capping cap, in plain words (empty if fine)."""
    is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if is_number and math.isfinite(value) and value > 0:
        return []
    return [
        f"{SETTING}={value!r} is not a positive finite number; set it to the cap of "
        f"cap * tanh(logits / cap), such as 30.0 (Gemma-2's value), or unset it to switch "
        "logit soft-capping off"
    ]


def validate(context: PipelineContext) -> Iterable[str]:
    return cap_problems(getattr(context.neuron_config, SETTING, None))


def cap_the_head(model: nn.Module, context: PipelineContext) -> None:
    head = getattr(model, "lm_head", None)
    if head is None:
        raise NotSupportedError(
            f"{SETTING} needs a model with an 'lm_head' module to cap, and "
            f"{type(model).__name__} has none; unset {SETTING} for this model"
        )
    add_softcap(head, getattr(context.neuron_config, SETTING))
