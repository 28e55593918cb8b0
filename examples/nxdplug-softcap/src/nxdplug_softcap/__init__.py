"""nxdplug-softcap: Gemma-2 style final-logit soft-capping as a third-party nxdplug plugin.

The plugin is :mod:`nxdplug_softcap.hooks` (entry point ``softcap`` in group ``nxdplug``); the
math is :mod:`nxdplug_softcap.softcap`.
"""

from __future__ import annotations

__version__ = "0.1.0"
