"""Helpers for nxdplug's tests and for third-party plugin authors.

- :func:`fresh_plugin_manager` and :func:`temporary_plugin`: plugin isolation;
- :func:`make_tiny_checkpoint`: a tiny random HF checkpoint of any registered architecture;
- :func:`check_accuracy`: the oracle check of an nxdplug model against HF transformers on the same
  checkpoint, by token matching (greedy, exact) or logit matching (per step, with teacher
  forcing on HF's tokens, tolerances that fit the dtype);
- :func:`check_low_precision`: a bf16/fp16 model judged against HF float32, no further off than
  HF's own forward in that dtype.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from nxdplug.errors import NxdPlugError
from nxdplug.manager import NxdPlugPluginManager, create_plugin_manager, use_plugin_manager
from nxdplug.modules.tensor_parallel import end_rank_process
from nxdplug.testing.precision import PrecisionReport, check_low_precision
from nxdplug.testing.tiny_models import make_tiny_checkpoint

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from nxdplug.config import NeuronConfig
    from nxdplug.runtime.application import NeuronBaseForCausalLM

__all__ = [
    "AccuracyReport",
    "PrecisionReport",
    "check_accuracy",
    "check_against_hf",
    "check_low_precision",
    "chi_square_p_value",
    "derived_checkpoint",
    "end_rank_process",
    "exact_top_k_marginals",
    "fresh_plugin_manager",
    "make_tiny_checkpoint",
    "random_prompts",
    "teacher_forced_logits",
    "temporary_plugin",
]

ACCURACY_MODES = ("token-matching", "logit-matching", "skip")

# (atol, rtol) per dtype for logits of the same checkpoint, nxdplug vs transformers.
LOGIT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (0.1, 0.02),
    torch.float16: (0.03, 0.005),
}


@contextmanager
def fresh_plugin_manager(
    *, load_entrypoints: bool = True, **options: Any
) -> Iterator[NxdPlugPluginManager]:
    """A new process-wide plugin manager inside the block; the previous one comes back after."""
    manager = create_plugin_manager(load_entrypoints=load_entrypoints, **options)
    with use_plugin_manager(manager):
        yield manager


@contextmanager
def temporary_plugin(
    plugin: Any, name: str, manager: NxdPlugPluginManager | None = None
) -> Iterator[Any]:
    """Register ``plugin`` under ``name`` for the block; always unregistered afterwards."""
    from nxdplug.manager import get_plugin_manager

    manager = manager or get_plugin_manager()
    manager.register_plugin(plugin, name)
    try:
        yield plugin
    finally:
        manager.unregister_plugin(name)


@attrs.frozen
class AccuracyReport:
    """The outcome of one accuracy check."""

    mode: str
    passed: bool
    expected: torch.Tensor
    actual: torch.Tensor
    first_mismatch: tuple[int, int] | None = None
    max_logit_error: float | None = None
    tolerance: tuple[float, float] | None = None

    def summary(self) -> str:
        new_tokens = self.expected.shape[1]
        if self.mode == "token-matching":
            if self.passed:
                rows = self.expected.shape[0]
                return f"token matching: PASS ({rows} rows x {new_tokens} tokens identical to HF)"
            row, index = self.first_mismatch
            return f"token matching: FAIL (row {row} differs from HF at new token {index})"
        verdict = "PASS" if self.passed else "FAIL"
        atol, rtol = self.tolerance
        divergence = (
            "greedy tokens identical"
            if self.first_mismatch is None
            else f"greedy tokens first differ at row {self.first_mismatch[0]}, "
            f"step {self.first_mismatch[1]}"
        )
        return (
            f"logit matching: {verdict} (max |error| {self.max_logit_error:.3g} over "
            f"{new_tokens} steps, atol {atol} rtol {rtol}; {divergence})"
        )


def _first_mismatch(expected: torch.Tensor, actual: torch.Tensor) -> tuple[int, int] | None:
    width = min(expected.shape[1], actual.shape[1])
    differs = expected[:, :width] != actual[:, :width]
    if expected.shape[1] != actual.shape[1] and not differs.any():
        return (0, width)
    if not differs.any():
        return None
    row = int(differs.any(dim=1).nonzero()[0])
    return row, int(differs[row].nonzero()[0])


def left_padded(
    input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same prompts padded on the left, the only layout HF decoder-only generation handles."""
    lengths = attention_mask.sum(-1)
    width = input_ids.shape[1]
    ids = torch.zeros_like(input_ids)
    mask = torch.zeros_like(attention_mask)
    for row in range(input_ids.shape[0]):
        count = int(lengths[row])
        ids[row, width - count :] = input_ids[row][attention_mask[row].bool()]
        mask[row, width - count :] = 1
    return ids, mask


