"""An OpenAI-compatible HTTP server over the engine (``nxdplug serve``).

:mod:`~nxdplug.serving.engine_loop` runs the engine's step loop (on the thread that loaded the
model) and hands each request's outputs to an asyncio consumer;
:mod:`~nxdplug.serving.protocol` turns OpenAI requests into prompts and sampling settings,
:mod:`~nxdplug.serving.responses` outputs into OpenAI's responses and stream chunks;
:mod:`~nxdplug.serving.app` is the thin FastAPI layer between the two;
:mod:`~nxdplug.serving.metrics` the Prometheus metrics. fastapi, uvicorn and prometheus_client
are the ``serve`` extra: import these modules only when serving.
"""
