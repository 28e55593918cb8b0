"""On-device sampling settings (``NeuronConfig.on_device_sampling_config``)."""

from __future__ import annotations

import attrs


@attrs.define(kw_only=True, slots=False)
class OnDeviceSamplingConfig:
    """How the model turns logits into tokens; setting it enables on-device sampling.

    ``do_sample`` chooses multinomial (True) or greedy (False) sampling; ``top_k``, ``top_p`` and
    ``temperature`` are the defaults for every request, which ``dynamic`` lets each request
    override (with ``dynamic`` the model samples as each row's ``sampling_params`` ask, top_k 1
    being greedy, whatever ``do_sample`` says, as NxD Inference's sampler does);
    ``global_topk`` bounds the candidates kept before top-k / top-p.
    ``on_device_sampling_config``, ``top_k_kernel_enabled`` and ``sampling_dp_degree`` are
    NxD Inference's too (a marker, a Neuron kernel switch, how the sampling work is split over
    ranks): kept in the config, the tokens do not depend on them.

    As NxD Inference's plain class, it takes any attribute assignment (``config.global_topk =
    0``, ``config.topk = 1``); values and names are checked when the config is used to build a
    model (:mod:`nxdplug.config.validation`), an unknown name with a did-you-mean.
    """

    do_sample: bool = False
    top_k: int = 1
    top_p: float = 1.0
    temperature: float = 1.0
    dynamic: bool = False
    deterministic: bool = False
    global_topk: int = 256
    on_device_sampling_config: bool = True
    top_k_kernel_enabled: bool = False
    sampling_dp_degree: int = 1
