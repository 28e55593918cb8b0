"""Requests that carry a step-input plugin's keyword: an adapter per request, and the like.

A request may carry keywords of the enabled step-input plugins (``Engine.add_request(...,
step_keywords={keyword: value})``), one value each. Every call of a step hands the
plugin the list of its rows' values, None for a row without one, as ``generate()`` hands it one
value per row. A plugin's builder (:class:`~nxdplug.pipeline.StepInputBuilder`) may also
answer the engine's questions through its optional members (``row_problem``: a value the
request is refused for; ``rows_fit``: whether rows can run in one step, else the request waits;
``served_names``: names a server offers as models); without them, every value is served, any
rows fit, and no name is offered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from nxdplug.contracts import with_defaults
from nxdplug.engine.requests import Request, RequestError
from nxdplug.pipeline import StepInputBuilder

if TYPE_CHECKING:
    from nxdplug.pipeline import PipelineContext


class RequestInputs:
    """The enabled step-input plugins' keywords, as the engine's requests carry them."""

    def __init__(self, context: PipelineContext) -> None:
        # One builder per record, whatever number of keywords the record takes.
        builders = {
            record: with_defaults(context.step_input_builder(record), StepInputBuilder)
            for record in context.selection.step_inputs
        }
        self.builders: dict[str, StepInputBuilder] = {
            keyword: builder for record, builder in builders.items() for keyword in record.keywords
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
            problem = builder.row_problem(keyword, value)
            if problem is None and not builder.rows_fit(keyword, [value]):
                problem = f"{keyword}={value!r} cannot run even alone"
            if problem is not None:
                raise RequestError(problem, field=keyword)

    def fits(self, running: Sequence[Request], candidate: Request) -> bool:
        """Whether ``candidate`` can run in the steps of the ``running`` requests."""
        return all(
            self.builders[keyword].rows_fit(
                keyword, [r.step_keywords.get(keyword) for r in (*running, candidate)]
            )
            for keyword in candidate.step_keywords
        )

    def step_keywords(self, rows: Sequence[Request]) -> dict[str, list[Any]]:
        """One call's keywords: for each keyword any of ``rows`` carries, every row's value."""
        names = dict.fromkeys(k for r in rows for k in r.step_keywords)
        return {name: [r.step_keywords.get(name) for r in rows] for name in names}

    def served_names(self) -> dict[str, dict[str, Any]]:
        """The model names the plugins offer beside the base model, each with its keywords."""
        names: dict[str, dict[str, Any]] = {}
        for builder in dict.fromkeys(self.builders.values()):
            names |= {name: dict(keywords) for name, keywords in builder.served_names().items()}
        return names
