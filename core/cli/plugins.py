"""``nxdplug plugins list | doctor | hooks``: what is installed, whether it is sound, the hooks.

Nothing here imports torch or model code: listing and checking plugins stays fast.
"""

from __future__ import annotations

import argparse
import inspect
import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

import attrs

from nxdplug.errors import NxdPlugError, PluginError
from nxdplug.hookspecs import API_VERSION
from nxdplug.lazy import is_ref
from nxdplug.manager import get_plugin_manager
from nxdplug.registry import get_registry


def hook_names() -> list[str]:
    """The core's hooks and those the installed plugins add."""
    return [
        name
        for spec_class in get_plugin_manager().spec_classes
        for name, _ in inspect.getmembers(spec_class, inspect.isfunction)
        if name.startswith("nxdplug_")
    ]


# list -----------------------------------------------------------------------------------------


def add_plugins_list_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON list of plugins")
    parser.add_argument(
        "--hook", metavar="NAME", help="only the plugins implementing this hook (nxdplug_...)"
    )


def run_plugins_list(args: argparse.Namespace) -> int:
    rows = plugin_rows()
    if args.hook is not None:
        _check_hook_name(args.hook)
        rows = [row for row in rows if args.hook in row["hooks"]]
    print(json.dumps(rows, indent=2) if args.json else format_plugin_table(rows))
    return 0


def _check_hook_name(name: str) -> None:
    if name not in hook_names():
        raise NxdPlugError(
            f"--hook {name!r} is not a hook; the hooks are: {', '.join(hook_names())}"
        )


def plugin_rows() -> list[dict[str, Any]]:
    """Every plugin seen (active, disabled or failed), its hooks and what it provides."""
    manager = get_plugin_manager()
    registry = get_registry()
    rows = []
    for info in manager.plugin_infos():
        active = info.status == "active"
        plugin = manager.get_plugin(info.name) if active else None
        hooks = [impl.name for impl in manager.get_hookcallers(plugin) or ()] if active else []
        rows.append(
            {
                "name": info.name,
                "distribution": info.distribution,
                "version": info.version,
                "status": info.status,
                "error": info.error,
                "api_version": info.api_version,
                "hooks": sorted(hooks),
                "provides": registry.provided_by(info.name) if active else {},
            }
        )
    return rows


def format_plugin_table(rows: Sequence[dict[str, Any]]) -> str:
    """Aligned columns; what a plugin provides (or its error) one kind per line."""
    table = [("PLUGIN", "STATUS", "FROM", ["PROVIDES"])]
    for row in rows:
        origin = f"{row['distribution']} {row['version']}" if row["distribution"] else "in-process"
        table.append((row["name"], row["status"], origin, _details(row)))
    widths = [max(len(cells[i]) for cells in table) for i in range(3)]
    lines = []
    for *cells, (first, *rest) in table:
        lines.append("".join(c.ljust(w + 2) for c, w in zip(cells, widths, strict=True)) + first)
        lines.extend(" " * (sum(widths) + 6) + line for line in rest)
    counts = Counter(row["status"] for row in rows)
    summary = ", ".join(f"{counts[s]} {s}" for s in ("active", "disabled", "failed") if counts[s])
    lines.append(f"\n{len(rows)} plugins: {summary or 'none installed'}")
    return "\n".join(lines)


def _details(row: dict[str, Any]) -> list[str]:
    if row["status"] == "failed":
        return [f"error: {row['error']}"]
    if row["status"] == "disabled":
        return ["(disabled by NXDPLUG_ALLOW_PLUGINS / NXDPLUG_DENY_PLUGINS)"]
    provided = [f"{kind}: {', '.join(names)}" for kind, names in row["provides"].items()]
    kinds = get_plugin_manager().record_kinds
    other = [h for h in row["hooks"] if h.removeprefix("nxdplug_") not in kinds]
    if other:
        provided.append(f"other hooks: {', '.join(other)}")
    return provided or ["-"]


# doctor ---------------------------------------------------------------------------------------


