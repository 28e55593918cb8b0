"""NxD Inference's generation demo (its ``examples/generation_demo.py``), run through
``nxdplug.nxdi``: the same steps with the package renamed.

Compile into a folder, save the tokenizer beside it, build the application again from that
folder alone, load it, and generate with on-device sampling (``top_k=1``: greedy) and per-row
``sampling_params``. What differs from NxD Inference's script: the paths come from the command
line. ``tp_degree=32`` stays: in one process it sets the head layout only (a model with fewer
heads gets zero heads up to 32); launched by ``torchrun --nproc-per-node 32`` the script runs as
32 ranks.

    python examples/nxdi_generation_demo.py MODEL_PATH TRACED_MODEL_PATH
"""

import sys

import torch
from transformers import AutoTokenizer, GenerationConfig

from nxdplug.nxdi.models.config import NeuronConfig, OnDeviceSamplingConfig
from nxdplug.nxdi.models.llama.modeling_llama import LlamaInferenceConfig, NeuronLlamaForCausalLM
from nxdplug.nxdi.modules.generation.sampling import prepare_sampling_params
from nxdplug.nxdi.utils.hf_adapter import HuggingFaceGenerationAdapter, load_pretrained_config

model_path, traced_model_path = sys.argv[1], sys.argv[2]

torch.manual_seed(0)


def run_llama_generate():
    generation_config = GenerationConfig.from_pretrained(model_path)
    generation_config.update(do_sample=True, top_k=1, pad_token_id=generation_config.eos_token_id)

    neuron_config = NeuronConfig(
        tp_degree=32,
        batch_size=2,
        max_context_length=32,
        seq_len=64,
        on_device_sampling_config=OnDeviceSamplingConfig(top_k=1),
        enable_bucketing=True,
        flash_decoding_enabled=False,
    )
    config = LlamaInferenceConfig(neuron_config, load_config=load_pretrained_config(model_path))

    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="right")
    tokenizer.pad_token = tokenizer.eos_token

    print("\nCompiling and saving model...")
    model = NeuronLlamaForCausalLM(model_path, config)
    model.compile(traced_model_path)
    tokenizer.save_pretrained(traced_model_path)

    print("\nLoading model from compiled checkpoint...")
    model = NeuronLlamaForCausalLM(traced_model_path)
    model.load(traced_model_path)
    tokenizer = AutoTokenizer.from_pretrained(traced_model_path)

    print("\nGenerating outputs...")
    prompts = ["def fibonacci(n):", "import os"]
    sampling_params = prepare_sampling_params(
        batch_size=neuron_config.batch_size, top_k=[10, 5], top_p=[0.5, 0.9], temperature=[0.9, 0.5]
    )
    print(f"Prompts: {prompts}")
    inputs = tokenizer(prompts, padding=True, return_tensors="pt")
    generation_model = HuggingFaceGenerationAdapter(model)
    outputs = generation_model.generate(
        inputs.input_ids,
        generation_config=generation_config,
        attention_mask=inputs.attention_mask,
        max_length=model.config.neuron_config.max_length,
        sampling_params=sampling_params,
    )
    output_tokens = tokenizer.batch_decode(
        outputs, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    print("Generated outputs:")
    for i, output_token in enumerate(output_tokens):
        print(f"Output {i}: {output_token}")


if __name__ == "__main__":
    run_llama_generate()
