"""Draft-model speculation and prompt lookup (``speculation_length=k``).

Lossless: greedy output with speculation equals the target's own greedy output, for drafts
that agree always (the target itself), often (the target with noise in its last MLP) and never
(an LM head of zeros),
at batch 1 and above with prompts of different lengths. Sampling: the tokens at the speculated
positions follow the target's distribution, computed exactly with HF transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nxdplug import HuggingFaceGenerationAdapter, NeuronConfig, from_pretrained
from nxdplug.errors import ConfigError, NotSupportedError, NxdPlugError
from nxdplug.pipeline import select_plugins
from nxdplug.runtime.speculation import greedy_acceptance, rejection_acceptance
from nxdplug.testing import (
    chi_square_p_value,
    derived_checkpoint,
    exact_top_k_marginals,
    random_prompts,
)
from tests.shipped_models import PYCODER, PYCODER_DRAFT, file_start_prompts

ALPHA = 1e-3
K = 3


def application(path: Path, batch: int = 3, seq_len: int = 64, **settings):
    config = NeuronConfig(batch_size=batch, seq_len=seq_len, torch_dtype="float32", **settings)
    app = from_pretrained(path, config)
    app.to_cpu()
    return app


def target(path: Path, batch: int = 3, k: int = K, **settings):
    return application(path, batch, speculation_length=k, trace_tokengen_model=False, **settings)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_checkpoint) -> dict[str, Path]:
    main = tiny_checkpoint("llama", seed=3, num_hidden_layers=3)
    folder = tmp_path_factory.mktemp("drafts")

    def zero_lm_head(tensors):
        tensors["lm_head.weight"].zero_()  # every logit 0: always proposes token 0

    def perturb_last_mlp(tensors):
        generator = torch.Generator().manual_seed(0)
        for name, tensor in tensors.items():
            if name.startswith("model.layers.2.mlp."):
                noise = torch.randn(tensor.shape, generator=generator) * tensor.std() * 0.3
                tensor += noise

    return {
        "target": main,
        "perturbed": derived_checkpoint(main, folder / "perturbed", edit=perturb_last_mlp),
        "always-wrong": derived_checkpoint(main, folder / "zero-head", edit=zero_lm_head),
    }


@pytest.fixture(scope="module")
def apps(checkpoints):
    return {
        "plain": application(checkpoints["target"]),
        "speculating": target(checkpoints["target"]),
        "self": application(checkpoints["target"]),
        "perturbed": application(checkpoints["perturbed"]),
        "always-wrong": application(checkpoints["always-wrong"]),
    }


def greedy(app, input_ids, mask, **kwargs) -> torch.Tensor:
    adapter = HuggingFaceGenerationAdapter(app)
    return adapter.generate(input_ids, attention_mask=mask, do_sample=False, **kwargs)


def test_speculation_length_selects_the_draft_model_mode(checkpoints) -> None:
    app = target(checkpoints["target"], batch=1)
    assert app.plugins.speculation_mode.name == "draft-model"
    assert [w.tag for w in app.models] == ["context_encoding_model", "speculation_model"]
    assert app.submodel("speculation_model").input_generator()[0].input_ids.shape == (1, K + 1)
    config = app.config
    config.neuron_config.enable_fused_speculation = True
    selection = select_plugins(config)
    assert selection.speculation_mode is None or selection.speculation_mode.name != "draft-model"


@pytest.mark.parametrize("lengths", [(5,), (3, 9), (2, 11, 6)])
@pytest.mark.parametrize("draft", ["self", "perturbed", "always-wrong"])
def test_greedy_speculation_with_a_draft_is_lossless(apps, draft, lengths) -> None:
    input_ids, mask = random_prompts(512, lengths, seed=len(lengths))
    expected = greedy(apps["plain"], input_ids, mask, max_new_tokens=20)
    new = expected[:, input_ids.shape[1] :]
    assert len({tuple(row.tolist()) for row in new[:, :10].T}) > 3, "greedy output barely varies"
    assert (new != 0).all(), "precondition: the target never picks token 0 (the eos)"

    speculating = apps["speculating"]
    actual = greedy(speculating, input_ids, mask, max_new_tokens=20, assistant_model=apps[draft])
    assert torch.equal(actual, expected)
    stats = speculating.speculation_stats
    if draft == "self":
        assert stats.acceptance_rate == 1.0
    elif draft == "always-wrong":
        assert stats.accepted == 0
        assert stats.row_calls == 19 * len(lengths)  # one token per call after the prompt's
    else:
        assert 0 < stats.acceptance_rate < 1


@pytest.mark.parametrize("lengths", [(12,), (4, 13, 8)])
def test_greedy_prompt_lookup_is_lossless(apps, lengths) -> None:
    input_ids, mask = random_prompts(512, lengths, seed=7)
    input_ids[:, -4:] = input_ids[:, -8:-4]  # a repeat for the lookup to find
    expected = greedy(apps["plain"], input_ids, mask, max_new_tokens=24)
    speculating = apps["speculating"]
    actual = greedy(speculating, input_ids, mask, max_new_tokens=24, prompt_lookup_num_tokens=2)
    assert torch.equal(actual, expected)
    assert speculating.speculation_stats.row_calls > 0


def test_greedy_acceptance_keeps_leading_matches_and_adds_the_target_token() -> None:
    logits = torch.full((2, 4, 10), -1.0)
    targets = torch.tensor([[3, 5, 7, 1], [2, 2, 2, 2]])
    logits.scatter_(-1, targets[..., None], 1.0)
    tokens, counts = greedy_acceptance(torch.tensor([[3, 5, 6], [4, 2, 2]]), logits)
    assert counts.tolist() == [3, 1]
    assert tokens[0, :3].tolist() == [3, 5, 7]
    assert tokens[1, :1].tolist() == [2]


@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_rejection_acceptance_outputs_the_target_distribution(deterministic_draft) -> None:
    generator = torch.Generator().manual_seed(0)
    rows, k, vocab = 20_000, 2, 8
    p = torch.softmax(torch.randn(k + 1, vocab, generator=generator) * 1.5, -1)
    q = torch.softmax(torch.randn(k, vocab, generator=generator) * 1.5, -1)
    drafts = torch.multinomial(q, rows, replacement=True, generator=generator).T
    if deterministic_draft:  # prompt lookup: the same proposal every time, q one-hot
        drafts = torch.tensor([[2, 5]]).expand(rows, k)
    draft_probabilities = None if deterministic_draft else q.expand(rows, k, vocab)
    tokens, counts = rejection_acceptance(
        drafts, draft_probabilities, p.expand(rows, k + 1, vocab), generator
    )
    first = torch.bincount(tokens[:, 0], minlength=vocab)
    assert chi_square_p_value(first, p[0]) > ALPHA
    assert 1 < counts.float().mean() < k + 1
    wrong = torch.softmax(p[0].log() * 0.7, -1)
    assert chi_square_p_value(first, wrong) < ALPHA


@pytest.mark.parametrize("proposer", ["draft", "lookup"])
def test_sampled_speculation_follows_the_target_distribution(
    tmp_path, tiny_checkpoint, proposer
) -> None:
    rows, calls, top_k = 64, 40, 4
    main = tiny_checkpoint("llama", seed=5, num_hidden_layers=3, initializer_range=0.3)
    draft_path = derived_checkpoint(main, tmp_path / "draft", num_layers=2)
    speculating = target(main, batch=rows, k=2, seq_len=32)
    source = (
        {"assistant_model": application(draft_path, batch=rows, seq_len=32)}
        if proposer == "draft"
        else {"prompt_lookup_num_tokens": 2}
    )
    prompt = torch.tensor([3, 9, 4, 17, 5])
    adapter = HuggingFaceGenerationAdapter(speculating)
    torch.manual_seed(0)
    vocab = speculating.config.vocab_size
    counts = torch.zeros(3, vocab, dtype=torch.long)
    accepted = drafted = 0
    for _ in range(calls):
        out = adapter.generate(
            prompt.expand(rows, -1),
            do_sample=True,
            top_k=top_k,
            max_new_tokens=3,
            eos_token_id=None,
            **source,
        )
        for position in range(3):
            counts[position] += torch.bincount(out[:, 5 + position], minlength=vocab)
        accepted += speculating.speculation_stats.accepted
        drafted += speculating.speculation_stats.drafted
    assert 0 < accepted < drafted, "both acceptance and rejection must happen"
    for position, marginal in enumerate(exact_top_k_marginals(main, prompt, 3, top_k)):
        assert chi_square_p_value(counts[position], marginal) > ALPHA, position
    draft_marginals = exact_top_k_marginals(draft_path, prompt, 3, top_k)
    assert chi_square_p_value(counts[2], draft_marginals[2]) < ALPHA


def test_compiled_target_gives_the_eager_tokens(apps, checkpoints, tmp_path) -> None:
    input_ids, mask = random_prompts(512, (6, 10), seed=11)
    expected = greedy(apps["plain"], input_ids, mask, max_new_tokens=16)
    config = NeuronConfig(
        batch_size=2,
        seq_len=64,
        torch_dtype="float32",
        speculation_length=K,
        trace_tokengen_model=False,
        compile_backend="inductor",
    )
    compiled = from_pretrained(checkpoints["target"], config)
    compiled.compile(tmp_path / "compiled", quiet=True)
    fresh = from_pretrained(checkpoints["target"], config)
    fresh.load(tmp_path / "compiled", quiet=True)
    draft = application(checkpoints["perturbed"], batch=2)
    actual = greedy(fresh, input_ids, mask, max_new_tokens=16, assistant_model=draft)
    assert torch.equal(actual, expected)
    assert fresh.speculation_stats.accepted > 0


def test_generate_says_what_is_missing(apps, checkpoints) -> None:
    input_ids, mask = random_prompts(512, (5,), seed=1)
    with pytest.raises(NotSupportedError, match="assistant_model=<draft application>"):
        greedy(apps["speculating"], input_ids, mask, max_new_tokens=4)
    with pytest.raises(NotSupportedError, match="speculation_length=k"):
        greedy(apps["plain"], input_ids, mask, max_new_tokens=4, assistant_model=apps["self"])
    with pytest.raises(NotSupportedError, match="speculation_length=k"):
        greedy(apps["plain"], input_ids, mask, max_new_tokens=4, prompt_lookup_num_tokens=2)
    with pytest.raises(NotSupportedError, match="at most 3"):
        greedy(apps["speculating"], input_ids, mask, max_new_tokens=4, prompt_lookup_num_tokens=5)
    with pytest.raises(NotSupportedError, match="nxdplug application"):
        greedy(apps["speculating"], input_ids, mask, max_new_tokens=4, assistant_model=object())
    with pytest.raises(NxdPlugError, match="raise seq_len"):
        greedy(apps["speculating"], input_ids, mask, max_new_tokens=58, prompt_lookup_num_tokens=2)


def test_a_draft_with_another_vocabulary_is_refused(apps, tiny_checkpoint) -> None:
    other = application(tiny_checkpoint("llama", vocab_size=300))
    input_ids, mask = random_prompts(300, (5,), seed=1)
    with pytest.raises(NotSupportedError, match="vocabulary"):
        greedy(apps["speculating"], input_ids, mask, max_new_tokens=4, assistant_model=other)


def test_on_device_sampling_is_refused_with_a_draft(checkpoints) -> None:
    from nxdplug import OnDeviceSamplingConfig

    with pytest.raises(ConfigError, match="on_device_sampling_config=None"):
        target(checkpoints["target"], on_device_sampling_config=OnDeviceSamplingConfig())


def test_trained_draft_speeds_up_pycoder_losslessly() -> None:
    """The acceptance figures of docs/speculative-decoding.md: 20 held-out prompts, 64 new
    tokens, k=4 (on the shipped bf16-rounded models: 2.75 tokens per call with the draft, 1.46
    with prompt lookup)."""
    prompts = torch.tensor(file_start_prompts(20))
    mask = torch.ones_like(prompts)
    plain = application(PYCODER, batch=20, seq_len=160)
    expected = greedy(plain, prompts, mask, max_new_tokens=64)
    speculating = target(PYCODER, batch=20, k=4, seq_len=160)
    draft = application(PYCODER_DRAFT, batch=20, seq_len=160)
    actual = greedy(speculating, prompts, mask, max_new_tokens=64, assistant_model=draft)
    assert torch.equal(actual, expected)
    assert speculating.speculation_stats.tokens_per_call > 2.2  # the trainers' simulation: 2.66
    actual = greedy(speculating, prompts, mask, max_new_tokens=64, prompt_lookup_num_tokens=4)
    assert torch.equal(actual, expected)
    assert speculating.speculation_stats.tokens_per_call > 1.2


SPECULATING = ["--speculation-length", "3", "--neuron-config", "trace_tokengen_model=false"]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    from nxdplug.cli.main import main

    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("proposer", ["draft", "lookup"])
def test_run_reports_acceptance_and_matches_hf(capsys, checkpoints, proposer) -> None:
    source = (
        ["--draft-model-path", str(checkpoints["perturbed"])]
        if proposer == "draft"
        else ["--prompt-lookup-num-tokens", "2"]
    )
    code, out, err = run_cli(
        capsys,
        "run",
        "--model-path",
        str(checkpoints["target"]),
        "--prompt",
        "def f(x): return x",
        "--prompt",
        "import os",
        "--max-new-tokens",
        "12",
        "--torch-dtype",
        "float32",
        "--check-accuracy-mode",
        "token-matching",
        *SPECULATING,
        *source,
    )
    assert code == 0, out + err
    assert "speculation: " in out and "accepted tokens per target call" in out
    assert "token matching: PASS" in out


def test_run_refuses_a_draft_without_speculation(capsys, checkpoints) -> None:
    code, _, err = run_cli(
        capsys,
        "run",
        "--model-path",
        str(checkpoints["target"]),
        "--prompt",
        "x",
        "--draft-model-path",
        str(checkpoints["perturbed"]),
    )
    assert code != 0
    assert "--draft-model-path needs --speculation-length" in err
    assert "Traceback" not in err


def test_benchmark_compares_with_and_without_speculation(capsys, checkpoints, tmp_path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": [5 + i] * 10}) for i in range(3)))
    code, out, err = run_cli(
        capsys,
        "benchmark",
        "--model-path",
        str(checkpoints["target"]),
        "--draft-model-path",
        str(checkpoints["perturbed"]),
        "--prompt-file",
        str(prompts),
        "--batch-size",
        "2",
        "--prompt-length",
        "8",
        "--max-new-tokens",
        "6",
        "--runs",
        "1",
        "--json",
        "--quiet",
        *SPECULATING,
    )
    assert code == 0, out + err
    report = json.loads(out)
    assert report["config"]["mode"] == "draft-model"
    assert report["speedup"] == pytest.approx(
        report["speculative_tokens_per_s"] / report["plain_tokens_per_s"]
    )
    assert report["acceptance"]["target_calls_per_row"] > 0
    assert 0 <= report["acceptance"]["acceptance_rate"] <= 1


def test_run_refuses_logit_matching_before_generating(capsys, checkpoints) -> None:
    code, out, err = run_cli(
        capsys,
        "run",
        "--model-path",
        str(checkpoints["target"]),
        "--prompt",
        "x",
        "--prompt-lookup-num-tokens",
        "2",
        "--check-accuracy-mode",
        "logit-matching",
        *SPECULATING,
    )
    assert code != 0
    assert "use token-matching" in err
    assert "Generated outputs" not in out


def test_benchmark_compares_with_hf_assisted_generation(capsys, checkpoints) -> None:
    common = [
        "benchmark",
        "--model-path",
        str(checkpoints["target"]),
        "--draft-model-path",
        str(checkpoints["perturbed"]),
        "--prompt-length",
        "8",
        "--max-new-tokens",
        "6",
        "--runs",
        "1",
        "--quiet",
        "--compare-hf",
        *SPECULATING,
    ]
    code, out, err = run_cli(capsys, *common, "--json")
    assert code == 0, out + err
    report = json.loads(out)
    assert report["ratio_to_hf_speculative"] == pytest.approx(
        report["speculative_tokens_per_s"] / report["hf_speculative_tokens_per_s"]
    )
    code, _, err = run_cli(capsys, *common, "--batch-size", "2")
    assert code != 0 and "--batch-size 1" in err


def test_the_speculation_sub_model_runs_spec_batch_size_rows(checkpoints) -> None:
    app = target(checkpoints["target"], batch=2, spec_batch_size=4, max_batch_size=4)
    speculation_model = app.submodel("speculation_model")
    assert speculation_model.batch_size == 4
    assert speculation_model.input_generator()[0].input_ids.shape == (4, K + 1)
    assert app.context_encoding_model.batch_size == 2
    input_ids, mask = random_prompts(512, (5, 8), seed=4)
    expected = greedy(
        application(checkpoints["target"], batch=2), input_ids, mask, max_new_tokens=8
    )
    actual = greedy(app, input_ids, mask, max_new_tokens=8, prompt_lookup_num_tokens=2)
    assert torch.equal(actual, expected)
