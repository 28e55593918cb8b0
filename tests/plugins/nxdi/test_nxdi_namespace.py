"""``nxdplug.nxdi``: NxD Inference's module layout over nxdplug's own objects, so that a script
ports by renaming ``neuronx_distributed_inference`` to ``nxdplug.nxdi``."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from nxdplug.lazy import resolve_ref
from nxdplug.nxdi.reexport import NotProvidedAttributeError, NotProvidedError
from tests import REPO_ROOT

ROOT = REPO_ROOT
NAMESPACE = ROOT / "plugins" / "nxdi"
# nxdplug's own code in the namespace, beside NxD Inference's names: the plugin's hooks and the
# inference_demo it runs.
OWN_CODE = {"nxdplug.nxdi.hooks", "nxdplug.nxdi.demo"}

# The nxdi module, and the nxdplug object each of its names must be.
STATIC_EXPORTS = {
    "nxdplug.nxdi.models.config": {
        "NeuronConfig": "nxdplug.config:NeuronConfig",
        "InferenceConfig": "nxdplug.config:InferenceConfig",
        "MoENeuronConfig": "nxdplug.config:MoENeuronConfig",
        "FusedSpecNeuronConfig": "nxdplug.config:FusedSpecNeuronConfig",
        "OnDeviceSamplingConfig": "nxdplug.config:OnDeviceSamplingConfig",
        "HybridShardingConfig": "nxdplug.config:HybridShardingConfig",
        "BlockwiseMatmulConfig": "nxdplug.config:BlockwiseMatmulConfig",
        "RouterConfig": "nxdplug.config:RouterConfig",
        "LoraServingConfig": "nxdplug.config:LoraServingConfig",
        "ChunkedPrefillConfig": "nxdplug.config:ChunkedPrefillConfig",
        "to_torch_dtype": "nxdplug.config:to_torch_dtype",
    },
    "nxdplug.nxdi.utils.hf_adapter": {
        "HuggingFaceGenerationAdapter": "nxdplug:HuggingFaceGenerationAdapter",
        "load_pretrained_config": "nxdplug:load_pretrained_config",
    },
    "nxdplug.nxdi.utils.accuracy": {
        "TEST_PROMPT": "nxdplug.generation.accuracy:TEST_PROMPT",
        "get_generate_outputs": "nxdplug.generation.accuracy:get_generate_outputs",
        "check_accuracy": "nxdplug.generation.accuracy:check_accuracy",
        "generate_expected_logits": "nxdplug.generation.logit_accuracy:generate_expected_logits",
        "check_accuracy_logits": "nxdplug.generation.logit_accuracy:check_accuracy_logits",
        "check_accuracy_logits_v2": "nxdplug.generation.logit_accuracy:check_accuracy_logits_v2",
        "logit_validation": "nxdplug.generation.logit_validation:logit_validation",
        "prepare_inputs_from_prompt": "nxdplug.generation.accuracy:prepare_inputs_from_prompt",
        "shift_inputs_by_offset": "nxdplug.generation.accuracy:shift_inputs_by_offset",
        "HuggingFaceGenerationAdapter": "nxdplug:HuggingFaceGenerationAdapter",
        "LogitMatchingValidationError": (
            "nxdplug.generation.logit_validation:LogitMatchingValidationError"
        ),
    },
    "nxdplug.nxdi.utils.benchmark": {
        "BENCHMARK_REPORT_PATH": "nxdplug.nxdi.demo.sampling_benchmark:BENCHMARK_REPORT_PATH",
        "benchmark_sampling": "nxdplug.nxdi.demo.sampling_benchmark:benchmark_sampling",
        "generate_report": "nxdplug.nxdi.demo.sampling_benchmark:generate_report",
        "prepare_sampling_params": "nxdplug.runtime.sampling_params:prepare_sampling_params",
    },
    "nxdplug.nxdi.utils.exceptions": {
        "LogitMatchingValidationError": (
            "nxdplug.generation.logit_validation:LogitMatchingValidationError"
        ),
    },
    "nxdplug.nxdi.modules.autobucketing": {
        name: f"nxdplug.config.buckets:{name}"
        for name in (
            "generate_buckets",
            "generate_buckets_for_cte",
            "generate_buckets_for_tkg",
            "generate_buckets_for_speculation",
            "generate_buckets_for_fused_spec",
        )
    },
    "nxdplug.nxdi.modules.moe_v2": {
        "initialize_moe_module": "nxdplug.modules.moe:initialize_moe_module",
    },
    "nxdplug.nxdi.modules.eagle.token_tree": {"TokenTree": "nxdplug.config.token_tree:TokenTree"},
    "nxdplug.nxdi.modules.eagle.dynamic_token_tree": {
        "DynamicTokenTree": "nxdplug.plugins.eagle.dynamic_token_tree:DynamicTokenTree",
    },
    "nxdplug.nxdi.modules.eagle.hidden_state": {
        "HiddenStateRollingBuffer": "nxdplug.plugins.eagle.hidden_state:HiddenStateRollingBuffer",
        "rolling_buffer_set_state": "nxdplug.plugins.eagle.hidden_state:rolling_buffer_set_state",
    },
    "nxdplug.nxdi.modules.lora_serving": {"LoraServingConfig": "nxdplug:LoraServingConfig"},
    "nxdplug.nxdi.modules.lora_serving.config": {"LoraServingConfig": "nxdplug:LoraServingConfig"},
    "nxdplug.nxdi.modules.generation.sampling": {
        "Sampler": "nxdplug.runtime.batch_sampler:Sampler",
        "prepare_sampling_params": "nxdplug.runtime.sampling_params:prepare_sampling_params",
        "validate_sampling_params": "nxdplug.runtime.sampling_params:validate_sampling_params",
        "infer_sampling_params": "nxdplug.runtime.sampling_params:infer_sampling_params",
    },
    "nxdplug.nxdi.models.model_base": {
        "NeuronBaseModel": "nxdplug.runtime.model_base:NeuronBaseModel",
        "NeuronBaseForCausalLM": "nxdplug:NeuronBaseForCausalLM",
    },
    "nxdplug.nxdi.models.model_wrapper": {
        "ModelWrapper": "nxdplug.runtime.model_wrapper:ModelWrapper",
        **{
            f"{phase}_TAG": f"nxdplug.runtime.model_wrapper:{phase}_TAG"
            for phase in (
                "CONTEXT_ENCODING_MODEL",
                "TOKEN_GENERATION_MODEL",
                "SPECULATION_MODEL",
                "FUSED_SPECULATION_MODEL",
            )
        },
    },
    "nxdplug.nxdi.models.application_base": {
        "NeuronApplicationBase": "nxdplug.runtime.application:NeuronApplicationBase",
    },
    "nxdplug.nxdi.modules.attention.gqa": {
        "GQA": "nxdplug.config.head_sharding:GQA",
        "determine_sharding_strategy": "nxdplug.config.head_sharding:determine_sharding_strategy",
        "get_shardable_head_counts": "nxdplug.config.head_sharding:shardable_head_counts",
    },
    "nxdplug.nxdi.utils.argparse_utils": {
        "AUTO": "nxdplug.nxdi.demo.flags:AUTO",
        "StringOrIntegers": "nxdplug.nxdi.demo.flags:StringOrIntegers",
    },
    "nxdplug.nxdi.utils.constants": {
        "TEST_PROMPT": "nxdplug.generation.accuracy:TEST_PROMPT",
        "BENCHMARK_REPORT_PATH": "nxdplug.nxdi.demo.sampling_benchmark:BENCHMARK_REPORT_PATH",
        "END_TO_END_MODEL": "nxdplug.nxdi.demo.sampling_benchmark:END_TO_END_MODEL",
        **{
            phase: f"nxdplug.runtime.model_wrapper:{phase}_TAG"
            for phase in (
                "CONTEXT_ENCODING_MODEL",
                "TOKEN_GENERATION_MODEL",
                "SPECULATION_MODEL",
                "FUSED_SPECULATION_MODEL",
            )
        },
    },
    "nxdplug.nxdi.inference_demo": {
        "main": "nxdplug.nxdi.demo.command:main",
        "setup_run_parser": "nxdplug.nxdi.demo.flags:add_run_flags",
        "parse_args": "nxdplug.nxdi.demo.command:parse_args",
        "create_neuron_config": "nxdplug.nxdi.demo.command:create_neuron_config",
        "LogitMatchingValidationError": (
            "nxdplug.generation.logit_validation:LogitMatchingValidationError"
        ),
        "BENCHMARK_REPORT_PATH": "nxdplug.nxdi.demo.sampling_benchmark:BENCHMARK_REPORT_PATH",
        "load_pretrained_config": "nxdplug:load_pretrained_config",
        "benchmark_sampling": "nxdplug.nxdi.demo.sampling_benchmark:benchmark_sampling",
    },
}
FAMILIES = ["llama", "mistral", "mixtral", "dbrx", "qwen2", "qwen3", "qwen3_moe", "gpt_oss"]
# The names an NxD Inference script takes from each family's modeling module.
ENTRY_CLASSES = {
    "llama": ("NeuronLlamaForCausalLM", "LlamaInferenceConfig", "NeuronLlamaModel"),
    "mistral": ("NeuronMistralForCausalLM", "MistralInferenceConfig"),
    "mixtral": ("NeuronMixtralForCausalLM", "MixtralInferenceConfig"),
    "dbrx": ("NeuronDbrxForCausalLM", "DbrxInferenceConfig"),
    "qwen2": ("NeuronQwen2ForCausalLM", "Qwen2InferenceConfig"),
    "qwen3": ("NeuronQwen3ForCausalLM", "Qwen3InferenceConfig"),
    "qwen3_moe": ("NeuronQwen3MoeForCausalLM", "Qwen3MoeInferenceConfig"),
    "gpt_oss": ("NeuronGptOssForCausalLM", "GptOssInferenceConfig"),
}


def namespace_modules() -> list[str]:
    modules = [
        "nxdplug." + ".".join(path.relative_to(NAMESPACE.parent).with_suffix("").parts)
        for path in sorted(NAMESPACE.rglob("*.py"))
        if path.name != "__init__.py"
    ]
    return [m for m in modules if not any(m == o or m.startswith(o + ".") for o in OWN_CODE)]


def run_python(*args: str, cwd: Path | None = None, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=os.environ | env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


PROMPTS = ["def fibonacci(n):", "import os"]


def hf_greedy(path: Path, max_length: int) -> torch.Tensor:
    """What HF transformers generates on the test prompts (left padded), as the scripts do."""
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    inputs = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    with torch.inference_mode():
        return hf.generate(
            **inputs,
            generation_config=GenerationConfig.from_pretrained(path),
            max_length=max_length,
        )


def test_importing_the_namespace_imports_no_model_code_and_no_torch() -> None:
    modules = namespace_modules()
    assert len(modules) > len(STATIC_EXPORTS)
    out = run_python(
        "-c",
        f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(m for m in sys.modules if m.startswith('nxdplug.contrib_models')"
        " or m == 'torch'))",
    )
    assert out.strip() == "[]"


@pytest.mark.parametrize("module_name", sorted(STATIC_EXPORTS))
def test_each_name_is_the_very_nxdplug_object(module_name: str) -> None:
    module = importlib.import_module(module_name)
    expected = STATIC_EXPORTS[module_name]
    assert sorted(module.__all__) == sorted(expected)
    for name, ref in expected.items():
        assert getattr(module, name) is resolve_ref(ref), name
    assert set(expected) <= set(dir(module))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_module_is_its_plugins_module(family: str) -> None:
    module = importlib.import_module(f"nxdplug.nxdi.models.{family}.modeling_{family}")
    source = importlib.import_module(f"nxdplug.contrib_models.{family}.modeling_{family}")
    assert set(ENTRY_CLASSES[family]) <= set(module.__all__)
    for name in module.__all__:
        assert getattr(module, name) is getattr(source, name), name
    star: dict = {}
    exec(f"from {module.__name__} import *", star)
    assert {n: v for n, v in star.items() if n != "__builtins__"} == {
        n: getattr(source, n) for n in module.__all__
    }


@pytest.mark.parametrize(
    ("module_name", "name"),
    [
        ("nxdplug.nxdi.utils.accuracy", "check_accuracy_embeddings"),
        ("nxdplug.nxdi.utils.hf_adapter", "to_pretrained_config"),
        ("nxdplug.nxdi.modules.generation.sampling", "DataParallelSampler"),
        ("nxdplug.nxdi.modules.autobucketing", "generate_buckets_on_chunk_size"),
        ("nxdplug.nxdi.modules.lora_serving", "LoraCheckpoint"),
        ("nxdplug.nxdi.models.config", "MultimodalVisionNeuronConfig"),
        ("nxdplug.nxdi.models.llama.modeling_llama", "NeuronLlamaMLP"),
    ],
)
def test_a_name_nxdplug_lacks_says_it_is_not_implemented(module_name: str, name: str) -> None:
    nxdi_name = module_name.replace("nxdplug.nxdi", "neuronx_distributed_inference")
    said = rf"{nxdi_name}\.{name} is not implemented in nxdplug"
    with pytest.raises(NotProvidedError, match=said):
        exec(f"from {module_name} import {name}", {})
    module = importlib.import_module(module_name)
    with pytest.raises(NotProvidedAttributeError, match=said) as raised:
        getattr(module, name)
    assert isinstance(raised.value, NotImplementedError) and raised.value.name == name
    # As any module: hasattr and getattr with a default see an AttributeError.
    assert not hasattr(module, name)
    assert getattr(module, name, "default") == "default"
    assert not hasattr(module, "_private") and not hasattr(module, "__wrapped__")


def test_patching_a_name_changes_what_nxdplug_calls(tiny_checkpoint) -> None:
    """mock.patch where NxD Inference's code would be patched reaches nxdplug's callers, and
    everything is as before after the ``with`` (nested patches included)."""
    from nxdplug.generation import logit_accuracy
    from nxdplug.nxdi.utils import accuracy

    original = accuracy.generate_expected_logits
    with mock.patch("nxdplug.nxdi.utils.accuracy.generate_expected_logits") as outer:
        assert logit_accuracy.generate_expected_logits is outer
        with mock.patch.object(accuracy, "generate_expected_logits") as inner:
            assert accuracy.generate_expected_logits is inner
            assert logit_accuracy.generate_expected_logits is inner
        assert logit_accuracy.generate_expected_logits is outer
    assert accuracy.generate_expected_logits is original
    assert logit_accuracy.generate_expected_logits is original
    assert "generate_expected_logits" not in vars(accuracy)

    # The patched function is the one check_accuracy_logits runs.
    from nxdplug import NeuronConfig, from_pretrained

    app = from_pretrained(
        tiny_checkpoint("llama"), NeuronConfig(torch_dtype="float32", seq_len=32, batch_size=1)
    )
    app.to_cpu()

    class Stop(Exception):
        pass

    with (
        mock.patch.object(accuracy, "logit_validation", side_effect=Stop) as validation,
        pytest.raises(Stop),
    ):
        accuracy.check_accuracy_logits(
            app, generation_config=None, num_tokens_to_check=2, inputs=_one_prompt()
        )
    assert validation.called


def _one_prompt():
    from transformers import BatchEncoding

    ids = torch.tensor([[5, 17, 42, 9]])
    return BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def test_patching_names_a_module_lacks_works_as_on_any_module() -> None:
    from nxdplug.nxdi.utils import accuracy

    with mock.patch("nxdplug.nxdi.utils.accuracy.open", create=True) as fake_open:
        assert accuracy.open is fake_open
    assert not hasattr(accuracy, "open")
    with mock.patch.object(accuracy, "print", create=True):
        pass
    assert "print" not in vars(accuracy)


def test_a_module_nxdplug_lacks_is_not_found() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("nxdplug.nxdi.models.llama4.modeling_llama4")


def test_a_package_still_gives_its_submodules() -> None:
    from nxdplug.nxdi.modules.lora_serving import LoraServingConfig, config

    assert config.LoraServingConfig is LoraServingConfig


# The repo's example imports nxdplug's own names; an NxD Inference script imports these.
EXAMPLE_IMPORTS = {
    "from nxdplug import HuggingFaceGenerationAdapter, NeuronConfig, load_pretrained_config": (
        "from nxdplug.nxdi.models.config import NeuronConfig\n"
        "from nxdplug.nxdi.utils.hf_adapter import (\n"
        "    HuggingFaceGenerationAdapter,\n"
        "    load_pretrained_config,\n"
        ")"
    ),
    "nxdplug.contrib_models.llama.modeling_llama": "nxdplug.nxdi.models.llama.modeling_llama",
}


def test_the_generate_example_runs_with_nxdi_imports(tiny_checkpoint, tmp_path) -> None:
    path = tiny_checkpoint("llama", seed=5)
    text = (ROOT / "examples" / "nxdi_generate.py").read_text()
    for old, new in EXAMPLE_IMPORTS.items():
        assert old in text
        text = text.replace(old, new)
    assert "from nxdplug import" not in text and "contrib_models" not in text
    ported = tmp_path / "generate_nxdi.py"
    ported.write_text(text)
    printed = run_python(str(ported), str(path), *PROMPTS).split("Generated outputs:\n", 1)[1]

    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    texts = tokenizer.batch_decode(
        hf_greedy(path, max_length=128),
        skip_special_tokens=True,
        clean_up_tokenization_spaces=False,
    )
    assert (
        printed.splitlines()
        == "\n".join(f"Output {i}: {t}" for i, t in enumerate(texts)).splitlines()
    )