def hf_greedy(
    hf_model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
) -> Any:
    """HF transformers' greedy generation with per-step logits (prompts left-padded for it)."""
    input_ids, attention_mask = left_padded(input_ids, attention_mask)
    pad = hf_model.generation_config.pad_token_id
    eos = hf_model.generation_config.eos_token_id
    with torch.inference_mode():
        return hf_model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad if pad is not None else 0,
            eos_token_id=eos,
            return_dict_in_generate=True,
            output_logits=True,
        )


def check_accuracy(
    model: NeuronBaseForCausalLM,
    hf_model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int,
    mode: str = "token-matching",
    tolerance: tuple[float, float] | None = None,
    generate_kwargs: dict[str, Any] | None = None,
) -> AccuracyReport:
    """Compare ``model`` (an nxdplug causal LM, loaded) with ``hf_model`` on the same prompts.

    ``generate_kwargs`` go to the model's ``generate()`` in token matching (e.g. the
    ``assistant_model`` of a speculating model)."""
    from nxdplug.generation.hf_adapter import HuggingFaceGenerationAdapter

    if mode not in ACCURACY_MODES[:2]:
        raise ValueError(f"mode must be one of {ACCURACY_MODES[:2]}, got {mode!r}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    prompt = input_ids.shape[1]
    reference = hf_greedy(hf_model, input_ids, attention_mask, max_new_tokens)
    expected = reference.sequences[:, prompt:]
    adapter = HuggingFaceGenerationAdapter(model)
    if mode == "token-matching":
        with torch.inference_mode():
            actual = adapter.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=hf_model.generation_config.eos_token_id,
                pad_token_id=hf_model.generation_config.pad_token_id or 0,
                **(generate_kwargs or {}),
            )[:, prompt:]
        mismatch = _first_mismatch(expected, actual)
        return AccuracyReport(mode, mismatch is None, expected, actual, mismatch)

    expected_logits = torch.stack([step.float() for step in reference.logits], dim=1)
    actual_logits = teacher_forced_logits(model, input_ids, attention_mask, expected)
    atol, rtol = tolerance or LOGIT_TOLERANCES[model.neuron_config.torch_dtype]
    error = (actual_logits - expected_logits).abs()
    passed = bool((error <= atol + rtol * expected_logits.abs()).all())
    actual = actual_logits.argmax(dim=-1)
    return AccuracyReport(
        mode,
        passed,
        expected,
        actual,
        _first_mismatch(expected_logits.argmax(dim=-1), actual),
        float(error.max()),
        (atol, rtol),
    )


def teacher_forced_logits(
    model: NeuronBaseForCausalLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    forced: torch.Tensor,
) -> torch.Tensor:
    """[batch, steps, vocab] logits of ``model`` when fed ``forced`` tokens after the prompt."""
    model.reset()
    logits = []
    mask = attention_mask
    step_input = input_ids
    with torch.inference_mode():
        for step in range(forced.shape[1]):
            step_logits = model(input_ids=step_input, attention_mask=mask).logits
            if step_logits is None:
                raise NxdPlugError(
                    "logit matching needs the model's logits, and this model samples on device "
                    "without returning them: set NeuronConfig(output_logits=True)"
                )
            logits.append(step_logits[:, -1])
            step_input = forced[:, step : step + 1]
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
    return torch.stack(logits, dim=1)


