"""An OpenAI-compatible HTTP server over the engine (``nxdplug serve``).

:mod:`~nxdplug.plugins.serve.engine_loop` runs the engine's step loop (on the thread that loaded the
model) and hands each request's outputs to an asyncio consumer;
:mod:`~nxdplug.plugins.serve.protocol` turns OpenAI requests into prompts and sampling settings,
:mod:`~nxdplug.plugins.serve.responses` outputs into OpenAI's responses and stream chunks;
:mod:`~nxdplug.plugins.serve.app` is the thin FastAPI layer between the two;
:mod:`~nxdplug.plugins.serve.metrics` the Prometheus metrics. fastapi, uvicorn and prometheus_client
are the ``serve`` extra: import these modules only when serving.
"""
