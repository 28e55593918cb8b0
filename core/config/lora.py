"""Multi-LoRA serving settings (``NeuronConfig.lora_config``)."""

from __future__ import annotations

import attrs


@attrs.define(kw_only=True)
class LoraServingConfig:
    """Which LoRA adapters to serve and how they are laid out; setting it enables multi-LoRA.

    Adapters are given either as ``lora_ckpt_paths`` / ``lora_ckpt_paths_cpu`` (adapter id ->
    checkpoint path, in device and host memory) or as ``lora_ckpt_json``, a JSON file with the
    keys ``lora-ckpt-dir``, ``lora-ckpt-paths`` and ``lora-ckpt-paths-cpu``. ``max_cpu_loras``
    defaults to ``max_loras``. ``max_lora_rank`` and ``target_modules`` are not in the NxD
    Inference reference but are needed to size and place the adapters (as in its source).
    """

    max_loras: int = 1
    max_cpu_loras: int = attrs.field(
        default=attrs.Factory(lambda self: self.max_loras, takes_self=True)
    )
    max_lora_rank: int = 16
    target_modules: list[str] | None = None
    enable_dynamic_multi_lora: bool = False
    lora_ckpt_paths: dict[str, str] | None = None
    lora_ckpt_paths_cpu: dict[str, str] | None = None
    lora_ckpt_json: str | None = None
    lora_memory_transpose: bool = True
    lora_shard_linear_layer: bool = True
    base_model_quantized: bool = False
