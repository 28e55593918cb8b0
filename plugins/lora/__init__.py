"""Multi-LoRA serving: PEFT adapters applied per row (see :mod:`nxdplug.plugins.lora.hooks`)."""
