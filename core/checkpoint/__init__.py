"""Checkpoints: reading and writing state dicts, safetensors, atomic folders."""
