"""Print how much of the shipped Python is the core (``make core-share``).

Shipped Python is every ``*.py`` file of ``core/``, ``plugins/`` and ``contrib_models/`` (what
the wheel installs), counted in lines as ``wc -l`` counts them.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("core", "plugins", "contrib_models")


def lines_of(folder: Path) -> int:
    return sum(path.read_bytes().count(b"\n") for path in folder.rglob("*.py"))


def line_counts(root: Path = ROOT) -> dict[str, int]:
    """Lines per shipped top-level folder, and per package of ``core/``."""
    counts = {name: lines_of(root / name) for name in SHIPPED}
    for package in sorted(p for p in (root / "core").iterdir() if p.is_dir()):
        if any(package.rglob("*.py")):
            counts[f"core/{package.name}"] = lines_of(package)
    return counts


def core_share(root: Path = ROOT) -> float:
    counts = line_counts(root)
    return counts["core"] / sum(counts[name] for name in SHIPPED)


def main() -> None:
    counts = line_counts()
    total = sum(counts[name] for name in SHIPPED)
    for name, lines in sorted(counts.items(), key=lambda item: -item[1]):
        print(f"{lines:7d}  {name}")
    print(f"core/ is {counts['core']:,} of {total:,} shipped lines: {core_share():.1%}")


if __name__ == "__main__":
    main()
