"""What ``nxdplug inference_demo run`` does with a loaded model, as inference_demo does it: the
accuracy check on the first prompt, the generation of every prompt, the benchmark; and the
capture of the model's inputs. The checks and the benchmark are nxdplug's implementations of
NxD Inference's ``check_accuracy``, ``check_accuracy_logits`` and ``benchmark_sampling``."""

from __future__ import annotations

import argparse
import ast
import copy
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nxdplug.nxdi.demo.flags import COMMAND
from nxdplug.plugin_api import NxdPlugError, generate_keywords, load_tokenizer

if TYPE_CHECKING:
    from transformers import GenerationConfig

    from nxdplug.plugin_api import NeuronBaseForCausalLM, NeuronConfig

GENERATION_CONFIG_FLAGS = ("do_sample", "top_k", "pad_token_id", "dynamic", "top_p", "temperature")


def run_loaded(
    args: argparse.Namespace, model: NeuronBaseForCausalLM, draft: NeuronBaseForCausalLM | None
) -> int:
    """Check accuracy, generate and print the outputs, benchmark; 1 when logit matching
    failed (after the outputs are printed, as inference_demo)."""
    from nxdplug.plugin_api import HuggingFaceGenerationAdapter, LogitMatchingValidationError

    neuron_config = model.neuron_config
    tokenizer = load_tokenizer(args.model_path, COMMAND, padding_side=neuron_config.padding_side)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(str(args.compiled_model_path))
    generation_config = _generation_config(args, model)
    # Plugins' generate() keywords (adapter ids, ...); the draft model is this command's own.
    keywords = generate_keywords(_without_draft(args), model)
    if draft is not None:
        keywords["assistant_model"] = draft

    logit_error = None
    try:
        _check_accuracy(args, model, tokenizer, generation_config, draft)
    except LogitMatchingValidationError as exc:
        logit_error = exc
    indices = args.capture_indices
    if indices == "auto":
        indices = None if logit_error is None else [logit_error.get_divergence_index()]
    hook = capture_hook(indices, args.input_capture_save_dir) if indices else None

    prompts = args.prompts
    if len(prompts) == 1 and neuron_config.batch_size > 1:
        prompts = prompts * neuron_config.batch_size
    input_ids, attention_mask = _encode(args, tokenizer, prompts, neuron_config)
    print(f"\nGenerating outputs...\nPrompts: {prompts}")
    with torch.inference_mode():
        outputs = HuggingFaceGenerationAdapter(model, input_capture_hook=hook).generate(
            input_ids,
            attention_mask=attention_mask,
            generation_config=generation_config,
            max_length=neuron_config.max_length,
            **keywords,
        )
    print("Generated outputs:")
    for index, text in enumerate(tokenizer.batch_decode(outputs, skip_special_tokens=True)):
        print(f"Output {index}: {text}")
    if logit_error is not None:
        print(f"\nlogit matching failed: {logit_error.message}")
        return 1
    if args.benchmark:
        from nxdplug.nxdi.demo.sampling_benchmark import benchmark_sampling

        benchmark_sampling(
            model, draft, generation_config, benchmark_report_path=args.benchmark_report_path
        )
        print(f"Benchmark report written to {args.benchmark_report_path}")
    return 0


def _without_draft(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**(vars(args) | {"draft_model_path": None}))


def _generation_config(args: argparse.Namespace, model: NeuronBaseForCausalLM) -> GenerationConfig:
    """The checkpoint's GenerationConfig with the sampling flags, as inference_demo makes it."""
    from nxdplug.plugin_api import model_generation_config

    config = copy.deepcopy(model_generation_config(model))
    given = {key: getattr(args, key, None) for key in GENERATION_CONFIG_FLAGS}
    unused = config.update(**{key: value for key, value in given.items() if value is not None})
    for key, value in unused.items():
        setattr(config, key, value)
    return config


def _check_accuracy(
    args: argparse.Namespace,
    model: NeuronBaseForCausalLM,
    tokenizer: Any,
    generation_config: GenerationConfig,
    draft: NeuronBaseForCausalLM | None,
) -> None:
    """inference_demo's check of the first prompt (once per batch row): a token mismatch is an
    error; a logit mismatch raises LogitMatchingValidationError for the caller."""
    from nxdplug.plugin_api import check_accuracy, check_accuracy_logits

    mode = args.check_accuracy_mode
    if mode == "skip":
        print("\nSkipping accuracy check")
        return
    expected = None
    if args.expected_outputs_path is not None:
        expected = torch.load(args.expected_outputs_path, weights_only=False)
    common = {
        "prompt": args.prompts[0],
        "num_tokens_to_check": args.num_tokens_to_check,
        "input_start_offsets": args.input_start_offsets,
    }
    if mode == "token-matching":
        print("\nChecking accuracy by token matching")
        try:
            check_accuracy(
                model,
                tokenizer,
                generation_config,
                expected_token_ids=expected,
                draft_model=draft,
                **common,
            )
        except AssertionError as exc:
            raise NxdPlugError(f"token matching failed: {exc}") from exc
        print("token matching: PASS")
        return
    if draft is not None or model.plugins.speculation_mode is not None:
        raise NxdPlugError("logit-matching does not check a speculating model; use token-matching")
    print("\nChecking accuracy by logit matching")
    check_accuracy_logits(
        model,
        tokenizer,
        generation_config,
        expected_logits=None if expected is None else torch.stack(expected.scores),
        divergence_difference_tol=args.divergence_difference_tol,
        tol_map=_tol_map(args.tol_map),
        **common,
    )
    print("logit matching: PASS")


def _tol_map(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError) as exc:
        raise NxdPlugError(f"--tol-map {text!r} is not a Python literal ({exc})") from None


def _encode(
    args: argparse.Namespace, tokenizer: Any, prompts: list[str], neuron_config: NeuronConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts' ids and attention mask: cut to max_context_length with
    --allow-input-truncation, shifted right by --input-start-offsets."""
    cut = {"truncation": True, "max_length": neuron_config.max_context_length}
    batch = tokenizer(
        prompts, return_tensors="pt", padding=True, **(cut if args.allow_input_truncation else {})
    )
    ids, mask = batch.input_ids, batch.attention_mask
    if ids.shape[1] > neuron_config.max_context_length:
        raise NxdPlugError(
            f"a prompt has {ids.shape[1]} tokens, more than max_context_length "
            f"{neuron_config.max_context_length}: raise --max-context-length or give "
            "--allow-input-truncation"
        )
    if args.input_start_offsets:
        from nxdplug.plugin_api import shift_right

        ids, mask = shift_right(ids, mask, args.input_start_offsets, tokenizer.pad_token_id)
    return ids, mask


def capture_hook(indices: list[int], folder: Path | None) -> Callable[[Any, list], None]:
    """A hook saving the model's inputs at the passes ``indices`` of each generation (0:
    context encoding, n: the n-th token-generation pass) to ``saved_inputs_<cte|tkg>_<n>.pt``."""
    folder = folder or Path()
    state = {"pass": 0}

    def hook(model: NeuronBaseForCausalLM, inputs: list) -> None:
        state["pass"] = state["pass"] + 1 if model.kv_cache_populated else 0
        if state["pass"] in indices:
            folder.mkdir(parents=True, exist_ok=True)
            phase = "tkg" if state["pass"] else "cte"
            torch.save(tuple(inputs), folder / f"saved_inputs_{phase}_{state['pass']}.pt")

    return hook
