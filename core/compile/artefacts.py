"""The compiled folder: what ``compile(path)`` writes and ``load(path)`` checks.

    neuron_config.json      the whole InferenceConfig
    manifest.json           hash of what shapes the graphs, versions, graphs, a hash per file
    graphs/<tag>-<bucket>   one artefact per sub-model and bucket (.rank<N> per rank when
                            compiled by several processes, one per tensor-parallel rank)
    weights/rank<N>.safetensors
                            each rank's weights apart from the graphs (when
                            save_sharded_checkpoint)

A folder is written under a temporary name beside its destination and renamed into place, so
a compile killed half-way never leaves a folder that loads. A shared artefact store
(``NXDPLUG_CACHE_DIR``) keeps the graphs of every config hash it has seen.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from nxdplug.checkpoint.atomic_folders import staged_folder
from nxdplug.errors import NxdPlugError
from nxdplug.registry import get_registry

MANIFEST = "manifest.json"
CONFIG_FILE = "neuron_config.json"
GRAPHS = "graphs"
WEIGHTS = "weights"
FORMAT_VERSION = 1
CACHE_ENV = "NXDPLUG_CACHE_DIR"

# NeuronConfig attributes that change how a compiled folder is used, not what its graphs are.
RUNTIME_ONLY_ATTRIBUTES = frozenset(
    {
        "skip_warmup",
        "skip_sharding",
        "save_sharded_checkpoint",
        "async_mode",
        "compile_backend",
        "overrides_torch_dtype",
    }
)
# InferenceConfig attributes that say where a model came from, not what it is.
PROVENANCE_ATTRIBUTES = frozenset({"_name_or_path", "name_or_path"})


class ArtefactError(NxdPlugError):
    """A compiled folder that is missing, incomplete, corrupted or made for another config."""


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as ``{"neuron_config.tp_degree": 2, ...}``."""
    if not isinstance(value, Mapping):
        return {prefix: value}
    flat: dict[str, Any] = {}
    for key, item in value.items():
        flat |= flatten(item, f"{prefix}.{key}" if prefix else str(key))
    return flat


def _without(values: Mapping[str, Any], dotted: str) -> dict[str, Any]:
    """``values`` (nested dicts) without the entry at the dotted path, if it is there."""
    head, _, rest = dotted.partition(".")
    kept = dict(values)
    if not rest:
        kept.pop(head, None)
    elif isinstance(kept.get(head), Mapping):
        kept[head] = _without(kept[head], rest)
    return kept


def graph_shaping_config(config_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of a config (as ``to_dict()`` gives it) that shape the compiled graphs: not
    its provenance, the runtime-only attributes, nor the settings features declare as reaching
    the graphs as inputs (``Feature.runtime_settings``)."""
    shaping = {k: v for k, v in config_dict.items() if k not in PROVENANCE_ATTRIBUTES}
    neuron = {
        k: v
        for k, v in dict(shaping.get("neuron_config", {})).items()
        if k not in RUNTIME_ONLY_ATTRIBUTES
    }
    for feature in get_registry().records("features"):
        for dotted in feature.runtime_settings:
            neuron = _without(neuron, dotted)
    shaping["neuron_config"] = neuron
    return shaping


def config_hash(shaping: Mapping[str, Any], versions: Mapping[str, Any]) -> str:
    text = json.dumps({"config": shaping, "versions": versions}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def differing_fields(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Dotted names whose values differ between two configs, as ``name: stored -> current``."""
    old, new = flatten(stored), flatten(current)
    return [
        f"{name}: {old.get(name, '<unset>')!r} -> {new.get(name, '<unset>')!r}"
        for name in sorted(old.keys() | new.keys())
        if old.get(name) != new.get(name)
    ]


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


@attrs.frozen
class GraphEntry:
    tag: str
    bucket: int
    file: str
    rank: int = 0


@attrs.frozen
class Manifest:
    config_hash: str
    backend: str
    versions: dict[str, Any]
    plugins: dict[str, Any]
    graphs: tuple[GraphEntry, ...]
    weights: tuple[str, ...]
    files: dict[str, str]
    weights_in_graphs: bool = False
    ranks: int = 1  # processes the graphs run in (tensor parallel), each with its own graphs
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        data = attrs.asdict(self)
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        path = folder / MANIFEST
        if not path.is_file():
            raise ArtefactError(
                f"{folder} is not a compiled model folder: {MANIFEST} is missing; "
                "compile the model into it first"
            )
        try:
            data = json.loads(path.read_text())
            data["graphs"] = tuple(GraphEntry(**g) for g in data["graphs"])
            data["weights"] = tuple(data["weights"])
            return cls(**data)
        except (ValueError, TypeError, KeyError) as exc:
            raise ArtefactError(f"{path} is corrupted ({type(exc).__name__}: {exc})") from exc


def verify_files(folder: Path, manifest: Manifest) -> None:
    """Every file the manifest lists exists and has its recorded hash; one error names all."""
    problems = []
    for relative, digest in sorted(manifest.files.items()):
        path = folder / relative
        if not path.is_file():
            problems.append(f"{relative} is missing")
        elif file_digest(path) != digest:
            problems.append(f"{relative} is corrupted (its hash differs from the manifest)")
    if problems:
        raise ArtefactError(
            f"compiled folder {folder} cannot be loaded: {'; '.join(problems)}. "
            "Compile again into a new folder."
        )


def store_folder() -> Path | None:
    """The shared artefact store, when NXDPLUG_CACHE_DIR names one."""
    value = os.environ.get(CACHE_ENV)
    return Path(value).expanduser() if value else None


def fetch_graphs(store: Path, digest: str, destination: Path) -> bool:
    """Copy the graphs of ``digest`` from the store into ``destination``; False when absent."""
    source = store / digest / GRAPHS
    if not source.is_dir():
        return False
    shutil.copytree(source, destination / GRAPHS, dirs_exist_ok=True)
    return True


def publish_graphs(store: Path, digest: str, graphs: Path) -> None:
    """Add a folder of graphs to the store under ``digest`` (atomically; first writer wins)."""
    target = store / digest
    if target.exists():
        return
    with staged_folder(target) as staging:
        shutil.copytree(graphs, staging / GRAPHS)
