"""Slots: attributes of a core object that one plugin may replace, refused to a second one.

The core gives a slot its default in the owner's constructor (the model's ``output_stage``, an
attention module's ``cache_attention``); a plugin replaces it with :func:`claim_slot`, naming
itself. Two plugins claiming the same slot of the same object would otherwise silently keep the
last one's value, so the second is refused, naming both, as the registry refuses two plugins
giving the same name. The same claimant may claim again (one value per layer, a wrapper of its
own value).
"""

from __future__ import annotations

import weakref

from nxdplug.errors import PluginError

_claims: weakref.WeakKeyDictionary[object, dict[str, str]] = weakref.WeakKeyDictionary()


def claim_slot(owner: object, slot: str, value: object, *, claimant: str) -> None:
    """Set ``owner``'s ``slot`` to ``value`` for ``claimant`` (a plugin's or a record's
    name); raise PluginError when another claimant holds it, or when ``owner`` has no such
    attribute (the core gives every slot a default)."""
    if not hasattr(owner, slot):
        raise PluginError(
            f"{claimant!r} claims {type(owner).__name__}.{slot}, which is not an attribute the "
            "core gives a default; a slot is claimed only where it exists"
        )
    claims = _claims.setdefault(owner, {})
    holder = claims.get(slot, claimant)
    if holder != claimant:
        raise PluginError(
            f"{claimant!r} and {holder!r} both claim {type(owner).__name__}.{slot} (the "
            f"second would silently replace the first's); enable one of them"
        )
    claims[slot] = claimant
    setattr(owner, slot, value)