def check_against_hf(
    model_path: str,
    neuron_config: NeuronConfig | None = None,
    *,
    prompts: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 32,
    mode: str = "token-matching",
    tolerance: tuple[float, float] | None = None,
) -> AccuracyReport:
    """One call for a plugin author's test: load ``model_path`` with nxdplug (the model plugin is
    chosen by the registry) and with HF transformers in the same dtype, and compare them.

    ``prompts`` default to two random prompts of different lengths (left-padded, ids from 1).
    """
    from nxdplug.config import NeuronConfig
    from nxdplug.runtime.application import from_pretrained

    if neuron_config is None:
        neuron_config = NeuronConfig(
            batch_size=2, seq_len=max_new_tokens + 32, max_context_length=32, torch_dtype="float32"
        )
    model = from_pretrained(model_path, neuron_config)
    model.to_cpu()
    hf_model = model.load_hf_model(model_path, dtype=neuron_config.torch_dtype).eval()
    if prompts is None:
        prompts, attention_mask = random_prompts(model.config.vocab_size, (7, 13))
    return check_accuracy(
        model,
        hf_model,
        prompts,
        attention_mask,
        max_new_tokens=max_new_tokens,
        mode=mode,
        tolerance=tolerance,
    )


def random_prompts(
    vocab_size: int, lengths: tuple[int, ...], seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts of the given lengths (ids 1.., so not the usual pad id 0)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(
            1, vocab_size, (length,), generator=generator
        )
        mask[row, width - length :] = 1
    return input_ids, mask


def chi_square_p_value(counts: torch.Tensor, expected_probabilities: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test of ``counts`` against the probabilities, over the
    tokens they keep (bins expecting fewer than 5 draws merged into one); 0 when a token they
    filter out was drawn."""
    kept = expected_probabilities > 0
    if counts[~kept].any():
        return 0.0
    expected = expected_probabilities[kept].double() * counts.sum()
    observed = counts[kept].double()
    small = expected < 5
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
    statistic = ((observed - expected) ** 2 / expected).sum()
    degrees = torch.tensor(len(expected) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(degrees / 2, statistic / 2))


def derived_checkpoint(
    source: str | Path,
    output: str | Path,
    *,
    num_layers: int | None = None,
    edit: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> Path:
    """A checkpoint made from ``source``'s weights: its first ``num_layers`` layers (with its
    embeddings, final norm and LM head), and/or tensors changed in place by ``edit``.

    Speculation tests use it to build drafts that agree with a target often (its first layers,
    or the target itself) or never (an LM head edited to always pick one token).
    """
    from safetensors.torch import load_file, save_file

    source, output = Path(source), Path(output)
    output.mkdir(parents=True)
    for item in source.iterdir():
        if item.name not in ("config.json", "model.safetensors"):
            shutil.copy(item, output / item.name)
    config = json.loads((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors")
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
        kept = {f"model.layers.{i}." for i in range(num_layers)}
        tensors = {
            name: tensor
            for name, tensor in tensors.items()
            if not name.startswith("model.layers.") or any(name.startswith(k) for k in kept)
        }
    if edit is not None:
        edit(tensors)
    (output / "config.json").write_text(json.dumps(config, indent=2))
    save_file({name: t.contiguous() for name, t in tensors.items()}, output / "model.safetensors")
    return output


def exact_top_k_marginals(
    checkpoint: str | Path,
    prompt: torch.Tensor,
    steps: int,
    top_k: int,
    processors: Any = None,
) -> list[torch.Tensor]:
    """P(t_1), ..., P(t_steps) [vocab] of top-k sampling at temperature 1 after ``prompt``
    ([length]), computed with HF transformers over every path of ``steps`` tokens (top_k**steps
    of them): the reference that sampled speculation is tested against. ``processors`` (a
    transformers LogitsProcessorList) run before the top-k filter, as in HF's ``generate()``."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    paths: dict[tuple[int, ...], float] = {(): 1.0}
    marginals = []
    with torch.no_grad():
        for _ in range(steps):
            prefixes = list(paths)
            inputs = torch.stack(
                [torch.cat([prompt, torch.tensor(p, dtype=torch.long)]) for p in prefixes]
            )
            logits = hf(inputs).logits[:, -1]
            if processors is not None:
                logits = processors(inputs, logits)
            kth = logits.topk(top_k, dim=-1).values[..., -1:]
            probabilities = logits.masked_fill(logits < kth, float("-inf")).softmax(-1)
            marginal = torch.zeros(probabilities.shape[-1], dtype=torch.float64)
            longer = {}
            for prefix, row in zip(prefixes, probabilities, strict=True):
                for token in row.nonzero().flatten().tolist():
                    weight = paths[prefix] * float(row[token])
                    marginal[token] += weight
                    longer[(*prefix, token)] = weight
            marginals.append(marginal)
            paths = longer
    return marginals
