"""What NxD Inference's helper modules do, through ``nxdplug.nxdi``: argparse_utils,
constants, the phase tags, gqa, inference_demo's parse_args / create_neuron_config, the
accuracy input helpers and Llama's per-layer configs."""

from __future__ import annotations

import argparse

import pytest
import torch
from transformers import AutoTokenizer, BatchEncoding

from nxdplug.nxdi.utils.argparse_utils import AUTO, StringOrIntegers


def capture_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--capture-indices", nargs="+", action=StringOrIntegers)
    return parser


def test_string_or_integers_takes_integers_or_auto_alone() -> None:
    parser = capture_parser()
    assert parser.parse_args(["--capture-indices", "0", "2"]).capture_indices == [0, 2]
    assert parser.parse_args(["--capture-indices", "AUTO"]).capture_indices == AUTO == "auto"
    with pytest.raises(argparse.ArgumentError, match="only be used once"):
        parser.parse_args(["--capture-indices", "auto", "3"])
    with pytest.raises(argparse.ArgumentError, match="'x' is not a valid input"):
        parser.parse_args(["--capture-indices", "1", "x"])


def test_constants_and_tags_have_nxd_inference_values() -> None:
    from nxdplug.nxdi.models import model_wrapper
    from nxdplug.nxdi.utils import constants

    # NxD Inference's values (utils/constants.py and models/model_wrapper.py).
    assert constants.TEST_PROMPT == "Hello, I am a language model, and I am here to help,"
    assert constants.BENCHMARK_REPORT_PATH == "./benchmark_report.json"
    assert constants.END_TO_END_MODEL == "e2e_model"
    assert model_wrapper.CONTEXT_ENCODING_MODEL_TAG == constants.CONTEXT_ENCODING_MODEL
    assert constants.CONTEXT_ENCODING_MODEL == "context_encoding_model"
    assert constants.TOKEN_GENERATION_MODEL == "token_generation_model"
    assert model_wrapper.SPECULATION_MODEL_TAG == "speculation_model"
    from nxdplug.plugins.medusa.submodels import MEDUSA_MODEL_TAG

    assert MEDUSA_MODEL_TAG == "medusa_speculation_model"
    assert model_wrapper.FUSED_SPECULATION_MODEL_TAG == "fused_speculation_model"


def test_gqa_takes_nxd_inference_keywords() -> None:
    from nxdplug.nxdi.modules.attention.gqa import (
        GQA,
        determine_sharding_strategy,
        get_shardable_head_counts,
    )

    assert determine_sharding_strategy(8, 4, desired_sharding_strategy=None) is (
        GQA.REPLICATE_TO_TP_DEGREE
    )
    assert (
        determine_sharding_strategy(
            tp_degree=8,
            source_key_value_heads=3,
            desired_sharding_strategy=GQA.REPLICATE_TO_TP_DEGREE,
        )
        is GQA.CONVERT_TO_MHA
    )
    counts = get_shardable_head_counts(
        tp_degree=32, num_attention_heads=56, num_key_value_heads=8,
        sharding_strategy=GQA.REPLICATE_TO_TP_DEGREE,
    )  # fmt: skip
    assert counts == (64, 32)


def test_parse_args_and_create_neuron_config(tiny_checkpoint, tmp_path) -> None:
    from nxdplug.contrib_models.llama.modeling_llama import (
        LlamaNeuronConfig,
        NeuronLlamaForCausalLM,
    )
    from nxdplug.nxdi.inference_demo import create_neuron_config, parse_args

    args = parse_args(
        [
            "--model-type", "llama", "--task-type", "causal-lm", "run",
            "--model-path", str(tiny_checkpoint("llama")),
            "--compiled-model-path", str(tmp_path), "--prompt", "hi", "--prompt", "there",
            "--seq-len", "48", "--torch-dtype", "float32", "--allow-input-truncation",
            "--capture-indices", "auto",
        ]
    )  # fmt: skip
    assert (args.model_type, args.capture_indices) == ("llama", "auto")
    config = create_neuron_config(NeuronLlamaForCausalLM, args)
    assert type(config) is LlamaNeuronConfig
    assert (config.seq_len, config.torch_dtype, config.batch_size) == (48, torch.float32, 2)
    assert config.allow_input_truncation is True


def test_shift_inputs_by_offset_moves_each_row_right() -> None:
    from nxdplug.nxdi.utils.accuracy import shift_inputs_by_offset

    inputs = BatchEncoding(
        {"input_ids": torch.tensor([[5, 6], [7, 8]]), "attention_mask": torch.ones(2, 2)}
    )
    ids, mask = shift_inputs_by_offset(inputs, [1, 3], pad_token_id=9)
    assert ids.tolist() == [[9, 5, 6, 9, 9], [9, 9, 9, 7, 8]]
    assert mask.tolist() == [[0, 1, 1, 0, 0], [0, 0, 0, 1, 1]]
    ids, _ = shift_inputs_by_offset(inputs, [2])
    assert ids.tolist() == [[0, 0, 5, 6], [0, 0, 7, 8]]
    assert shift_inputs_by_offset(inputs, None)[0] is inputs.input_ids


def test_prepare_inputs_from_prompt_gives_a_row_per_sequence(tiny_checkpoint) -> None:
    from nxdplug import NeuronConfig, from_pretrained
    from nxdplug.nxdi.utils.accuracy import TEST_PROMPT, prepare_inputs_from_prompt

    path = tiny_checkpoint("llama")
    app = from_pretrained(path, NeuronConfig(batch_size=3, seq_len=32, torch_dtype="float32"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    inputs = prepare_inputs_from_prompt(app, tokenizer)
    expected = tokenizer(TEST_PROMPT, return_tensors="pt").input_ids
    assert inputs.input_ids.tolist() == expected.tolist() * 3
    assert prepare_inputs_from_prompt(app, tokenizer, "def f").input_ids.shape[0] == 3
    with pytest.raises(ValueError, match="tokenizer is required"):
        prepare_inputs_from_prompt(app, None)


def test_get_updated_configs_turns_the_mlp_kernel_off_where_not_converted(tiny_checkpoint):
    from nxdplug import NeuronConfig
    from nxdplug.nxdi.models.llama.modeling_llama import (
        LlamaInferenceConfig,
        get_updated_configs,
    )
    from nxdplug.nxdi.utils.hf_adapter import load_pretrained_config

    config = LlamaInferenceConfig(
        NeuronConfig(quantized_mlp_kernel_enabled=True, modules_to_not_convert=["layers.1.mlp"]),
        load_config=load_pretrained_config(tiny_checkpoint("llama")),
    )
    configs = get_updated_configs(config)
    assert len(configs) == config.num_hidden_layers >= 2
    assert configs[0] is config and config.neuron_config.quantized_mlp_kernel_enabled
    assert configs[1] is not config
    assert configs[1].neuron_config.quantized_mlp_kernel_enabled is False
    assert configs[1].neuron_config.quantize_clamp_bound == float("inf")
