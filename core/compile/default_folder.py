"""Where a model is compiled when no folder is given (``nxdplug serve``), as vLLM keeps its
compiled graphs in a cache: a folder per config hash under the cache, which every later start
with that config reuses.

The folder holds the graphs only (``save_sharded_checkpoint=False``): each start reads the
weights from the checkpoint, so models of one config share the graphs, and a checkpoint changed
in place is read as it is now. Graphs that hold their weights (inductor's ``freezing=true``)
get a folder per checkpoint too: its path, and its files' sizes and modification times.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from nxdplug.compile.artefacts import store_folder
from nxdplug.compile.compiled_model import graphs_digest

if TYPE_CHECKING:
    from nxdplug.runtime.application import NeuronApplicationBase

COMPILED = "compiled"


def cache_root() -> Path:
    """NXDPLUG_CACHE_DIR (the artefact store) when set, else ``$XDG_CACHE_HOME/nxdplug``
    (``~/.cache/nxdplug``)."""
    store = store_folder()
    if store is not None:
        return store
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "nxdplug"


def default_compiled_folder(app: NeuronApplicationBase) -> Path:
    """The cache's folder for ``app``'s graphs (NotSupportedError where no backend writes
    artefacts). Set ``save_sharded_checkpoint=False`` in the config first: the folder is
    shared by the models of one config."""
    digest, holds_weights = graphs_digest(app)
    if holds_weights:
        digest = hashlib.sha256((digest + _weights_identity(app)).encode()).hexdigest()
    return cache_root() / COMPILED / digest[:16]


def _weights_identity(app: NeuronApplicationBase) -> str:
    source = Path(app.weights_source(app.model_path, app.config)).resolve()
    files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
    stats = []
    for file in files:
        stat = file.stat()
        stats.append((str(file), stat.st_size, stat.st_mtime_ns))
    return json.dumps(stats)
