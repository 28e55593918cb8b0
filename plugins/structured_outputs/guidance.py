"""llguidance's matchers as the engine's token constraints.

JSON is held to compact separators (``", "`` and ``": "``, no other whitespace), as
``json.dumps`` writes it, unless the schema's own ``x-guidance`` options say otherwise: with
free whitespace a model may write spaces without end. A choice is a Lark grammar of its strings.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from nxdplug.plugin_api import NxdPlugError

JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GuidanceCompiler:
    """Compiles constraints for one tokenizer (the model's vocabulary size wide)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        try:
            import llguidance.hf
        except ImportError:
            raise NxdPlugError(
                "structured outputs need llguidance: pip install llguidance (in 'nxdplug[serve]')"
            ) from None
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def compile(self, kind: str, spec: str) -> GuidanceConstraint:
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, self._grammar(kind, spec), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return GuidanceConstraint(matcher, self.vocab_size)

    def _grammar(self, kind: str, spec: str) -> str:
        from llguidance import LLMatcher

        if kind == "json":
            schema = _json(spec, "a JSON schema")
            if not isinstance(schema, dict):
                raise ValueError(f"a JSON schema is an object, got {spec!r}")
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            choices = _json(spec, "a list of strings")
            if not (
                isinstance(choices, list)
                and choices
                and all(isinstance(c, str) and c for c in choices)
            ):
                raise ValueError(f"choices are a list of non-empty strings, got {spec!r}")
            return "start: " + " | ".join(json.dumps(c) for c in choices)
        if kind == "grammar":
            return LLMatcher.grammar_from_lark(spec)
        raise ValueError(f"llguidance compiles json, regex, choice and grammar, not {kind!r}")


class GuidanceConstraint:
    """One request's matcher: its mask of allowed tokens at each step."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import llguidance.torch

        self.matcher = matcher
        self._bitmasks = llguidance.torch
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> None:
        self._bitmasks.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        self._bitmasks.apply_token_bitmask_inplace(logits[None], self._bitmask)

    def accept(self, token: int) -> None:
        self.matcher.consume_token(token)

    @property
    def finished(self) -> bool:
        return self.matcher.is_stopped() or self.matcher.is_error()


def _json(spec: str, what: str) -> Any:
    try:
        return json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not {what} in JSON: {exc}") from None
