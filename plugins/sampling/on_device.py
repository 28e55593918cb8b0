"""On-device sampling: the model's graph draws the next token and returns token ids.

Shapes are static: the graph keeps the ``global_topk`` best logits of each row (``torch.topk``
with a fixed K) and applies, per row and within those K candidates, HF's processing in HF's
order: temperature (``TemperatureLogitsWarper``), top-k (``TopKLogitsWarper``, as a mask on the
rank), top-p (``TopPLogitsWarper``: the cumulative-probability mask, the best token always
kept). ``top_k`` is at most ``global_topk``, so every token outside the K candidates is one
HF's top-k removes too, and the distribution is HF's. (One difference: on an exact tie of logits
at the k-th place HF keeps every tied token, the rank mask exactly k.)

The draw is the Gumbel-max trick: ``argmax(scores - log(-log(u)))`` with ``u`` uniform on (0, 1)
is distributed as ``softmax(scores)``. ``u`` is a graph input (``sampling_noise``, one number per
candidate) drawn on the host from the sampler's own ``torch.Generator``, so the graph stays a
pure function of its inputs, traces with fixed shapes, and the compiled and eager models draw the
same tokens from the same noise. ``reset()`` (every ``generate()``) seeds the generator from
torch's global RNG, so ``torch.manual_seed`` makes sampling reproducible; with
``deterministic=True`` it reseeds to a fixed seed instead, so the same inputs give the same
tokens every time.

The graph samples when ``do_sample`` or ``dynamic`` is set (NxD Inference's sampler draws
whenever dynamic ``sampling_params`` ask for it: a row with ``top_k`` 1 is greedy, one with a
larger ``top_k`` is sampled, with no separate ``do_sample``). With neither, the graph takes the
argmax: ``sampling_params`` given to such a model are not used, as in NxD Inference (its
generation demo passes them to a greedy model), and a RuntimeWarning says so.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nxdplug.plugin_api import NxdPlugError, StepInputs, claim_slot

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig, OnDeviceSamplingConfig, PipelineContext

DETERMINISTIC_SEED = 0
_SMALLEST_NOISE = torch.finfo(torch.float32).tiny  # keeps -log(-log(u)) finite at u = 0
IGNORED_PARAMS_WARNING = (
    "sampling_params are not used: on_device_sampling_config decodes greedily (do_sample and "
    "dynamic are False), as NxD Inference's sampler does; set dynamic=True to sample each row "
    "with its own top_k, top_p and temperature"
)


def samples(sampling_config: OnDeviceSamplingConfig) -> bool:
    """Whether the graph draws tokens (else it takes the argmax): ``do_sample``, or ``dynamic``,
    whose per-row ``sampling_params`` choose between greedy (``top_k`` 1) and sampling."""
    return bool(sampling_config.do_sample or sampling_config.dynamic)


class SamplingParamsError(NxdPlugError, ValueError):
    """``sampling_params`` the model cannot honour; every refused row is named."""


def sampling_params_tensor(
    batch_size: int,
    top_k: float,
    top_p: float,
    temperature: float,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The ``sampling_params`` of ``batch_size`` requests with the same settings, [batch, 3]:
    one row ``(top_k, top_p, temperature)`` each, NxD Inference's dynamic-sampling layout."""
    row = torch.tensor([[top_k, top_p, temperature]], dtype=torch.float32, device=device)
    return row.repeat(batch_size, 1)


