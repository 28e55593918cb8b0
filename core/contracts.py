"""The contracts a plugin's objects follow: ``typing.Protocol`` classes, checked on resolve.

A protocol declares what the core asks of a plugin's object (a step-input builder, a compile
backend). Some members are optional: a method marked :func:`optional`, or a data member given a
value in the protocol; the protocol's body or value is then the answer the core takes when the
object has none, through :func:`with_defaults`. A record's reference field names the protocol
its object follows (``ref_field(follows=...)``), and :meth:`nxdplug.types.PluginRecord.load`
checks it with :func:`contract_problems`, so that a plugin's mistake (a missing method, a
``rows_fit`` that is not callable) is reported when the record is resolved, naming the plugin,
not as an AttributeError in the middle of a step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

_OPTIONAL = "__nxdplug_optional__"

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


def optional(method: F) -> F:
    """Mark a protocol's method as one a plugin's object may leave out; its body is the
    default answer."""
    setattr(method, _OPTIONAL, True)
    return method


def is_protocol(contract: type) -> bool:
    return bool(getattr(contract, "_is_protocol", False))


def _members(protocol: type) -> Iterator[tuple[str, bool, bool]]:
    """Each public member of ``protocol`` (and of the protocols it extends): its name, whether
    it is a method, and whether the object must have it."""
    seen: set[str] = set()
    for base in protocol.__mro__:
        if base is object or not is_protocol(base) or base.__module__ == "typing":
            continue
        namespace = vars(base)
        names = [*namespace, *namespace.get("__annotations__", {})]
        for name in names:
            if name.startswith("_") or name in seen:
                continue
            seen.add(name)
            value = namespace.get(name, _ABSENT)
            if inspect.isfunction(value):
                yield name, True, not getattr(value, _OPTIONAL, False)
            else:
                yield name, False, value is _ABSENT


_ABSENT = object()


def contract_problems(obj: object, contract: type) -> list[str]:
    """What ``obj`` (a class or an instance) lacks to follow ``contract``: a protocol's
    required methods it has not, members that should be methods and are not callable; or, for
    a plain class as the contract, not being its subclass (or instance). A class's data members
    may be set in its constructor, so only an instance's are checked; a function (a factory of
    such objects) is not checked, what it makes being known only once it runs."""
    if inspect.isroutine(obj):
        return []
    if not is_protocol(contract):
        fits = issubclass(obj, contract) if inspect.isclass(obj) else isinstance(obj, contract)
        return [] if fits else [f"is not a {contract.__name__}"]
    problems = []
    for name, is_method, required in _members(contract):
        value = getattr(obj, name, _ABSENT)
        if value is _ABSENT:
            if required and (is_method or not inspect.isclass(obj)):
                problems.append(f"has no {'method ' if is_method else ''}{name!r}")
        elif is_method and not callable(value):
            problems.append(f"{name!r} is not callable (a {type(value).__name__})")
    return problems


class _WithDefaults:
    """An object seen through its protocol: its own members, else the protocol's defaults."""

    def __init__(self, obj: object, protocol: type) -> None:
        self._obj = obj
        self._protocol = protocol

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._obj, name, _ABSENT)
        if value is not _ABSENT:
            return value
        default = inspect.getattr_static(self._protocol, name)
        return default.__get__(self._obj) if inspect.isfunction(default) else default


def with_defaults(obj: object, protocol: type[T]) -> T:
    """``obj`` with ``protocol``'s default for each optional member it leaves out, so that the
    core calls every member of the contract alike (``builder.rows_fit(...)``)."""
    return cast(T, _WithDefaults(obj, protocol))