def doctor_findings() -> tuple[list[str], list[str]]:
    """(problems, warnings) over every installed plugin.

    Problems: a plugin that failed to load (import error, misspelled hook, wrong signature,
    another API version), names provided twice, a registration hook that raises or returns the
    wrong records, a lazy reference that does not import. Warnings: no declared API version.
    """
    manager = get_plugin_manager()
    registry = get_registry()
    problems = [
        f"{info.name} ({info.origin}): {info.error}"
        for info in manager.plugin_infos()
        if info.status == "failed"
    ]
    warnings = [
        f"{info.name} ({info.origin}) does not declare NXDPLUG_API_VERSION; add "
        f"`NXDPLUG_API_VERSION = {API_VERSION}` to its hooks module"
        for info in manager.plugin_infos()
        if info.status == "active" and info.api_version is None
    ]
    for kind in manager.record_kinds:
        try:
            records = registry.records(kind)
        except NxdPlugError as exc:
            problems.append(str(exc))
            continue
        problems += _reference_problems(kind, records, registry)
    return problems, warnings


def _reference_problems(kind: str, records: list[Any], registry: Any) -> list[str]:
    """Every lazy ``module:attribute`` reference of the records must resolve."""
    problems = []
    for record in records:
        for field in attrs.fields(type(record)):
            value = getattr(record, field.name)
            if field.name == "description" or not isinstance(value, str) or not is_ref(value):
                continue
            try:
                record.load(field.name)
            except PluginError as exc:
                owner = registry.provider(kind, record.name)
                problems.append(f"{owner}: {kind} {record.name!r}, field {field.name}: {exc}")
    return problems


def add_plugins_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")


def run_plugins_doctor(args: argparse.Namespace) -> int:
    problems, warnings = doctor_findings()
    if args.json:
        print(json.dumps({"problems": problems, "warnings": warnings}, indent=2))
    else:
        count = len(get_plugin_manager().plugin_infos())
        for line in problems:
            print(f"problem: {line}")
        for line in warnings:
            print(f"warning: {line}")
        verdict = "no problems" if not problems else f"{len(problems)} problem(s)"
        print(f"{count} plugins checked: {verdict}, {len(warnings)} warning(s)")
    return 1 if problems else 0


# hooks ----------------------------------------------------------------------------------------


def hook_reference_markdown() -> str:
    """The hook reference, generated from the hookspecs' docstrings (docs/hooks.md)."""
    lines = [
        "# Hook reference",
        "",
        "Generated by `nxdplug plugins hooks` from `nxdplug/hookspecs.py` and the hooks the "
        "installed plugins add; do not edit by hand.",
        "",
    ]
    for spec_class in get_plugin_manager().spec_classes:
        lines += [
            f"## {spec_class.__name__}",
            "",
            f"Declared in `{spec_class.__module__}`.",
            "",
            inspect.getdoc(spec_class) or "",
            "",
        ]
        for name, function in inspect.getmembers(spec_class, inspect.isfunction):
            if not name.startswith("nxdplug_"):
                continue
            signature = str(inspect.signature(function)).replace("'", "")
            signature = signature.replace("(self, ", "(").replace("(self)", "()")
            doc = (inspect.getdoc(function) or "").replace(".. code-block:: python", "```python")
            lines += [f"### `{name}{signature}`", "", *_close_code_block(doc), ""]
    return "\n".join(lines).rstrip() + "\n"


def _close_code_block(doc: str) -> list[str]:
    """Turn the reST example (an indented block after its directive) into a fenced block."""
    out, in_code = [], False
    for line in doc.splitlines():
        if line.startswith("```python"):
            in_code = True
            out.append(line)
        elif in_code and not line.strip() and out[-1] == "```python":
            continue
        elif in_code and line.strip() and not line.startswith("    "):
            out += ["```", line]
            in_code = False
        else:
            out.append(line[4:] if in_code else line)
    if in_code:
        while out and not out[-1].strip():
            out.pop()
        out.append("```")
    return out


def run_plugins_hooks(args: argparse.Namespace) -> int:
    print(hook_reference_markdown(), end="")
    return 0
