"""The command line's speculation: what ``nxdplug serve --speculative-config`` refuses."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from nxdplug.cli.speculation import engine_draft
from nxdplug.engine.speculative import SpeculativeConfig
from nxdplug.errors import NxdPlugError


def test_a_draft_model_over_tensor_parallel_ranks_is_refused_by_name(tmp_path) -> None:
    args = argparse.Namespace(speculative_config=SpeculativeConfig("draft_model", 3, str(tmp_path)))
    config = SimpleNamespace(neuron_config=SimpleNamespace(tp_degree=2))
    with pytest.raises(
        NxdPlugError, match="draft_model with tensor parallelism is not implemented"
    ):
        engine_draft(args, config)
