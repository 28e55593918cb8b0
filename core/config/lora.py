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

    The rest of NxD Inference's signature is accepted too: ``dynamic_multi_lora`` (its source's
    name for ``enable_dynamic_multi_lora``, which defaults to it), ``batch_size`` (the rows
    whose adapters one step gathers: every row has its own here), ``eviction_policy`` and
    ``lfu_decay_period`` (which host adapter leaves first), ``is_context_encoding`` (set per
    sub-model by NxD Inference itself), ``enable_base_model_only`` (a slot for rows served by
    the base model: slot 0 always is). ``lora_bias`` other than ``"none"`` would change
    results and is refused until implemented.
    """

    max_loras: int = 1
    max_cpu_loras: int = attrs.field(
        default=attrs.Factory(lambda self: self.max_loras, takes_self=True)
    )
    max_lora_rank: int = 16
    target_modules: list[str] | None = None
    dynamic_multi_lora: bool = False
    enable_dynamic_multi_lora: bool = attrs.field(
        default=attrs.Factory(lambda self: self.dynamic_multi_lora, takes_self=True)
    )
    lora_ckpt_paths: dict[str, str] | None = None
    lora_ckpt_paths_cpu: dict[str, str] | None = None
    lora_ckpt_json: str | None = None
    lora_memory_transpose: bool = True
    lora_shard_linear_layer: bool = True
    base_model_quantized: bool = False
    batch_size: int = 1
    lora_bias: str = "none"
    is_context_encoding: bool = False
    eviction_policy: str = "lru"
    lfu_decay_period: int = 128
    enable_base_model_only: bool = False
