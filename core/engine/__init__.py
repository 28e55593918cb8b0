"""The serving engine: requests scheduled over the KV cache's lines (continuous batching).

:class:`~nxdplug.engine.engine.Engine` admits waiting requests into free cache lines, encodes
their prompts while the other lines keep decoding, and frees a line as soon as its request
ends. The server, the serving benchmark and scripts drive it the same way.
"""

from nxdplug.engine.engine import Engine
from nxdplug.engine.requests import (
    EngineFullError,
    RequestError,
    RequestOutput,
    SamplingSettings,
)

__all__ = ["Engine", "EngineFullError", "RequestError", "RequestOutput", "SamplingSettings"]
