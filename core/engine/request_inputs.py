"""Requests that carry a step-input plugin's keyword: an adapter per request, and the like.

A request may carry keywords of the enabled step-input plugins (``Engine.add_request(...,
step_keywords={keyword: value})``), one value each. Every call of a step hands the
plugin the list of its rows' values, None for a row without one, as ``generate()`` hands it one
value per row. A plugin's builder (:class:`~nxdplug.modules.step.StepInputBuilder`) may also
answer the engine's questions, through methods it has only if it needs them:

- ``row_problem(keyword, value) -> str | None``: why one request's value cannot be served (an
  adapter nobody registered); the request is refused with it, before it waits;
- ``rows_fit(keyword, values) -> bool``: whether rows with these values can run in one step
  (no more distinct adapters than slots); a request waits until it fits beside the running ones;
- ``served_names() -> Mapping[str, Mapping[str, Any]]``: names a server offers as models beside
  the base model, each with the step keywords of a request that names it (an adapter by its id).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nxdplug.engine.requests import Request, RequestError


class RequestInputs:
    """The enabled step-input plugins' keywords, as the engine's requests carry them."""

    def __init__(self, context: Any) -> None:
        self.builders: dict[str, Any] = {
            keyword: context.step_input_builder(record)
            for record in context.selection.step_inputs
            for keyword in record.keywords
        }

    def check(self, keywords: Mapping[str, Any]) -> None:
        """Refuse (RequestError, naming the keyword) a keyword no enabled plugin takes, or a
        value its plugin says it cannot serve."""
        for keyword, value in keywords.items():
            builder = self.builders.get(keyword)
            if builder is None:
                taken = ", ".join(sorted(self.builders)) or "none"
                raise RequestError(
                    f"{keyword}: no enabled plugin takes it per request (taken: {taken})",
                    field=keyword,
                )
            row_problem = getattr(builder, "row_problem", None)
            problem = None if row_problem is None else row_problem(keyword, value)
            rows_fit = getattr(builder, "rows_fit", None)
            if problem is None and rows_fit is not None and not rows_fit(keyword, [value]):
                problem = f"{keyword}={value!r} cannot run even alone"
            if problem is not None:
                raise RequestError(problem, field=keyword)

    def fits(self, running: Sequence[Request], candidate: Request) -> bool:
        """Whether ``candidate`` can run in the steps of the ``running`` requests."""
        for keyword in candidate.step_keywords:
            rows_fit = getattr(self.builders[keyword], "rows_fit", None)
            if rows_fit is None:
                continue
            values = [r.step_keywords.get(keyword) for r in (*running, candidate)]
            if not rows_fit(keyword, values):
                return False
        return True

    def step_keywords(self, rows: Sequence[Request]) -> dict[str, list[Any]]:
        """One call's keywords: for each keyword any of ``rows`` carries, every row's value."""
        names = dict.fromkeys(k for r in rows for k in r.step_keywords)
        return {name: [r.step_keywords.get(name) for r in rows] for name in names}

    def served_names(self) -> dict[str, dict[str, Any]]:
        """The model names the plugins offer beside the base model, each with its keywords."""
        names: dict[str, dict[str, Any]] = {}
        for builder in dict.fromkeys(self.builders.values()):
            served = getattr(builder, "served_names", None)
            if served is not None:
                names |= {name: dict(keywords) for name, keywords in served().items()}
        return names
