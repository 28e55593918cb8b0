"""An NxD Inference generation script, ported to nxdplug by changing its imports.

The only other change: ``model.to_cpu()`` in place of ``model.compile(...)`` and
``model.load(...)``, since these machines have no Neuron device.

    python examples/nxdi_generate.py MODEL_PATH [PROMPT ...]
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoTokenizer, GenerationConfig

from nxdplug import HuggingFaceGenerationAdapter, NeuronConfig, load_pretrained_config
from nxdplug.contrib_models.llama.modeling_llama import (
    LlamaInferenceConfig,
    NeuronLlamaForCausalLM,
)


def main(model_path: str, prompts: list[str]) -> None:
    neuron_config = NeuronConfig(
        batch_size=len(prompts),
        seq_len=128,
        max_context_length=64,
        torch_dtype=torch.float32,
    )
    config = LlamaInferenceConfig(neuron_config, load_config=load_pretrained_config(model_path))
    model = NeuronLlamaForCausalLM(model_path, config)
    model.to_cpu()

    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side=neuron_config.padding_side)
    generation_config = GenerationConfig.from_pretrained(model_path)

    generation_model = HuggingFaceGenerationAdapter(model)
    inputs = tokenizer(prompts, padding=True, return_tensors="pt")
    outputs = generation_model.generate(
        inputs.input_ids,
        generation_config=generation_config,
        attention_mask=inputs.attention_mask,
        max_length=model.neuron_config.max_length,
    )
    output_tokens = tokenizer.batch_decode(
        outputs, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    print("Generated outputs:")
    for i, output_token in enumerate(output_tokens):
        print(f"Output {i}: {output_token}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["def fibonacci(n):", "import os\n"])
