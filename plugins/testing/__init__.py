"""Helpers for nxdplug's tests and for third-party plugin authors (a plugin, as pytest's
``pytester``, that also gives ``nxdplug make-tiny-model``).

- :func:`fresh_plugin_manager` and :func:`temporary_plugin`: plugin isolation;
- :func:`make_tiny_checkpoint`: a tiny random HF checkpoint of any registered architecture;
- :func:`check_accuracy`: the oracle check of an nxdplug model against HF transformers on the same
  checkpoint, by token matching (greedy, exact) or logit matching (per step, with teacher
  forcing on HF's tokens, tolerances that fit the dtype);
- :func:`check_low_precision`: a bf16/fp16 model judged against HF float32, no further off than
  HF's own forward in that dtype.

Each name is imported from its module on first use, so that the plugin's hooks module (which
``nxdplug plugins list`` imports) imports no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AccuracyReport": "nxdplug.plugin_api",
    "LOGIT_TOLERANCES": "nxdplug.plugin_api",
    "PrecisionReport": "nxdplug.testing.precision",
    "check_accuracy": "nxdplug.testing.hf_checks",
    "check_against_hf": "nxdplug.testing.hf_checks",
    "check_low_precision": "nxdplug.testing.precision",
    "chi_square_p_value": "nxdplug.testing.sampling_checks",
    "derived_checkpoint": "nxdplug.testing.derived_checkpoints",
    "end_rank_process": "nxdplug.plugin_api",
    "exact_top_k_marginals": "nxdplug.testing.sampling_checks",
    "fresh_plugin_manager": "nxdplug.testing.plugin_managers",
    "hf_greedy": "nxdplug.plugin_api",
    "left_padded": "nxdplug.plugin_api",
    "make_tiny_checkpoint": "nxdplug.testing.tiny_models",
    "random_prompts": "nxdplug.testing.hf_checks",
    "teacher_forced_logits": "nxdplug.plugin_api",
    "temporary_plugin": "nxdplug.testing.plugin_managers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(module), name)
    return value


def __dir__() -> list[str]:
    return __all__
