"""Loading a compiled graph so that it runs without holding Python's GIL (``graph_runner.cpp``).

``torch._inductor.aoti_load_package`` gives a loader that keeps the GIL for the whole of a
graph's run: no other thread of the process runs Python meanwhile (the server's HTTP thread,
async mode's host work). The extension holds the same C++ loader in a TorchBind class, whose
calls release the GIL. Where it cannot be built (no C++ compiler, a failed build), graphs are
loaded by torch's loader, after a warning.
"""

from __future__ import annotations

import functools
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

from nxdplug.plugin_api import build_operator_library

SOURCE = Path(__file__).with_name("graph_runner.cpp")
LIBRARY = "nxdplug_graph_runner"


@functools.cache
def releases_gil() -> bool:
    """Whether this process loads graphs with the extension (built and loaded on first call)."""
    return build_operator_library(
        LIBRARY,
        SOURCE,
        purpose="graph runner",
        instead="compiled graphs hold Python's GIL while they run (other threads wait)",
    )


def load_package(path: Path) -> Any:
    """The package's loader: ``boxed_run(flat inputs)``, ``get_call_spec()``,
    ``get_metadata()``, as torch's binding names them.

    Given a ``.pt2`` file, torch's loader unpacks it into a temporary folder that only its
    destructor removes, and objects alive when the interpreter exits are not destroyed: each
    process left ~2 MB a graph in the temporary directory. Here the package is unpacked into a
    folder that is removed once the graph is loaded (its shared library stays mapped)."""
    if not releases_gil():
        return torch._inductor.aoti_load_package(str(path)).loader
    with tempfile.TemporaryDirectory(prefix="nxdplug-graph-") as folder:
        with zipfile.ZipFile(path) as archive:
            archive.extractall(folder)
        (root,) = Path(folder).iterdir()  # the archive holds one folder, named after it
        return torch.classes.nxdplug_graph_runner.Package(str(root))
