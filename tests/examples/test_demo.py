"""``make demo`` on the model shipped with the project (examples/models/): readable code,
HF's tokens, and speculation with its measured effect."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests import REPO_ROOT
from tests.shipped_models import MODELS as SHIPPED

ROOT = REPO_ROOT
# The trainers' float32 originals, when a checkout sits beside them: the shipped copies are
# checked to be exactly their bf16 rounding (a provenance check; nothing else reads them).
TRAINED = ROOT.parent / "shared" / "models"


@pytest.mark.parametrize("name", ["pycoder-tiny", "pycoder-draft"])
def test_shipped_models_are_the_trained_ones_in_bfloat16(name: str) -> None:
    if not (TRAINED / name / "model.safetensors").is_file():
        pytest.skip(f"the trained originals are not beside this checkout ({TRAINED})")
    shipped = load_file(SHIPPED / name / "model.safetensors")
    trained = load_file(TRAINED / name / "model.safetensors")

    assert shipped.keys() == trained.keys()
    for key, tensor in trained.items():
        assert shipped[key].dtype == torch.bfloat16
        assert torch.equal(shipped[key], tensor.to(torch.bfloat16)), key
    shipped_config = json.loads((SHIPPED / name / "config.json").read_text())
    trained_config = json.loads((TRAINED / name / "config.json").read_text())
    for config in (shipped_config, trained_config):
        config.pop("torch_dtype"), config.pop("dtype")
    assert shipped_config == trained_config
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (SHIPPED / name / file).read_bytes() == (TRAINED / name / file).read_bytes()


def test_make_demo_generates_hf_tokens_with_and_without_speculation() -> None:
    venv = Path(sys.prefix)
    if not (venv / "bin" / "nxdplug").is_file():
        pytest.skip(f"the nxdplug command is not installed in {venv}")
    # -o: the demo runs with this environment as it is; make never reinstalls it meanwhile.
    done = subprocess.run(
        ["make", "-s", "-o", str(venv / ".installed"), "demo", f"VENV={venv}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]

    assert output.count("token matching: PASS (3 rows x 48 tokens identical to HF)") == 2, output
    outputs = re.findall(r"^Output \d: (.*)$", output, flags=re.M)
    assert outputs[:3] == ["class Stack:", "def read_lines(path):", "class Cache(dict):"]
    (calls,) = re.findall(r"\(([\d.]+) tokens per call\)", output)
    assert float(calls) > 2.0  # the draft saves target calls (2.10 measured)
