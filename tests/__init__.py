"""nxdplug's tests, laid out as the project is: core/ (one folder per core package), plugins/
(one folder per first-party plugin), models/ (the model families against HF), examples/."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
