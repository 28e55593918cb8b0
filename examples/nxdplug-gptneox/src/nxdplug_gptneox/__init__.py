"""GPT-NeoX for nxdplug, shipped as its own distribution (``nxdplug-gptneox``).

Nothing heavy is imported here: nxdplug loads :mod:`nxdplug_gptneox.hooks` through the package's
entry point, and the model code only when a GPT-NeoX checkpoint is used.
"""