def candidate_scores(
    logits: torch.Tensor, sampling_params: torch.Tensor, global_topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``global_topk`` best tokens of each row, and their scores after temperature, top-k
    and top-p (``-inf`` where filtered out): two [batch, global_topk] tensors."""
    values, candidates = torch.topk(logits.float(), global_topk, dim=-1)
    top_k, top_p, temperature = sampling_params.unbind(dim=-1)
    scores = values / temperature[:, None]
    rank = torch.arange(global_topk, device=logits.device)
    scores = scores.masked_fill(rank >= top_k[:, None], float("-inf"))
    # TopPLogitsWarper: drop a token when it and every worse token hold at most 1 - top_p.
    tail = scores.softmax(dim=-1).flip(-1).cumsum(dim=-1).flip(-1)
    drop = (tail <= (1 - top_p)[:, None]) & (rank > 0)
    return scores.masked_fill(drop, float("-inf")), candidates


def gumbel_max(scores: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The index of each row drawn from ``softmax(scores)``, given uniform ``noise``."""
    gumbel = -torch.log(-torch.log(noise.clamp(min=_SMALLEST_NOISE)))
    return (scores + gumbel).argmax(dim=-1)


def sampling_params_problems(
    sampling_params: torch.Tensor, global_topk: int, do_sample: bool
) -> list[str]:
    """Why rows of ``sampling_params`` cannot be honoured; empty when all can."""
    problems = []
    for row, (top_k, top_p, temperature) in enumerate(sampling_params.tolist()):
        where = f"row {row} (top_k={top_k:g}, top_p={top_p:g}, temperature={temperature:g})"
        if not (top_k >= 1 and top_k == int(top_k)):
            problems.append(f"{where}: top_k must be a whole number, 1 or more")
        elif top_k > global_topk:
            problems.append(
                f"{where}: top_k is larger than global_topk={global_topk}, the number of "
                "candidates the graph keeps; lower top_k, or raise "
                "on_device_sampling_config.global_topk (up to vocab_size) and compile again"
            )
        elif not do_sample and top_k != 1:
            problems.append(
                f"{where}: asks to sample, but the model decodes greedily "
                "(on_device_sampling_config.do_sample=False, dynamic=False); use top_k=1, "
                "or set do_sample=True or dynamic=True and compile again"
            )
        if not 0 < top_p <= 1:
            problems.append(f"{where}: top_p must be in (0, 1]")
        if not (temperature > 0 and math.isfinite(temperature)):
            problems.append(
                f"{where}: temperature must be a finite number above 0 (top_k=1 is greedy)"
            )
    return problems


class OnDeviceSampler(nn.Module):
    """The draw itself, inside the graph: [batch, vocab] logits -> [batch] token ids."""

    def __init__(self, sampling_config: OnDeviceSamplingConfig) -> None:
        super().__init__()
        self.do_sample = samples(sampling_config)
        self.global_topk = sampling_config.global_topk

    def forward(
        self, logits: torch.Tensor, sampling_params: torch.Tensor, sampling_noise: torch.Tensor
    ) -> torch.Tensor:
        if not self.do_sample:
            return logits.argmax(dim=-1)
        scores, candidates = candidate_scores(logits, sampling_params, self.global_topk)
        choice = gumbel_max(scores, sampling_noise)
        return candidates.gather(-1, choice[:, None]).squeeze(-1)


class SampledTokens(nn.Module):
    """The model's output stage with on-device sampling: the token drawn at the last position,
    [batch, 1], and the logits too with ``output_logits``."""

    def __init__(self, sampler: OnDeviceSampler, output_logits: bool) -> None:
        super().__init__()
        self.sampler = sampler
        self.output_logits = output_logits

    def forward(self, logits: torch.Tensor, step: StepInputs) -> tuple[torch.Tensor, ...]:
        tokens = self.sampler(logits[:, -1], step["sampling_params"], step["sampling_noise"])
        return (tokens[:, None], logits) if self.output_logits else (tokens[:, None],)


class SamplingInputs:
    """The host side: each step's ``sampling_params`` [batch, 3] (the caller's rows, checked,
    or the config's settings) and ``sampling_noise`` [batch, global_topk] from the sampler's
    own generator."""

    def __init__(self, config: InferenceConfig) -> None:
        sampling_config = config.neuron_config.on_device_sampling_config
        self.do_sample = samples(sampling_config)
        self.dynamic = sampling_config.dynamic
        self.deterministic = sampling_config.deterministic
        self.global_topk = sampling_config.global_topk
        self.defaults = (sampling_config.top_k, sampling_config.top_p, sampling_config.temperature)
        self.generator = torch.Generator()

    def example(self, batch_size: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {
            "sampling_params": sampling_params_tensor(batch_size, 1, 1.0, 1.0, device),
            "sampling_noise": torch.full((batch_size, self.global_topk), 0.5, device=device),
        }

    def build(
        self, batch_size: int, keywords: dict[str, Any], device: torch.device
    ) -> dict[str, torch.Tensor]:
        given = keywords.get("sampling_params")
        if given is not None and not self.do_sample:
            warnings.warn(IGNORED_PARAMS_WARNING, RuntimeWarning, stacklevel=2)
            given = None
        if given is None:
            params = sampling_params_tensor(batch_size, *self.defaults, device=device)
        else:
            params = self._checked(given, batch_size).to(device)
        shape = (batch_size, self.global_topk)
        if self.do_sample:  # drawn on the CPU: a seed gives the same tokens on every device
            noise = torch.rand(shape, generator=self.generator, device="cpu").to(device)
        else:
            noise = torch.zeros(shape, device=device)
        return {"sampling_params": params, "sampling_noise": noise}

    def reset(self) -> None:
        """Seed the generator: a fixed seed when deterministic, else one from torch's RNG."""
        if not self.do_sample:
            return  # greedy draws nothing: leave torch's global RNG alone
        seed = (
            DETERMINISTIC_SEED
            if self.deterministic
            else int(torch.randint(0, 2**62, (1,), device="cpu"))
        )
        self.generator.manual_seed(seed)

    def _checked(self, sampling_params: torch.Tensor, batch_size: int) -> torch.Tensor:
        if not self.dynamic:
            raise SamplingParamsError(
                "sampling_params were given, but on_device_sampling_config.dynamic is False: "
                "the model samples with the config's top_k, top_p and temperature; set "
                "dynamic=True to choose them per request"
            )
        if tuple(sampling_params.shape) != (batch_size, 3):
            raise SamplingParamsError(
                f"sampling_params must have shape [batch, 3] = [{batch_size}, 3], one row "
                f"(top_k, top_p, temperature) per request; got {list(sampling_params.shape)}"
            )
        params = sampling_params.to(torch.float32)
        problems = sampling_params_problems(params, self.global_topk, self.do_sample)
        if problems:
            lines = "\n".join(f"  - {problem}" for problem in problems)
            raise SamplingParamsError(f"sampling_params refused:\n{lines}")
        return params


def on_device_sampling_problems(
    sampling_config: OnDeviceSamplingConfig, vocab_size: Any
) -> list[str]:
    """The config checks of this feature (top_p, temperature and global_topk >= 1 are core's
    rules, see ``nxdplug.config.validation``)."""
    top_k, global_topk = sampling_config.top_k, sampling_config.global_topk
    problems = []
    if not _is_whole(top_k) or top_k < 1:
        problems.append(
            f"on_device_sampling_config.top_k is {top_k!r}; it must be a whole number, 1 or more"
        )
    elif _is_whole(global_topk) and top_k > global_topk:
        problems.append(
            f"on_device_sampling_config.top_k ({top_k}) is larger than global_topk "
            f"({global_topk}), the number of candidates the graph keeps; lower top_k or raise "
            "global_topk"
        )
    if _is_whole(global_topk) and _is_whole(vocab_size) and global_topk > vocab_size:
        problems.append(
            f"on_device_sampling_config.global_topk ({global_topk}) is larger than the "
            f"vocabulary (vocab_size={vocab_size}); set global_topk to {vocab_size} or less"
        )
    return problems


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_on_device_sampling(context: PipelineContext) -> list[str]:
    """The ``validate`` callback of the on-device-sampling feature."""
    config = context.config
    return on_device_sampling_problems(
        config.neuron_config.on_device_sampling_config, getattr(config, "vocab_size", None)
    )


def install_sampler(model: nn.Module, context: PipelineContext) -> None:
    """The ``transform_model`` callback: the model returns sampled tokens."""
    neuron_config = context.neuron_config
    sampler = OnDeviceSampler(neuron_config.on_device_sampling_config)
    output = SampledTokens(sampler, neuron_config.output_logits)
    claim_slot(model, "output_stage", output, claimant="on-device-sampling")
