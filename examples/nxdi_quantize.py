"""The NxD Inference feature guide's weight-quantization example, ported by changing its imports.

Other changes: the model runs with ``to_cpu()`` (no Neuron device here) in float32, and it
generates a few tokens so the quantized model can be seen working.

    python examples/nxdi_quantize.py MODEL_PATH QUANTIZED_PATH [int8|f8e4m3|f8e5m2]
"""

from __future__ import annotations

import sys

from transformers import AutoTokenizer

from nxdplug import HuggingFaceGenerationAdapter, NeuronConfig, load_pretrained_config
from nxdplug.contrib_models.llama.modeling_llama import (
    LlamaInferenceConfig,
    NeuronLlamaForCausalLM,
)
from nxdplug.plugins.quantization.memory import weight_memory


def main(model_path: str, quantized_model_path: str, dtype: str) -> None:
    neuron_config = NeuronConfig(
        quantized=True,
        quantized_checkpoints_path=quantized_model_path,
        quantization_dtype=dtype,
        quantization_type="per_channel_symmetric",
        torch_dtype="float32",
    )
    config = LlamaInferenceConfig(neuron_config, load_config=load_pretrained_config(model_path))

    # Quantize the model and save it to `quantized_checkpoints_path`.
    NeuronLlamaForCausalLM.save_quantized_state_dict(model_path, config)

    # Load and use the model.
    model = NeuronLlamaForCausalLM(model_path, config)
    model.to_cpu()
    print(weight_memory(model.context_encoding_model.model).summary())

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    inputs = tokenizer(["def __init__(self"], return_tensors="pt")
    outputs = HuggingFaceGenerationAdapter(model).generate(
        inputs.input_ids, attention_mask=inputs.attention_mask, max_new_tokens=24
    )
    print(tokenizer.decode(outputs[0], skip_special_tokens=True))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "int8")
