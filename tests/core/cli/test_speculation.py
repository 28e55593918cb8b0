"""The command line's speculation: what ``nxdplug serve --speculative-config`` refuses."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from nxdplug.cli.speculation import engine_draft
from nxdplug.engine.speculative import SpeculativeConfig
from nxdplug.errors import NxdPlugError


def test_a_draft_tensor_parallel_size_other_than_one_or_the_targets_is_refused(tmp_path) -> None:
    config = SpeculativeConfig("draft_model", 3, str(tmp_path), draft_tensor_parallel_size=4)
    args = argparse.Namespace(speculative_config=config)
    target = SimpleNamespace(neuron_config=SimpleNamespace(tp_degree=2))
    with pytest.raises(
        NxdPlugError,
        match=r"--speculative-config: draft_tensor_parallel_size=4: .* give 2 \(the default\) or 1",
    ):
        engine_draft(args, target)
