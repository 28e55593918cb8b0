"""A request as the engine sees it: its prompt, its sampling settings, its state, its outputs."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

from nxdplug.engine.structured_output import KINDS
from nxdplug.errors import NxdPlugError
from nxdplug.registry import get_registry

# OpenAI's finish reasons: a stop condition (EOS, a stop token or string), the token budget, or
# the caller gave up (a cancelled request, a client gone).
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"

# The most alternatives a position's log-probabilities list (OpenAI's top_logprobs bound).
MAX_TOP_LOGPROBS = 20


class RequestError(NxdPlugError, ValueError):
    """A request the engine cannot take as it is (a bad setting, a prompt too long); the
    message names the field and what it accepts. A server answers it with a 400."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class EngineFullError(NxdPlugError):
    """More requests wait than the engine's queue limit; a server answers 503."""


Extras = tuple[tuple[str, Any], ...]


def _extras(given: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> Extras:
    """Plugin-added values, in name order, without the unset (None) ones; a tuple keeps the
    frozen record hashable."""
    return tuple(sorted((k, v) for k, v in dict(given).items() if v is not None))


class PluginAdded:
    """Settings or outputs that plugins add to a request's (the names of the installed
    :class:`~nxdplug.types.PhaseOutput` records), held in ``extras`` and read as attributes;
    such a name that was not given reads None."""

    __slots__ = ()
    extras: Extras

    def extra(self, name: str) -> Any:
        """The value plugin-added ``name`` holds; None when it was not given."""
        return dict(self.extras).get(name)

    def __getattr__(self, name: str) -> Any:
        missing = AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        if name == "extras" or name.startswith("_"):
            raise missing  # not set yet (being built or unpickled): no plugin-added name
        if name in dict(self.extras) or name in get_registry().names("phase_outputs"):
            return self.extra(name)
        raise missing


@attrs.frozen(init=False)
class SamplingSettings(PluginAdded):
    """How one request is decoded, with OpenAI's meanings.

    ``temperature`` 0 (or ``top_k`` 1) is greedy; ``top_k`` 0, ``top_p`` 1 and ``min_p`` 0
    switch those filters off (``min_p``, vLLM's and HF's: a token less likely than ``min_p``
    times the likeliest one is not drawn; applied after top-k and top-p, in HF's order).
    ``seed`` makes a sampled request's tokens reproducible. ``stop`` strings end the
    text before them; ``stop_token_ids`` and the model's EOS (unless ``ignore_eos``) end it after
    the token, and ``min_tokens`` keeps those tokens from being chosen until that many tokens
    are out (vLLM's meaning). ``logprobs``: return the log-probability of each chosen token, and
    of the ``top_logprobs`` likeliest tokens at each position.
    ``structured_output``: ``(kind, spec)``, the output held to a JSON schema, a regular
    expression, a list of choices or a grammar (see :mod:`~nxdplug.engine.structured_output`).
    ``skip_special_tokens`` (vLLM's): the text leaves special tokens out; either way a special
    token that ends the request (EOS) adds no text.

    The logits are adjusted before a token is chosen, as vLLM does: ``logit_bias`` (token id,
    bias) pairs are added; ``repetition_penalty`` divides the positive logits (multiplies the
    negative ones) of every token of the prompt and the output so far (HF's and vLLM's
    meaning; 1 is off); ``frequency_penalty`` times a token's count in the output, and
    ``presence_penalty`` once for a token the output holds, are subtracted (OpenAI's meaning).
    Log-probabilities are those of the model's own logits, before any adjustment.

    Further keywords are settings that plugins add (``extras``; see :class:`PluginAdded`); the
    engine refuses one that no installed plugin adds, or whose plugin refuses its value.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(
        default=(), converter=lambda pairs: tuple(tuple(pair) for pair in pairs)
    )
    structured_output: tuple[str, str] | None = attrs.field(
        default=None, converter=attrs.converters.optional(tuple)
    )
    skip_special_tokens: bool = True
    extras: Extras = attrs.field(default=(), converter=_extras)

    def __init__(self, *args: Any, **settings: Any) -> None:
        own = attrs.fields_dict(type(self))
        added = {k: v for k, v in settings.items() if k not in own}
        given = {k: v for k, v in settings.items() if k in own}
        given["extras"] = dict(given.get("extras", ())) | added
        self.__attrs_init__(*args, **given)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def adjustments(self) -> list[str]:
        """The settings that are on of those that adjust the logits before a token is chosen."""
        on = {
            "logit_bias": bool(self.logit_bias),
            "min_tokens": bool(self.min_tokens),
            "repetition_penalty": self.repetition_penalty != 1,
            "presence_penalty": bool(self.presence_penalty),
            "frequency_penalty": bool(self.frequency_penalty),
            "structured_output": self.structured_output is not None,
        }
        return [name for name, is_on in on.items() if is_on]

    def problems(self) -> list[tuple[str, str]]:
        """``(field, what is wrong)`` for every setting out of range; empty when usable."""
        found = []
        if not _is_whole(self.max_tokens) or self.max_tokens < 1:
            found.append(("max_tokens", f"must be a whole number >= 1, got {self.max_tokens!r}"))
        if not (_is_number(self.temperature) and 0 <= self.temperature <= 100):
            found.append(("temperature", f"must be in [0, 100], got {self.temperature!r}"))
        if not _is_whole(self.top_k) or self.top_k < 0:
            found.append(("top_k", f"must be a whole number >= 0 (0: off), got {self.top_k!r}"))
        if not (_is_number(self.top_p) and 0 < self.top_p <= 1):
            found.append(("top_p", f"must be in (0, 1], got {self.top_p!r}"))
        if not (_is_number(self.min_p) and 0 <= self.min_p <= 1):
            found.append(("min_p", f"must be in [0, 1] (0: off), got {self.min_p!r}"))
        if self.seed is not None and not _is_whole(self.seed):
            found.append(("seed", f"must be a whole number, got {self.seed!r}"))
        if any(not isinstance(s, str) or not s for s in self.stop):
            found.append(("stop", "must be non-empty strings"))
        if any(not _is_whole(t) or t < 0 for t in self.stop_token_ids):
            found.append(("stop_token_ids", "must be token ids (whole numbers >= 0)"))
        if not _is_whole(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            found.append(
                ("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
            )
        elif self.top_logprobs and not self.logprobs:
            found.append(("top_logprobs", "needs logprobs"))
        given = self.structured_output
        if given is not None and not (
            len(given) == 2 and given[0] in KINDS and isinstance(given[1], str)
        ):
            found.append(
                (
                    "structured_output",
                    f"must be (kind, spec text) with a kind of {', '.join(KINDS)}; got {given!r}",
                )
            )
        ceiling = self.max_tokens if _is_whole(self.max_tokens) else math.inf
        if not _is_whole(self.min_tokens) or not 0 <= self.min_tokens <= ceiling:
            found.append(("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens!r}"))
        if not (_is_number(self.repetition_penalty) and self.repetition_penalty > 0):
            found.append(
                ("repetition_penalty", f"must be > 0 (1: off), got {self.repetition_penalty!r}")
            )
        for field in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, field)
            if not (_is_number(value) and -2 <= value <= 2):
                found.append((field, f"must be in [-2, 2], got {value!r}"))
        for token, bias in self.logit_bias:
            if not _is_whole(token) or token < 0:
                found.append(("logit_bias", f"keys must be token ids, got {token!r}"))
            elif not (_is_number(bias) and -100 <= bias <= 100):
                found.append(("logit_bias", f"token {token}: bias must be in [-100, 100]"))
        return found


def _is_whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return _is_whole(value) or (isinstance(value, float) and math.isfinite(value))


@attrs.frozen
class RequestOutput(PluginAdded):
    """What one step added to a request: new tokens, the text they complete, and whether the
    request ended (``finish_reason`` then says why). ``text`` holds back characters that may
    still become a stop string or an incomplete UTF-8 sequence; the last output releases them.
    ``top_logprobs``, when asked: the likeliest ``(token, logprob)`` pairs at each new token's
    position. ``extras``: the phase outputs the request asked for (see :class:`PluginAdded`),
    on its first output only."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] | None
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    # The prompt's leading tokens found in the prefix cache (OpenAI's cached_tokens).
    cached_tokens: int = 0
    extras: Extras = attrs.field(default=(), converter=_extras)


@attrs.define(eq=False)
class Request:
    """A request in the engine: waiting for a line, running on one, or finished.
    ``step_keywords``: its values of step-input plugins' keywords (see ``request_inputs``)."""

    request_id: str
    prompt_ids: list[int]
    settings: SamplingSettings
    arrival: float = attrs.field(factory=time.monotonic)
    line: int | None = None
    output_ids: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = attrs.field(factory=list)
    finish_reason: str | None = None
    abort_requested: bool = False
    generator: torch.Generator | None = None
    emitted_tokens: int = 0
    step_keywords: dict[str, Any] = attrs.field(factory=dict)
    # The phase outputs its prompt's encoding computed, until its first output hands them out.
    phase_outputs: dict[str, Any] = attrs.field(factory=dict)
    # Its structured output's state (compiled when it arrives), stepped with each token.
    constraint: Any = None
    # Requests admitted ahead of it while it could not run (see Engine._admit).
    times_passed_over: int = 0
    # vLLM's cache_salt: prompts share cached positions only under the same salt.
    cache_salt: str | None = None
    # Positions of its line holding keys and values; it is encoding while fewer than
    # ``length`` - 1 once it has output (its tokens so far), ``len(prompt_ids)`` before.
    computed: int = 0
    # How many tokens it encodes on admission (its prompt, and its output when preempted).
    to_encode: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    # What its speculation proposer keeps between steps (see ``engine.speculative``).
    proposer_state: Any = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def first_tokens(self, count: int) -> Sequence[int]:
        """Its first ``count`` tokens (prompt, then output), without copying them."""
        return FirstTokens(self.prompt_ids, self.output_ids, count)

    @property
    def encoding(self) -> bool:
        """Whether its tokens are still being encoded (the prompt, or all after a
        preemption)."""
        return self.computed < self.to_encode

    @property
    def length(self) -> int:
        """Tokens in its cache line once its last token is written: prompt and output."""
        return len(self.prompt_ids) + len(self.output_ids)

    def new_tokens(
        self,
    ) -> tuple[Sequence[int], Sequence[float], Sequence[tuple[tuple[int, float], ...]]]:
        """The tokens (their logprobs and top logprobs) not handed out yet; marks them handed
        out."""
        start, self.emitted_tokens = self.emitted_tokens, len(self.output_ids)
        return self.output_ids[start:], self.logprobs[start:], self.top_logprobs[start:]


class FirstTokens(Sequence[int]):
    """The first ``count`` of a prompt's tokens followed by its output's, read in place (a
    decode step hands a cache space its request's tokens, which a copy would cost a step)."""

    def __init__(self, prompt: list[int], output: list[int], count: int) -> None:
        self.prompt, self.output, self.count = prompt, output, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(self.count)
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            head = self.prompt[start:stop]
            rest = self.output[max(start - len(self.prompt), 0) : max(stop - len(self.prompt), 0)]
            return head + rest
        if not -self.count <= index < self.count:
            raise IndexError(index)
        index %= self.count
        prompt = len(self.prompt)
        return self.prompt[index] if index < prompt else self.output[index - prompt]
