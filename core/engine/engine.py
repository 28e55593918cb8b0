"""The engine: a scheduler over the KV cache's lines.

Each :meth:`Engine.step` admits waiting requests into free lines (their prompts encoded by the
context-encoding model, ``ctx_batch_size`` at a time, into those lines alone: ``seq_ids``), then
runs one token-generation step for every running request (``tkg_batch_size`` rows per call),
chooses each request's token with its own settings, and frees the line of every request that
ended. Requests come and go between steps; the graphs never change shape, so nothing recompiles.

With ``async_mode`` (which needs on-device sampling) the next decode step starts from the
tokens the model just chose, before the host looks at them: the host's work of a step (choosing
what ended, decoding text, handing out outputs) runs on a helper thread while the model's next
step runs on the stepping thread (:class:`~nxdplug.runtime.step_ahead.HostOverlap`). A request
that ended is dropped from the step after; its extra token is thrown away. The chain breaks for
a step whenever requests join (a prompt to encode, or one just encoded), so that the next step
decodes every running request.

Step the engine from the thread that loaded the model (see ``step_ahead`` for why);
``add_request`` and ``abort`` may be called from other threads while one thread steps.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from nxdplug.contracts import with_defaults
from nxdplug.engine.cache_space import CacheSpace
from nxdplug.engine.detokenizer import IncrementalText
from nxdplug.engine.phase_outputs import PhaseOutputs
from nxdplug.engine.request_inputs import RequestInputs
from nxdplug.engine.requests import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineFullError,
    Request,
    RequestError,
    RequestOutput,
    SamplingSettings,
)
from nxdplug.engine.runner import EveryRank, StepRunner
from nxdplug.engine.speculative import DraftTree, SpeculativeConfig, engine_speculation
from nxdplug.engine.structured_output import Constraints, TokenConstraint
from nxdplug.engine.token_choice import Chosen, TokenChoice
from nxdplug.errors import ConfigError, NxdPlugError
from nxdplug.lazy import resolve_ref
from nxdplug.runtime.model_wrapper import ExtendWrapper
from nxdplug.runtime.outputs import CausalLMOutputWithTokens
from nxdplug.runtime.scheduled_step import ScheduledStep
from nxdplug.runtime.step_ahead import HostOverlap


def engine_problems(application: Any) -> list[str]:
    """Why ``application`` cannot be served by the engine; empty when it can."""
    neuron_config = application.neuron_config
    problems = []
    if not neuron_config.is_continuous_batching and neuron_config.max_batch_size > 1:
        problems.append(
            f"the engine gives each request its own KV-cache line, which needs "
            f"is_continuous_batching=True (max_batch_size={neuron_config.max_batch_size})"
        )
    return problems


class Engine:
    """Continuous batching over an application's cache lines.

    ``tokenizer`` (optional) turns tokens into text and makes ``stop`` strings work;
    ``max_waiting`` bounds the queue (beyond it ``add_request`` raises EngineFullError);
    ``eos_token_ids`` default to the model's generation config; ``runner`` runs each
    :class:`~nxdplug.runtime.scheduled_step.ScheduledStep` (``runner.run(step)``: the
    application itself; with tensor parallelism, one that hands each step to every rank);
    ``speculative_config`` (vLLM's, as a mapping or a
    :class:`~nxdplug.engine.speculative.SpeculativeConfig`) speculates with the model's
    speculation mode, proposing with ``draft_model`` (an application) for ``draft_model``.
    """

    def __init__(
        self,
        application: Any,
        tokenizer: Any = None,
        *,
        max_waiting: int = 1024,
        eos_token_ids: Iterable[int] | None = None,
        runner: StepRunner | None = None,
        speculative_config: SpeculativeConfig | Mapping[str, Any] | None = None,
        draft_model: Any = None,
    ) -> None:
        problems = engine_problems(application)
        if problems:
            raise ConfigError(problems, source="the engine's model")
        if isinstance(speculative_config, Mapping):
            speculative_config = SpeculativeConfig.from_mapping(
                speculative_config, "the engine's speculative_config"
            )
        self.runner = runner or application
        self.speculation = engine_speculation(
            application, speculative_config, draft_model, EveryRank(application, self.runner)
        )
        self._fused = None if self.speculation is None else self.speculation.fused
        neuron_config = application.neuron_config
        self.application = application
        self.tokenizer = tokenizer
        self.device = application.device
        self.max_waiting = max_waiting
        strategy = application.plugins.kv_cache_strategy
        self.lines: CacheSpace = strategy.load("cache_space")(neuron_config)
        self.max_batch_size = neuron_config.max_batch_size
        self.ctx_rows = neuron_config.ctx_batch_size
        self.tkg_rows = neuron_config.tkg_batch_size
        self.spec_rows = neuron_config.spec_batch_size
        self.max_prompt = neuron_config.max_context_length
        self.max_positions = neuron_config.seq_len
        self.vocab_size = getattr(application.config, "vocab_size", None)
        # The most new tokens a row may add over cached ones in one call and the rows of such a
        # call (None: no extension phase, prompts are encoded whole), and with chunked prefill
        # a step's token budget.
        extensions = [w for w in application.models if isinstance(w, ExtendWrapper)]
        self.chunk = max((w.new_tokens for w in extensions), default=None)
        self.chunk_rows = min((w.batch_size for w in extensions), default=self.ctx_rows)
        chunked = getattr(neuron_config, "is_chunked_prefill", False) or (
            neuron_config.chunked_prefill_config is not None
        )
        self.batched_tokens = (
            getattr(neuron_config, "max_num_batched_tokens", None) or self.chunk
            if chunked
            else None
        )
        self.num_preemptions = 0
        self.eos_token_ids = frozenset(
            model_eos_token_ids(application) if eos_token_ids is None else eos_token_ids
        )
        self.choice = TokenChoice(application.context, self.eos_token_ids)
        self.inputs = RequestInputs(application.context)
        self.phase_outputs = PhaseOutputs(application)
        self.async_mode = bool(neuron_config.async_mode)
        self._overlap = HostOverlap(self.async_mode)
        # async mode: the last decode step's requests and result, not yet handled by the host
        self._pending: tuple[list[Request], Chosen] | None = None
        self._lock = threading.Lock()
        self._waiting: deque[Request] = deque()
        self._running: dict[int, Request] = {}
        self._texts: dict[str, IncrementalText] = {}
        self._ids = itertools.count()
        self._known: set[str] = set()
        self._special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()))
        self._constraints = (
            None if tokenizer is None else Constraints(tokenizer, self.vocab_size or len(tokenizer))
        )
        application.reset()

    # --- requests, from any thread -------------------------------------------------------

    def add_request(
        self,
        prompt_ids: Sequence[int],
        settings: SamplingSettings | None = None,
        request_id: str | None = None,
        step_keywords: Mapping[str, Any] | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request; returns its id. Refuses, with a RequestError naming the field, what
        the model cannot do, and raises EngineFullError when ``max_waiting`` requests wait.
        ``step_keywords``: the request's values of step-input plugins' keywords (its adapter's
        id, ...; see :mod:`~nxdplug.engine.request_inputs`)."""
        return self.enqueue(
            self.prepare(prompt_ids, settings, request_id, step_keywords, cache_salt)
        )

    def prepare(
        self,
        prompt_ids: Sequence[int],
        settings: SamplingSettings | None = None,
        request_id: str | None = None,
        step_keywords: Mapping[str, Any] | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """The checked request that ``enqueue`` queues (``add_request`` does both). Any thread
        may prepare while the engine steps: a structured output's constraint is compiled here,
        and the first one builds the backend's view of the vocabulary (seconds for a large
        one)."""
        settings = settings or SamplingSettings()
        request = Request(request_id or "", list(prompt_ids), settings, cache_salt=cache_salt)
        request.step_keywords = dict(step_keywords or {})
        self.check(request)
        if not settings.greedy and self.choice.samples_on_host:
            request.generator = torch.Generator(self.device)
            if settings.seed is None:
                request.generator.seed()
            else:
                request.generator.manual_seed(settings.seed)
        return request

    def enqueue(self, request: Request) -> str:
        """Queue a prepared request; returns its id (made up when it has none). Raises
        EngineFullError when ``max_waiting`` requests wait. Its step keywords are checked again:
        what they name (an adapter) may have gone while it was prepared."""
        self.inputs.check(request.step_keywords)
        with self._lock:
            if len(self._waiting) >= self.max_waiting:
                raise EngineFullError(
                    f"{len(self._waiting)} requests are waiting, the engine's limit; retry later"
                )
            if not request.request_id:
                request.request_id = f"req-{next(self._ids)}"
            elif request.request_id in self._known:
                raise RequestError(
                    f"request id {request.request_id!r} is in use", field="request_id"
                )
            self._known.add(request.request_id)
            self._waiting.append(request)
        return request.request_id

    def check(self, request: Request) -> None:
        """Refuse a request the model cannot serve (RequestError, with the field)."""
        for field, problem in request.settings.problems():
            raise RequestError(f"{field} {problem}", field=field)
        self.phase_outputs.check(request.settings)
        prompt = len(request.prompt_ids)
        if prompt == 0:
            raise RequestError("the prompt is empty; give at least one token", field="prompt")
        if prompt > self.max_prompt:
            raise RequestError(
                f"the prompt has {prompt} tokens but the model takes at most {self.max_prompt} "
                "(max_context_length)",
                field="prompt",
            )
        if prompt + request.settings.max_tokens > self.max_positions:
            raise RequestError(
                f"the prompt's {prompt} tokens plus max_tokens={request.settings.max_tokens} "
                f"exceed the model's {self.max_positions} positions (seq_len); ask for at most "
                f"{self.max_positions - prompt} tokens",
                field="max_tokens",
            )
        if self.vocab_size is not None and any(
            not 0 <= t < self.vocab_size for t in request.prompt_ids
        ):
            raise RequestError(
                f"the prompt holds token ids outside the vocabulary [0, {self.vocab_size})",
                field="prompt",
            )
        if self.vocab_size is not None and any(
            token >= self.vocab_size for token, _ in request.settings.logit_bias
        ):
            raise RequestError(
                f"logit_bias names token ids outside the vocabulary [0, {self.vocab_size})",
                field="logit_bias",
            )
        if self._fused is not None:
            self._check_fused(request, self._fused.positions_past_end)
        if request.settings.stop and self.tokenizer is None:
            raise RequestError("stop strings need the engine's tokenizer", field="stop")
        self.phase_outputs.check_served(request.settings)
        self.choice.check(request.settings)
        self.inputs.check(request.step_keywords)
        if request.settings.structured_output is not None:
            request.constraint = self._constraint(*request.settings.structured_output)

    def _check_fused(self, request: Request, past_end: int) -> None:
        """What a fused speculator needs of a request: room for its last call's writes, and
        its own prompt phase (which computes no plugin's phase outputs)."""
        needed = len(request.prompt_ids) + request.settings.max_tokens + past_end
        if needed > self.max_positions:
            raise RequestError(
                f"speculating, the prompt's {len(request.prompt_ids)} tokens plus max_tokens="
                f"{request.settings.max_tokens} need {needed} positions of the model's "
                f"{self.max_positions} (seq_len); ask for at most "
                f"{self.max_positions - past_end - len(request.prompt_ids)} tokens",
                field="max_tokens",
            )
        self.phase_outputs.refuse_with_speculation(request.settings, self.speculation.config.method)

    def _constraint(self, kind: str, spec: str) -> TokenConstraint:
        """A request's structured output, compiled; a RequestError saying why it cannot be."""
        field = "structured_output"
        if self._constraints is None:
            raise RequestError("structured outputs need the engine's tokenizer", field=field)
        try:
            return self._constraints.compile(kind, spec)
        except LookupError:
            raise RequestError(
                f"no installed plugin compiles {kind} constraints (a "
                "nxdplug_structured_output_backends record; `nxdplug plugins list` shows them)",
                field=field,
            ) from None
        except (ValueError, NxdPlugError) as exc:
            raise RequestError(f"the {kind} constraint: {exc}", field=field) from None

    def apply_to_model(self, function: str, *args: Any) -> Any:
        """Run ``function`` (a ``"module:function"`` reference) with the application and
        ``args``, and return what it returns; with a tensor-parallel runner, every other rank
        then runs it on its own shard too (only once it succeeded here). For a change to what
        the model holds between two steps (an adapter loaded at run time), from the thread that
        steps the engine."""
        result = resolve_ref(function)(self.application, *args)
        with_defaults(self.runner, StepRunner).call_on_followers(function, args)
        return result

    def abort(self, request_id: str) -> None:
        """Cancel a request: its line is freed at the next step, which reports it finished."""
        with self._lock:
            for request in (*self._waiting, *self._running.values()):
                if request.request_id == request_id:
                    request.abort_requested = True

    # --- state ----------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def unfinished_requests(self) -> list[Request]:
        """The requests waiting or running, in that order (a snapshot)."""
        with self._lock:
            return [*self._waiting, *self._running.values()]

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._pending)

    # --- stepping, from one thread --------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Admit, encode, decode once; the outputs of every request that moved."""
        outputs = self._take_aborts()
        if self._pending is not None:
            batch, result = self._pending
            self._pending = None
            return outputs + self._handle_and_step_ahead(batch, result)
        self._admit()
        encoded, encoding_outputs = self._encode([r for r in self._running.values() if r.encoding])
        outputs += encoding_outputs
        decoding = [
            r
            for r in self._running.values()
            if r not in encoded and not r.encoding and not r.finished
        ]
        decoding = self._make_room(decoding)
        if decoding and self._fused is not None:
            outputs += self._speculate_fused(decoding)
        elif decoding and self.speculation is not None:
            outputs += self._speculate(decoding)
        elif decoding:
            calls = self._decode_calls(decoding)
            if self._overlap.enabled:
                self._pending = (decoding, self._run_decode(calls))
            else:
                outputs += self._accept(decoding, self._run_decode(calls))
        return outputs

    def _encode(self, requests: list[Request]) -> tuple[set[Request], list[RequestOutput]]:
        """Encode what ``requests`` (admitted, in admission order) have not encoded yet: whole
        prompts by context encoding; a prompt's rest after its cached prefix, or all tokens of a
        preempted request, in chunks of new tokens over the cached ones. With chunked prefill,
        only as many tokens as this step's budget leaves after the decoding rows. Returns the
        requests that ran and the outputs of those whose encoding ended (their next token)."""
        outputs: list[RequestOutput] = []
        ran: set[Request] = set()
        by_phase: dict[str, list[Request]] = {}
        for request in requests:
            name = self.phase_outputs.selected(request)
            if name is not None:
                by_phase.setdefault(name, []).append(request)
        selected = [r for rows in by_phase.values() for r in rows]
        for name, rows in by_phase.items():
            for start in range(0, len(rows), self.ctx_rows):
                batch = rows[start : start + self.ctx_rows]
                outputs += self._accept(batch, self._encode_selected(batch, name))
                ran |= set(batch)
        budget = self._encoding_budget()
        while True:
            chunks = self._next_chunks(
                [r for r in requests if r.encoding and r not in selected], budget
            )
            if not chunks:
                return ran, outputs
            budget = None if budget is None else budget - sum(n for _, n in chunks)
            for start in range(0, len(chunks), self.chunk_rows):
                part = chunks[start : start + self.chunk_rows]
                outputs += self._encode_chunks(part)
                ran |= {r for r, _ in part}
            if budget is not None:
                return ran, outputs

    def _encoding_budget(self) -> int | None:
        """The tokens this step may encode (chunked prefill), after one per decoding request;
        None: no limit."""
        if self.batched_tokens is None:
            return None
        decoding = sum(1 for r in self._running.values() if not r.encoding)
        return max(self.batched_tokens - decoding, 0)

    def _next_chunks(
        self, requests: list[Request], budget: int | None
    ) -> list[tuple[Request, int]]:
        """Each encoding request's next chunk size: all it has left when a whole prompt fits
        context encoding, else at most the largest extension's new tokens; within ``budget``.
        Only the step's first chunk may be cut short by the budget: a cut chunk costs a call
        padded to its bucket and leaves a rest that costs another, so a later request waits
        for the next step's budget instead."""
        chunks = []
        for request in requests:
            left = request.to_encode - request.computed
            whole = request.computed == 0 and left <= self.max_prompt
            size = left if whole and self.chunk is None else min(left, self.chunk or left)
            if budget is not None:
                cut = min(size, budget - sum(n for _, n in chunks))
                size = cut if cut == size or not chunks else 0
            if size > 0:
                chunks.append((request, size))
        return chunks

    def _encode_chunks(self, chunks: list[tuple[Request, int]]) -> list[RequestOutput]:
        """Run one chunk of each request (rows of new tokens over their cached positions); the
        requests whose encoding this ends choose their next token."""
        batch = [r for r, _ in chunks]
        step = ScheduledStep.from_rows(
            [r.token_ids[r.computed : r.computed + n] for r, n in chunks],
            [r.computed for r in batch],
            [r.line for r in batch],
            self._step_keywords(batch),
            self.device,
        )
        fused = self._fused
        outputs = self.runner.run(step) if fused is None else fused.encode(batch, step)
        done = []
        for row, (request, count) in enumerate(chunks):
            request.computed += count
            self.lines.commit(request.line, request.first_tokens(request.computed))
            if not request.encoding:
                done.append(row)
        if not done:
            return []
        finished = [batch[row] for row in done]
        return self._accept(finished, self._choose(finished, _rows_of_output(outputs, done)))

    def _speculate(self, decoding: list[Request]) -> list[RequestOutput]:
        """One step of the decoding requests with speculation. Each request whose line has
        k more positions (within ``seq_len``) is offered up to k tokens: as many as it can
        still use (one fewer than the tokens it has left) and its cache can grow to hold.
        When any is offered some, those requests verify in one call (``spec_batch_size`` rows
        a call; one offered none takes a single token from it) and the others decode; when
        none is, every request decodes, by the cheaper one-token phase."""
        assert self.speculation is not None and self.speculation.proposer is not None
        k = self.speculation.k
        verifying = [r for r in decoding if r.length + k <= self.max_positions]
        proposals = []
        for request, proposal in zip(
            verifying, self.speculation.proposer.propose(verifying, k), strict=True
        ):
            proposal = proposal[: _usable_proposals(request)]
            if proposal and not self.lines.grow(request.line, request.length + len(proposal)):
                proposal = []
            proposals.append(proposal)
        if not any(proposals):
            verifying, proposals = [], []
        plain = [r for r in decoding if r not in verifying]
        outputs = self._accept(plain, self._run_decode(self._decode_calls(plain))) if plain else []
        for start in range(0, len(verifying), self.spec_rows):
            rows = verifying[start : start + self.spec_rows]
            offered = proposals[start : start + self.spec_rows]
            new_tokens = [
                [r.output_ids[-1], *p] + [(p or r.output_ids)[-1]] * (k - len(p))
                for r, p in zip(rows, offered, strict=True)
            ]
            step = ScheduledStep.from_rows(
                new_tokens,
                [r.length - 1 for r in rows],
                [r.line for r in rows],
                self._step_keywords(rows),
                self.device,
            )
            chains = [DraftTree.chain(p) for p in offered]
            outputs += self._take_verified(rows, chains, self.runner.run(step).logits)[0]
        return outputs

    def _speculate_fused(self, decoding: list[Request]) -> list[RequestOutput]:
        """One step of the decoding requests by a fused speculator: each call drafts and
        scores (``spec_batch_size`` rows a call); each request takes what a verification
        gives it, at most one token fewer than it has left from the drafts."""
        assert self._fused is not None
        outputs = []
        for start in range(0, len(decoding), self.spec_rows):
            rows = decoding[start : start + self.spec_rows]
            drafts, logits = self._fused.verify(rows)
            offered = [d.up_to(_usable_proposals(r)) for r, d in zip(rows, drafts, strict=True)]
            taken, paths = self._take_verified(rows, offered, logits)
            outputs += taken
            self._fused.taken(rows, paths)
        return outputs

    def _take_verified(
        self, rows: list[Request], drafts: list[DraftTree], logits: torch.Tensor
    ) -> tuple[list[RequestOutput], list[list[int]]]:
        """The target's tokens of a verification (``logits`` [rows, n+1, vocab]: each row's
        root, then its nodes), each chosen as a decode step would choose it: a request takes
        the token at its root, then goes on to the child holding that token while there is
        one and it goes on. Returns the outputs and each row's path (the root 0, then the
        nodes it went on to: one token added at each)."""
        assert self.speculation is not None
        texts, reasons = [""] * len(rows), [None] * len(rows)
        accepted = [0] * len(rows)
        paths = [[0] for _ in rows]
        live = list(range(len(rows)))
        argmax = self.choice.argmax_of_every_position(rows, logits)
        while live:
            nodes = [paths[row][-1] for row in live]
            if argmax is None:
                at_nodes = logits[live, nodes]
                chosen = self.choice.choose([rows[i] for i in live], at_nodes, None)
            else:
                chosen = Chosen([argmax[row][node] for row, node in zip(live, nodes, strict=True)])
            going_on = []
            for index, row in enumerate(live):
                reason, text = self._add_token(rows[row], chosen, index)
                texts[row] += text
                reasons[row] = reason
                child = drafts[row].child(nodes[index], chosen.tokens[index])
                if child is not None:
                    accepted[row] += 1
                    if reason is None:
                        paths[row].append(child)
                        going_on.append(row)
            live = going_on
        outputs = []
        for row, request in enumerate(rows):
            self.speculation.metrics.record(len(drafts[row].tokens), accepted[row])
            outputs.append(self._report(request, reasons[row], texts[row]))
        return outputs, paths

    def _make_room(self, decoding: list[Request]) -> list[Request]:
        """Room in the cache for each decoding request's next position, in admission order;
        when the cache has none left, the latest admitted request is preempted (its room
        given back; it waits at the front of the queue and encodes its tokens again), as
        vLLM's scheduler does. Returns the requests that decode this step."""
        for request in decoding:
            if request.line is None:
                continue  # preempted for an earlier one
            self.lines.commit(request.line, request.first_tokens(request.length - 1))
            while request.line is not None and not self.lines.grow(request.line, request.length):
                self._preempt([r for r in self._running.values() if not r.finished][-1])
        return [r for r in decoding if r.line is not None]

    def _preempt(self, request: Request) -> None:
        with self._lock:
            del self._running[request.line]
            self.lines.release(request.line)
            request.line = None
            request.computed = 0
            request.proposer_state = None
            request.preemptions += 1
            self.num_preemptions += 1
            self._waiting.appendleft(request)

    def _handle_and_step_ahead(self, batch: list[Request], result: Chosen) -> list[RequestOutput]:
        """Async mode: hand out the last decode step's tokens while the model decodes the next
        step from them; when requests are joining, only hand them out (the next step admits
        and decodes every running request)."""
        newcomers = any(r not in batch for r in self._running.values())
        ahead = [(r, t) for r, t in zip(batch, result.tokens, strict=True) if not r.finished]
        if newcomers or self._can_admit() or not ahead:
            return self._accept(batch, result)
        rows = [r for r, _ in ahead]
        if not all(self.lines.grow(r.line, r.length + 1) for r in rows):
            return self._accept(batch, result)  # the next step makes room, preempting
        calls = self._decode_calls(rows, first_tokens=[t for _, t in ahead])
        outputs, stepped = self._overlap.run(
            functools.partial(self._accept, batch, result),
            functools.partial(self._run_decode, calls),
        )
        self._pending = (rows, stepped)
        return outputs

    def close(self) -> None:
        """Stop the host's helper thread (async mode)."""
        self._overlap.close()

    def _take_aborts(self) -> list[RequestOutput]:
        outputs = []
        with self._lock:
            for request in [r for r in self._waiting if r.abort_requested]:
                self._waiting.remove(request)
                outputs.append(self._finish(request, FINISH_ABORT))
            for request in [r for r in self._running.values() if r.abort_requested]:
                outputs.append(self._finish(request, FINISH_ABORT))
        return outputs

    def _can_admit(self) -> bool:
        return bool(self._waiting) and self.lines.free > 0

    def _admit(self) -> list[Request]:
        """Waiting requests into free lines, in arrival order. One that cannot run beside the
        running ones (an adapter with no free slot, ...) stays at the front of the queue while
        later ones that can run go ahead, as vLLM's scheduler skips it, but only as many as
        the engine has lines: then admission waits for it, so that requests that keep coming
        for the running adapters cannot keep it out forever. One that finds no room in the
        cache stops admission (it is first in line for the next free room)."""
        admitted: list[Request] = []
        passed_over: list[Request] = []
        with self._lock:
            while self._waiting and self.lines.free > 0:
                request = self._waiting[0]
                if passed_over and passed_over[0].times_passed_over >= self.max_batch_size:
                    break  # the oldest waiting request has been passed over enough
                if not self.inputs.fits([*self._running.values()], request):
                    if request.times_passed_over >= self.max_batch_size:
                        break  # the same, at the front of the queue
                    passed_over.append(self._waiting.popleft())
                    continue
                line = self.lines.reserve(
                    request.token_ids,
                    request.settings.max_tokens - len(request.output_ids),
                    salt=self._salt(request),
                    reuse=self.phase_outputs.selected(request) is None,
                )
                if line is None:
                    break
                self._waiting.popleft()
                request.line = line
                request.to_encode = request.length
                request.computed = self.lines.cached(line)
                if not request.preemptions:
                    request.cached_tokens = request.computed
                self._running[request.line] = request
                if passed_over:
                    passed_over[0].times_passed_over += 1
                if self.tokenizer is not None and request.request_id not in self._texts:
                    self._texts[request.request_id] = IncrementalText(
                        self.tokenizer, request.settings.stop, request.settings.skip_special_tokens
                    )
                admitted.append(request)
            self._waiting.extendleft(reversed(passed_over))
        return admitted

    def _salt(self, request: Request) -> tuple[Any, ...]:
        """What must match for two prompts to share cached positions: the request's step
        keywords (its adapter) and its cache salt."""
        keywords = tuple(sorted((k, repr(v)) for k, v in request.step_keywords.items()))
        return (keywords, request.cache_salt)

    def _encode_selected(self, batch: list[Request], name: str) -> Chosen:
        """Encode the prompts of ``batch`` into their lines by the phase that the phase output
        ``name`` selects, and keep each request's output of it."""
        keywords = self._step_keywords(batch) | {name: True}
        prompts = [r.prompt_ids for r in batch]
        lines = [r.line for r in batch]
        step = ScheduledStep.from_rows(prompts, [0] * len(batch), lines, keywords, self.device)
        outputs = self.runner.run(step)
        for row, request in enumerate(batch):
            request.computed = request.to_encode
            self.lines.commit(request.line, request.token_ids)
            self.phase_outputs.take(name, outputs, row, request)
        return self._choose(batch, outputs)

    def _decode_calls(
        self, batch: list[Request], first_tokens: Sequence[int] | None = None
    ) -> list[tuple[list[Request], ScheduledStep]]:
        """The token-generation calls of one step for ``batch``, ``tkg_batch_size`` rows each:
        each request's last token (or ``first_tokens``, chosen but not yet added) after the
        positions its line holds."""
        calls = []
        for start in range(0, len(batch), self.tkg_rows):
            rows = batch[start : start + self.tkg_rows]
            if first_tokens is None:
                last = [[r.output_ids[-1]] for r in rows]
                cached = [r.length - 1 for r in rows]
            else:
                last = [[t] for t in first_tokens[start : start + len(rows)]]
                cached = [r.length for r in rows]
            lines = [r.line for r in rows]
            step = ScheduledStep.from_rows(
                last, cached, lines, self._step_keywords(rows), self.device
            )
            calls.append((rows, step))
        return calls

    def _step_keywords(self, batch: Sequence[Request]) -> dict[str, Any]:
        """The per-row inputs of the rows' requests: where the KV-cache strategy keeps their
        keys and values (beside their lines), their step-input plugins' values, and their
        token choice's."""
        lines = [r.line for r in batch]
        return (
            self.lines.step_inputs(lines, self.device)
            | self.inputs.step_keywords(batch)
            | self.choice.step_keywords(batch)
        )

    def _run_decode(self, calls: list[tuple[list[Request], ScheduledStep]]) -> Chosen:
        tokens: list[int] = []
        logprobs: list[float] = []
        top: list[tuple[tuple[int, float], ...]] = []
        for rows, step in calls:
            chosen = self._choose(rows, self.runner.run(step))
            tokens += chosen.tokens
            logprobs += chosen.logprobs or [float("nan")] * len(rows)
            top += chosen.top_logprobs or [()] * len(rows)
        return Chosen(tokens, logprobs, top)

    def _choose(self, batch: Sequence[Request], outputs: Any) -> Chosen:
        tokens = outputs.tokens
        logits = None if outputs.logits is None else outputs.logits[:, -1]
        return self.choice.choose(
            batch, logits, None if tokens is None else tokens.view(-1)[: len(batch)]
        )

    def _accept(self, batch: list[Request], result: Chosen) -> list[RequestOutput]:
        """Add each request's new token, end those that stop, and report them."""
        outputs = []
        for index, request in enumerate(batch):
            if request.finished:
                continue  # ended while this step ran (async mode): its token is dropped
            reason, text = self._add_token(request, result, index)
            outputs.append(self._report(request, reason, text))
        return outputs

    def _add_token(self, request: Request, result: Chosen, index: int) -> tuple[str | None, str]:
        """Add the token ``result`` chose for ``request`` (its row ``index``); returns why the
        request ends with it (None: it goes on) and the text it completes."""
        token = result.tokens[index]
        request.output_ids.append(token)
        if request.settings.logprobs and result.logprobs is not None:
            request.logprobs.append(result.logprobs[index])
            if result.top_logprobs is not None:
                request.top_logprobs.append(result.top_logprobs[index])
        reason = self._stop_reason(request, token)
        if request.constraint is not None:
            request.constraint.accept(token)
            if request.constraint.finished:
                reason = FINISH_STOP
        text, stopped = "", False
        incremental = self._texts.get(request.request_id)
        if incremental is not None:
            ids = request.output_ids
            if reason == FINISH_STOP and token in self._special_ids:
                ids = ids[:-1]  # the special token that ends the request is no text
            text, stopped = incremental.update(ids)
        return (FINISH_STOP if stopped else reason), text

    def _report(self, request: Request, reason: str | None, text: str) -> RequestOutput:
        """The output of a request that moved; it ends when ``reason`` says why."""
        if reason is None:
            return self._output(request, text)
        with self._lock:
            return self._finish(request, reason, text)

    def _stop_reason(self, request: Request, token: int) -> str | None:
        settings = request.settings
        if token in settings.stop_token_ids:
            return FINISH_STOP
        if token in self.eos_token_ids and not settings.ignore_eos:
            return FINISH_STOP
        if len(request.output_ids) >= settings.max_tokens:
            return FINISH_LENGTH
        return None

    def _finish(self, request: Request, reason: str, text: str = "") -> RequestOutput:
        """End ``request`` (the caller holds the lock) and free its line."""
        request.finish_reason = reason
        if request.line is not None:
            del self._running[request.line]
            self.lines.release(request.line)
        incremental = self._texts.pop(request.request_id, None)
        if incremental is not None:
            text += incremental.finish()
        self._known.discard(request.request_id)
        return self._output(request, text)

    def _output(self, request: Request, text: str) -> RequestOutput:
        tokens, logprobs, top = request.new_tokens()
        extras, request.phase_outputs = request.phase_outputs, {}
        return RequestOutput(
            request_id=request.request_id,
            token_ids=tuple(tokens),
            text=text,
            logprobs=tuple(logprobs) if request.settings.logprobs else None,
            top_logprobs=tuple(top) if request.settings.top_logprobs else None,
            finished=request.finished,
            finish_reason=request.finish_reason,
            prompt_tokens=len(request.prompt_ids),
            completion_tokens=len(request.output_ids),
            cached_tokens=request.cached_tokens,
            extras=extras,
        )


def _usable_proposals(request: Request) -> int:
    """The most proposed tokens a verification can give ``request``: one fewer than it has
    left (the verification adds a token of the target's own)."""
    return max(request.settings.max_tokens - len(request.output_ids) - 1, 0)


def _rows_of_output(outputs: Any, rows: list[int]) -> Any:
    """A step's outputs for some of its rows."""
    index = torch.tensor(
        rows, device=(outputs.logits if outputs.tokens is None else outputs.tokens).device
    )
    return CausalLMOutputWithTokens(
        logits=None if outputs.logits is None else outputs.logits[index],
        tokens=None if outputs.tokens is None else outputs.tokens[index],
    )


def model_eos_token_ids(application: Any) -> list[int]:
    """The end-of-sequence tokens of the model's generation config (or config)."""
    from nxdplug.checkpoint.generation_config import model_generation_config

    eos = model_generation_config(application).eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)
