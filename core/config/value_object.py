"""Equality and repr by attributes, for the mutable config classes."""

from __future__ import annotations


class ComparedByValue:
    """Two instances of the same class are equal when their attributes are; unhashable, since
    the attributes can change."""

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        items = ", ".join(f"{name}={value!r}" for name, value in vars(self).items())
        return f"{type(self).__name__}({items})"
