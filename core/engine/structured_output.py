"""Structured outputs: a request's tokens held to a JSON schema, a regular expression, a list of
choices or a grammar, by masking the logits of every token that would break it before the token
is chosen (as vLLM does). The library that compiles constraints is a plugin
(``nxdplug_structured_output_backends``); the engine compiles each request's constraint when it
arrives, so that a bad schema is the request's error, and steps it with each chosen token.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch

from nxdplug.registry import get_registry

# ``json``: a JSON schema (as JSON text); ``regex``: a regular expression the whole output
# matches; ``choice``: a JSON list of the strings the output may be; ``grammar``: a Lark grammar.
KINDS = ("json", "regex", "choice", "grammar")


class TokenConstraint(Protocol):
    """One request's constraint, stepped with its tokens."""

    def mask(self, logits: torch.Tensor) -> None:
        """Set to -inf, in place, the float32 logits [vocab] of the tokens that would break it
        at this point."""

    def accept(self, token: int) -> None:
        """Step past the chosen token."""

    @property
    def finished(self) -> bool:
        """Whether nothing may follow: the output is complete (its end token taken) or no token
        can continue it."""


class ConstraintCompiler(Protocol):
    """A backend's implementation, built once per engine with ``(tokenizer, vocab_size)``."""

    def compile(self, kind: str, spec: str) -> TokenConstraint:
        """The constraint of ``kind`` (one of :data:`KINDS`) described by ``spec``; a
        ValueError saying what is wrong with a spec it cannot compile."""


class Constraints:
    """The engine's compilers of constraints: each backend built once, with the tokenizer, the
    first time a request asks for a kind it compiles."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compilers: dict[str, ConstraintCompiler] = {}
        self._building = threading.Lock()  # requests are compiled on the threads that add them

    def compile(self, kind: str, spec: str) -> TokenConstraint:
        """``kind``'s constraint by the installed backend of highest priority that compiles
        it; LookupError when none does, ValueError for a spec it refuses."""
        backends = [
            r for r in get_registry().records("structured_output_backends") if kind in r.kinds
        ]
        if not backends:
            raise LookupError(kind)
        best = max(backends, key=lambda record: record.priority)
        with self._building:
            if best.name not in self._compilers:
                build = best.load("implementation")
                self._compilers[best.name] = build(self.tokenizer, self.vocab_size)
            compiler = self._compilers[best.name]
        return compiler.compile(kind, spec)
