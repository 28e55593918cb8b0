"""Tiny random checkpoints of any registered architecture, built offline with transformers.

A tiny checkpoint is what a user would download from the hub, only small and random: the
transformers config and model classes a model plugin names (``hf_config_class``,
``hf_model_class``), ``save_pretrained`` weights, a tokenizer trained in-process and a greedy
``generation_config.json``. Tests, examples and the quickstart use them in place of hub paths.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nxdplug.plugin_api import (
    ConfigError,
    ModelArchitecture,
    PluginError,
    get_registry,
    staged_folder,
)
from nxdplug.testing.tokenizer_builder import build_tokenizer

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_TINY_CONFIG_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    # HF's 0.02 gives near-uniform logits, and greedy decoding then repeats one token.
    "initializer_range": 0.15,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}

# Set by make_tiny_checkpoint itself: what the file is, not what the model is.
_FIXED_KEYS = frozenset({"transformers_version", "architectures", "model_type", "dtype"})


def tiny_config_defaults() -> dict[str, Any]:
    """The config values every tiny checkpoint starts from (a copy: change it freely)."""
    return dict(_TINY_CONFIG_DEFAULTS)


def make_tiny_checkpoint(
    architecture: str,
    output_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    overrides: Mapping[str, Any] | None = None,
    force: bool = False,
) -> Path:
    """Write a tiny random HF checkpoint of ``architecture`` to ``output_dir`` and return it.

    ``overrides`` change the transformers config (``{"num_hidden_layers": 3}``). The weights
    depend only on ``seed`` and the config. The folder appears complete or not at all; an
    existing non-empty ``output_dir`` is refused unless ``force`` is true.
    """
    output = Path(output_dir)
    _check_output(output, force)
    record: ModelArchitecture = get_registry().get("model_architectures", architecture)
    config = _build_config(record, overrides or {})
    with staged_folder(output) as staging:
        build_tokenizer(staging, config.vocab_size, model_max_length=config.max_position_embeddings)
        _save_model(record, config, seed, staging)
        _check_output(output, force)  # it may have been filled while we were building
    return output


def summarize_checkpoint(path: str | os.PathLike[str]) -> str:
    """One line about a checkpoint folder: model type, layers, heads, sizes, parameters."""
    from safetensors import safe_open
    from transformers import AutoConfig

    folder = Path(path)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)  # reads aliased names
    parameters = 0
    for weights in sorted(folder.glob("*.safetensors")):
        with safe_open(weights, framework="pt") as tensors:
            for key in tensors.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                parameters += math.prod(tensors.get_slice(key).get_shape())
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return (
        f"{config.model_type}: {parameters:,} parameters, "
        f"{getattr(config, 'num_hidden_layers', None)} layers, {heads} attention heads "
        f"({kv_heads} key-value), hidden size {getattr(config, 'hidden_size', None)}, "
        f"vocab {getattr(config, 'vocab_size', None)}, {_dtype_name(config.dtype)}"
    )


def _dtype_name(dtype: Any) -> str:
    return str(dtype or "float32").removeprefix("torch.")


def _check_output(output: Path, force: bool) -> None:
    if output.exists() and not output.is_dir():
        raise FileExistsError(f"{output} exists and is not a folder; choose another output path")
    if not force and output.is_dir() and any(output.iterdir()):
        raise FileExistsError(
            f"{output} is not empty; choose an empty or new folder, or replace it with "
            "force=True (--force on the command line)"
        )


def _build_config(record: ModelArchitecture, overrides: Mapping[str, Any]) -> PretrainedConfig:
    if record.hf_config_class is None or record.hf_model_class is None:
        raise PluginError(
            f"model architecture {record.name!r} names no transformers classes "
            "(hf_config_class and hf_model_class), so no tiny checkpoint can be built for it; "
            "its plugin must set both"
        )
    config_class = record.load("hf_config_class")
    problems = _override_problems(config_class, overrides)
    if problems:
        raise ConfigError(problems, source=f"overrides for {record.name!r}")
    # A default this config class does not declare (GPT-NeoX has no num_key_value_heads) would
    # be kept as a stray attribute and mislead readers of config.json: leave it out.
    declared = set(config_class().to_dict()) | set(getattr(config_class, "attribute_map", {}))
    defaults = {k: v for k, v in _TINY_CONFIG_DEFAULTS.items() if k in declared}
    values = {**defaults, **record.tiny_config, **overrides}
    try:
        return config_class(**values)
    except Exception as exc:  # transformers' validation errors share no base class
        raise ConfigError(
            [f"{config_class.__name__} rejected the values: {type(exc).__name__}: {exc}"],
            source=f"overrides for {record.name!r}",
        ) from exc


def _override_problems(config_class: type, overrides: Mapping[str, Any]) -> list[str]:
    """What is wrong with ``overrides``: fixed keys and keys the config does not know.

    transformers configs accept any keyword and keep an unknown one as a plain attribute, so
    a key is unknown when it is no attribute of the default config and comes back unchanged
    from ``to_dict()``; legacy keywords (``rope_theta``) are consumed into other attributes.
    """
    valid = sorted(
        key
        for key in config_class().to_dict()
        if not key.startswith("_") and key not in _FIXED_KEYS
    )
    candidates = set(overrides) - set(valid) - set(getattr(config_class, "attribute_map", {}))
    fixed = sorted(candidates & _FIXED_KEYS)
    unknown = [
        key
        for key in sorted(candidates - _FIXED_KEYS)
        if key.startswith("_") or _kept_verbatim(config_class, key, overrides[key])
    ]
    problems = []
    if fixed:
        problems.append(
            f"{', '.join(repr(k) for k in fixed)} cannot be overridden: tiny checkpoints are "
            "float32 and their model type comes from the architecture's plugin"
        )
    if unknown:
        problems.append(
            f"unknown {config_class.__name__} attribute(s): "
            f"{', '.join(_with_hint(k, valid) for k in unknown)}. "
            f"Valid attributes: {', '.join(valid)}"
        )
    return problems


def _with_hint(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    return f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key)


def _kept_verbatim(config_class: type, key: str, value: Any) -> bool:
    try:
        return key in config_class(**{key: value}).to_dict()
    except Exception:  # a keyword the config consumed and disliked: reported when building
        return False


def _save_model(
    record: ModelArchitecture, config: PretrainedConfig, seed: int, folder: Path
) -> None:
    import torch
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    model_class = record.load("hf_model_class")
    with torch.random.fork_rng(devices=[]):  # leave the caller's random state alone
        torch.manual_seed(seed)
        model = model_class(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        do_sample=False,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    # safetensors is save_pretrained's default; the progress bar is noise for a tiny model.
    bar_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(folder)
    finally:
        if bar_was_enabled:
            hf_logging.enable_progress_bar()
