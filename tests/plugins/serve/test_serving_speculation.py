"""``nxdplug serve --speculative-config`` (vLLM's flag): a real server on the shipped
pycoder-tiny (with its draft, EAGLE drafts or Medusa heads), driven by the ``openai`` client,
answering HF transformers' greedy text and counting its proposals under vLLM's metric
names."""

from __future__ import annotations

import json
import re

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from nxdplug.cli.main import main  # noqa: E402
from tests.plugins.serve.test_serving import get, running_server  # noqa: E402
from tests.shipped_models import (  # noqa: E402
    PYCODER,
    PYCODER_DRAFT,
    PYCODER_EAGLE,
    PYCODER_EAGLE3,
    PYCODER_MEDUSA,
)

TARGET, DRAFT = PYCODER, PYCODER_DRAFT
PROMPT = "x = [1, 2, 3]\ny = ["
CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    "draft_model": {"method": "draft_model", "model": str(DRAFT), "num_speculative_tokens": 3},
    "eagle": {
        "method": "eagle",
        "model": str(PYCODER_EAGLE),
        "num_speculative_tokens": 3,
    },
    "eagle3": {
        "method": "eagle3",
        "model": str(PYCODER_EAGLE3),
        "num_speculative_tokens": 3,
    },
    "medusa": {
        "method": "medusa",
        "model": str(PYCODER_MEDUSA),
        "speculative_token_tree": "[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]",
    },
}


def counter(metrics: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", metrics, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_a_speculating_server_answers_hfs_greedy_text(method) -> None:
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    hf = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    prompt_ids = tokenizer(PROMPT).input_ids
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=32, do_sample=False)
    expected = tokenizer.decode(out[0, len(prompt_ids) :], skip_special_tokens=True)

    options = ("--seq-len", "128", "--speculative-config", json.dumps(CONFIGS[method]))
    with running_server(TARGET, *options) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        completion = client.completions.create(
            model="tiny-llama", prompt=PROMPT, max_tokens=32, temperature=0
        )
        metrics = get(f"{base}/metrics")[1]

    assert completion.choices[0].text == expected
    drafted = counter(metrics, "nxdplug:spec_decode_num_draft_tokens_total")
    accepted = counter(metrics, "nxdplug:spec_decode_num_accepted_tokens_total")
    first = counter(metrics, 'nxdplug:spec_decode_num_accepted_tokens_per_pos_total{position="0"}')
    assert 0 < accepted <= drafted and 0 < first <= accepted
    assert counter(metrics, "nxdplug:spec_decode_num_drafts_total") > 0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{method: ngram}", "not JSON"),
        ('{"method": "ngram"}', "give num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "n": 1}', "'n' is not a"),
    ],
)
def test_a_bad_speculative_config_is_a_usage_error(capsys, value, message) -> None:
    assert main(["serve", "--model-path", str(TARGET), "--speculative-config", value]) == 2
    err = capsys.readouterr().err
    assert "--speculative-config" in err and message in err and "Traceback" not in err


def test_a_method_no_mode_serves_is_refused_by_name(capsys) -> None:
    config = '{"method": "mtp", "num_speculative_tokens": 2}'
    argv = ["serve", "--model-path", str(TARGET), "--port", "0", "--speculative-config", config]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "'mtp' is served by no installed speculation mode" in err
    assert "draft_model, eagle, eagle3, medusa, ngram" in err and "Traceback" not in err
