"""How the engine gets each request's next token.

On the host, from the logits, each request with its own settings and random generator, after its
own adjustments (bias, penalties, ``min_tokens``: :mod:`~nxdplug.engine.logits_adjustment`). When
the model samples in its graph, the enabled feature giving ``request_sampling`` says which
settings the graph can honour and turns each step's requests into its per-row inputs; the engine
then takes the model's tokens.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Protocol

import attrs
import torch

from nxdplug.engine.logits_adjustment import adjusted_logits
from nxdplug.engine.requests import Request, RequestError, SamplingSettings
from nxdplug.registry import get_registry
from nxdplug.runtime.sampling import SamplingParams

if TYPE_CHECKING:
    from nxdplug.pipeline import PipelineContext


class GraphSampling(Protocol):
    """A model that samples in its graph, as the engine sees it."""

    returns_logits: bool

    def refusal(self, settings: SamplingSettings) -> tuple[str, str] | None:
        """``(field, why)`` when the graph cannot sample as ``settings`` ask; else None."""

    def step_keywords(self, settings: Sequence[SamplingSettings]) -> dict[str, torch.Tensor]:
        """The forward keywords carrying one row of settings per request of a step."""


@attrs.frozen
class Chosen:
    """One step's tokens for its rows, with their log-probabilities when any row asks: the
    chosen token's (``logprobs``) and each row's likeliest ``(token, logprob)`` pairs
    (``top_logprobs``, as many as the row asks)."""

    tokens: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None


class TokenChoice:
    """The engine's sampler for one application; ``eos_token_ids`` are those ``min_tokens``
    holds back."""

    def __init__(self, context: PipelineContext, eos_token_ids: Collection[int] = ()) -> None:
        self.eos_token_ids = eos_token_ids
        self.graph: GraphSampling | None = context.request_sampling()
        self.returns_logits = self.graph is None or self.graph.returns_logits
        self.greedy = get_registry().get("samplers", "greedy").load("implementation")()
        self.multinomial = get_registry().get("samplers", "multinomial").load("implementation")()

    @property
    def samples_on_host(self) -> bool:
        return self.graph is None

    def check(self, settings: SamplingSettings) -> None:
        """Refuse settings this model cannot honour (a RequestError naming the field)."""
        if settings.logprobs and not self.returns_logits:
            raise RequestError(
                "logprobs need the model's logits, but it samples in its graph without "
                "returning them; serve it with output_logits=True",
                field="logprobs",
            )
        adjustments = settings.adjustments()
        if adjustments and not self.samples_on_host:
            field = adjustments[0]
            raise RequestError(
                f"{field} adjusts the logits before a token is chosen, but this model chooses "
                "its tokens in its graph (on_device_sampling_config); serve it without "
                "on-device sampling",
                field=field,
            )
        if settings.min_p and not settings.greedy and not self.samples_on_host:
            raise RequestError(
                "min_p is drawn on the host, but this model chooses its tokens in its graph "
                "(on_device_sampling_config); serve it without on-device sampling",
                field="min_p",
            )
        refusal = None if self.graph is None else self.graph.refusal(settings)
        if refusal is not None:
            field, why = refusal
            raise RequestError(why, field=field)

    def step_keywords(self, requests: Sequence[Request]) -> dict[str, torch.Tensor]:
        if self.graph is None:
            return {}
        return self.graph.step_keywords([r.settings for r in requests])

    def choose(
        self, requests: Sequence[Request], logits: torch.Tensor | None, tokens: torch.Tensor | None
    ) -> Chosen:
        """Each request's next token from one step's outputs (``logits`` [rows, vocab] or None,
        the model's ``tokens`` [rows] or None), with log-probabilities when any request asks."""
        if tokens is None:
            tokens = self._draw(requests, adjusted_logits(requests, logits, self.eos_token_ids))
        chosen = tokens.view(-1).tolist()
        if logits is None or not any(r.settings.logprobs for r in requests):
            return Chosen(chosen)
        wanted = [r.settings.top_logprobs for r in requests]
        log_softmax = torch.log_softmax(logits.float(), dim=-1)
        logprobs = log_softmax.gather(-1, tokens.view(-1, 1)).view(-1).tolist()
        top = None
        if max(wanted) > 0:
            values, ids = log_softmax.topk(max(wanted), dim=-1)
            rows = zip(ids.tolist(), values.tolist(), wanted, strict=True)
            top = [tuple(zip(i[:k], v[:k], strict=True)) for i, v, k in rows]
        return Chosen(chosen, logprobs, top)

    def argmax_of_every_position(
        self, requests: Sequence[Request], logits: torch.Tensor
    ) -> list[list[int]] | None:
        """Each request's token at each position of ``logits`` [rows, n, vocab] in one call,
        when every request takes the argmax of the model's logits and nothing else (no
        adjustment, no logprobs); else None (each position is then chosen on its own)."""
        plain = all(
            r.settings.greedy and not r.settings.adjustments() and not r.settings.logprobs
            for r in requests
        )
        if not plain:
            return None
        rows, positions, vocab = logits.shape
        tokens = self.greedy(logits.reshape(rows * positions, vocab), SamplingParams())
        return tokens.view(rows, positions).tolist()

    def _draw(self, requests: Sequence[Request], logits: torch.Tensor) -> torch.Tensor:
        """The greedy requests' tokens in one call of the greedy sampler (an argmax a row costs
        ~20 us, a third of a millisecond a step at 16 rows), each sampled one from its own
        generator."""
        greedy = [i for i, r in enumerate(requests) if r.settings.greedy]
        if len(greedy) == len(requests):
            return self.greedy(logits, SamplingParams())
        tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        if greedy:
            tokens[greedy] = self.greedy(logits[greedy], SamplingParams())
        for index, request in enumerate(requests):
            if not request.settings.greedy:
                tokens[index] = self._sample(request, logits[index])
        return tokens

    def _sample(self, request: Request, logits: torch.Tensor) -> torch.Tensor:
        settings = request.settings
        params = SamplingParams(
            top_k=settings.top_k, top_p=settings.top_p, temperature=settings.temperature
        )
        probabilities = self.multinomial.scores(logits[None].float(), params).softmax(dim=-1)
        if settings.min_p:
            least = settings.min_p * probabilities.max(dim=-1, keepdim=True).values
            probabilities = probabilities.masked_fill(probabilities < least, 0)
        return torch.multinomial(probabilities, 1, generator=request.generator)[0, 0]
