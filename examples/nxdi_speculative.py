"""The NxD Inference feature guide's draft-model speculation example, ported by changing its
imports (and ``to_cpu()`` in place of ``compile()`` + ``load()``: there is no Neuron device).

    python examples/nxdi_speculative.py TARGET_PATH DRAFT_PATH [PROMPT]
"""

from __future__ import annotations

import copy
import sys

from transformers import AutoTokenizer, GenerationConfig

from nxdplug.config import NeuronConfig, load_pretrained_config
from nxdplug.contrib_models.llama.modeling_llama import (
    LlamaInferenceConfig,
    NeuronLlamaForCausalLM,
)
from nxdplug.generation.accuracy import get_generate_outputs


def main(model_path: str, draft_model_path: str, prompts: list[str]) -> None:
    # Initialize target model.
    neuron_config = NeuronConfig(
        speculation_length=4, trace_tokengen_model=False, seq_len=128, torch_dtype="float32"
    )
    config = LlamaInferenceConfig(neuron_config, load_config=load_pretrained_config(model_path))
    model = NeuronLlamaForCausalLM(model_path, config)

    # Initialize draft model.
    draft_neuron_config = copy.deepcopy(neuron_config)
    draft_neuron_config.speculation_length = 0
    draft_neuron_config.trace_tokengen_model = True
    draft_config = LlamaInferenceConfig(
        draft_neuron_config, load_config=load_pretrained_config(draft_model_path)
    )
    draft_model = NeuronLlamaForCausalLM(draft_model_path, draft_config)

    model.to_cpu()
    draft_model.to_cpu()

    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side=neuron_config.padding_side)
    generation_config = GenerationConfig.from_pretrained(model_path)

    _, output_tokens = get_generate_outputs(
        model,
        prompts,
        tokenizer,
        is_hf=False,
        draft_model=draft_model,
        generation_config=generation_config,
    )
    print("Generated outputs:")
    for i, output_token in enumerate(output_tokens):
        print(f"Output {i}: {output_token}")
    print(model.speculation_stats.summary())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:] or ["def __init__(self"])
