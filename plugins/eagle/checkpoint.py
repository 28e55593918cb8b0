"""EAGLE draft checkpoints: merging one into the target's state dict, and adding its LM head.

NxD Inference needs the draft checkpoint to carry the target's LM head (``lm_head.weight``);
public SafeAILab EAGLE checkpoints do not, so :func:`copy_lm_head` (also
``python -m nxdplug.plugins.eagle.checkpoint --target T --draft D``) copies it in, as the
feature guide's "EAGLE Checkpoint Compatibility" snippet does, but atomically and for single
or sharded targets (and tied embeddings).

:func:`merge_draft_state_dict` is the ``eagle-draft`` state-dict converter: the draft's tensors
join the target's under ``eagle_draft.`` (the fused model's draft submodule).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nxdplug.plugin_api import CheckpointError, NxdPlugError, load_state_dict

if TYPE_CHECKING:
    from nxdplug.plugin_api import InferenceConfig

LM_HEAD = "lm_head.weight"
TIED_EMBEDDING = "model.embed_tokens.weight"
DRAFT_FILE = "model.safetensors"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DRAFT_PREFIX = "eagle_draft."
INPUT_NORM = "layers.0.input_layernorm.weight"


def _tie_word_embeddings(target: Path) -> bool:
    config = target / "config.json"
    if not config.is_file():
        return False
    return bool(json.loads(config.read_text()).get("tie_word_embeddings", False))


def _tensor_file(target: Path, name: str) -> Path | None:
    """The safetensors file of ``target`` holding ``name`` (None when it has none)."""
    index = target / INDEX_FILE
    if index.is_file():
        try:
            shard = json.loads(index.read_text())["weight_map"].get(name)
        except (ValueError, KeyError, AttributeError) as exc:
            raise CheckpointError(f"cannot read {index}: {type(exc).__name__}: {exc}") from exc
        return None if shard is None else target / shard
    single = target / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"the target {target} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    with safe_open(single, framework="pt") as f:
        return single if name in f.keys() else None  # noqa: SIM118 (safe_open has no __contains__)


def read_target_lm_head(target_path: str | os.PathLike[str]) -> torch.Tensor:
    """The target's ``lm_head.weight``, or its input embedding when the embeddings are tied."""
    target = Path(target_path)
    if not target.is_dir():
        raise CheckpointError(f"the target model folder {target} does not exist")
    names = [LM_HEAD] + ([TIED_EMBEDDING] if _tie_word_embeddings(target) else [])
    for name in names:
        path = _tensor_file(target, name)
        if path is None:
            continue
        if not path.is_file():
            raise CheckpointError(f"{target / INDEX_FILE} names {path.name}, which is missing")
        with safe_open(path, framework="pt") as f:
            return f.get_tensor(name)
    raise CheckpointError(f"the target {target} has no {' or '.join(names)} tensor")


