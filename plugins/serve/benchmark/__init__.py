"""``nxdplug benchmark-serving``: a load of streamed requests against OpenAI-compatible servers."""
