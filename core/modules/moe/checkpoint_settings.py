"""What MoE model plugins check of their NeuronConfig
(making it agree with the checkpoint: :mod:`nxdplug.config.checkpoint_settings`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nxdplug.config import MoENeuronConfig

if TYPE_CHECKING:
    from nxdplug.config import NeuronConfig


def moe_neuron_config_problems(
    neuron_config: NeuronConfig, model: str, config_cls: str
) -> list[str]:
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