def copy_lm_head(
    target_path: str | os.PathLike[str],
    draft_path: str | os.PathLike[str],
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the target's LM head into the draft's ``model.safetensors`` as ``lm_head.weight``
    (cast to ``dtype``, by default the dtype of the draft's ``fc.weight``); returns the file.

    The file is replaced atomically (a temporary file, then ``os.replace``).
    """
    draft_file = Path(draft_path) / DRAFT_FILE
    if not draft_file.is_file():
        raise CheckpointError(f"the draft checkpoint {draft_file} does not exist")
    head = read_target_lm_head(target_path)
    with safe_open(draft_file, framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        metadata = f.metadata()
    reference = tensors.get("fc.weight", head)
    tensors[LM_HEAD] = head.to(dtype or reference.dtype).contiguous()
    fd, tmp = tempfile.mkstemp(dir=draft_file.parent, prefix=f".{draft_file.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata or {"format": "pt"})
        os.chmod(tmp, 0o644)
        os.replace(tmp, draft_file)
    except BaseException:
        os.unlink(tmp)
        raise
    return draft_file


def merge_draft_state_dict(state_dict: dict[str, Any], config: InferenceConfig) -> dict[str, Any]:
    """Add the draft checkpoint's tensors (``fused_spec_config.draft_model_path``) under
    ``eagle_draft.``; explains a missing LM head or an input norm the config does not expect."""
    draft_path = config.fused_spec_config.draft_model_path
    neuron_config = config.neuron_config
    dtype = neuron_config.torch_dtype if neuron_config.cast_type == "config" else None
    draft = load_state_dict(draft_path, dtype=dtype)
    draft = {name.removeprefix("model."): tensor for name, tensor in draft.items()}
    if LM_HEAD not in draft:
        raise CheckpointError(
            f"the EAGLE draft {draft_path} has no {LM_HEAD}; copy the target's into it with "
            f"python -m nxdplug.plugins.eagle.checkpoint --target <target> --draft {draft_path}"
        )
    is_eagle3_head = any(name.startswith("midlayer.") for name in draft)
    if is_eagle3_head != bool(neuron_config.is_eagle3):
        kind, setting = ("an EAGLE-3", "True") if is_eagle3_head else ("an EAGLE-1", "False")
        raise CheckpointError(
            f"the draft {draft_path} is {kind} head (its tensors); set is_eagle3={setting}"
        )
    if neuron_config.is_eagle3:
        draft = eagle3_tensors(draft, state_dict, config.fused_spec_config.draft_config)
        return state_dict | {DRAFT_PREFIX + name: tensor for name, tensor in draft.items()}
    has_norm = INPUT_NORM in draft
    if has_norm != bool(neuron_config.enable_eagle_draft_input_norm):
        setting = "True" if has_norm else "False"
        state = "has" if has_norm else "has no"
        raise CheckpointError(
            f"the EAGLE draft {draft_path} {state} {INPUT_NORM}; set "
            f"enable_eagle_draft_input_norm={setting}"
        )
    return state_dict | {DRAFT_PREFIX + name: tensor for name, tensor in draft.items()}


def eagle3_tensors(
    draft: dict[str, torch.Tensor], target: dict[str, Any], draft_config: Any
) -> dict[str, torch.Tensor]:
    """An EAGLE-3 checkpoint as the draft module holds it. Published heads leave out the
    embedding (the target's is used, as their authors' loader does) and may leave out ``d2t``
    when the draft's vocabulary is the target's; ``t2d`` (the inverse map) is not needed."""
    draft = {name: tensor for name, tensor in draft.items() if name != "t2d"}
    if "embed_tokens.weight" not in draft:
        embedding = target.get(TIED_EMBEDDING, target.get("embed_tokens.weight"))
        if embedding is None:
            raise CheckpointError("the target's state dict has no embedding for the EAGLE-3 draft")
        draft["embed_tokens.weight"] = embedding
    draft_vocab = getattr(draft_config, "draft_vocab_size", None) or draft_config.vocab_size
    if "d2t" not in draft:
        if draft_vocab != draft_config.vocab_size:
            raise CheckpointError(
                f"the EAGLE-3 draft's vocabulary ({draft_vocab} tokens) is smaller than the "
                f"target's ({draft_config.vocab_size}) but its checkpoint has no d2t map"
            )
        draft["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
    draft["d2t"] = draft["d2t"].long()
    return draft


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nxdplug.plugins.eagle.checkpoint",
        description="Copy a target model's LM head into an EAGLE draft checkpoint "
        "(model.safetensors), which fused EAGLE speculation needs.",
    )
    parser.add_argument("--target", required=True, help="the target model folder")
    parser.add_argument("--draft", required=True, help="the EAGLE draft folder")
    parser.add_argument("--dtype", help="dtype of the copied head (default: the draft's)")
    args = parser.parse_args(argv)
    try:
        dtype = getattr(torch, args.dtype) if args.dtype else None
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise NxdPlugError(f"--dtype {args.dtype!r} is not a torch dtype")
        written = copy_lm_head(args.target, args.draft, dtype)
    except (NxdPlugError, AttributeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {LM_HEAD} into {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
