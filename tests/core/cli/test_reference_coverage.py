"""Every attribute the API reference documents is known to nxdplug and handled by someone:
the core, a named plugin or backend; the known gaps are printed and may only shrink."""

from __future__ import annotations

import inspect

import attrs
import pytest

import nxdplug.config
from nxdplug.cli import coverage
from nxdplug.cli.coverage import (
    CORE_ATTRIBUTES,
    KNOWN_GAPS,
    READ_WITH,
    DocumentedAttribute,
)
from nxdplug.cli.main import main as cli_main
from nxdplug.registry import get_registry
from tests import REPO_ROOT

ROOT = REPO_ROOT
REFERENCE = ROOT.parent / "shared" / "reference" / "api-reference.rst"
COVERAGE_PAGE = ROOT / "docs" / "api-coverage.md"

pytestmark = pytest.mark.skipif(
    not REFERENCE.is_file(), reason=f"the API reference is not at {REFERENCE}"
)


@pytest.fixture(scope="module")
def statuses() -> dict[DocumentedAttribute, str]:
    return coverage.coverage(REFERENCE.read_text())


def field_names(class_name: str) -> set[str]:
    cls = getattr(nxdplug.config, class_name)
    if attrs.has(cls):
        return {f.name for f in attrs.fields(cls)}
    return set(inspect.signature(cls).parameters)


def test_the_reference_is_parsed_into_every_config_class(statuses) -> None:
    classes = {a.config_class for a in statuses}
    assert classes == set(coverage.CONFIG_CLASSES)
    assert len(statuses) > 100
    labels = {a.label for a in statuses}
    assert {
        "OnDeviceSamplingConfig.global_topk",
        "LoraServingConfig.enable_dynamic_multi_lora",
    } <= (labels)
    assert not any("ckpt_dir" in label for label in labels)  # a JSON file's field, not a config's


def test_every_documented_attribute_is_a_field(statuses) -> None:
    unknown = [a.label for a in statuses if a.name not in field_names(a.config_class)]
    assert unknown == [], "documented but unknown to nxdplug's config classes: " + ", ".join(
        unknown
    )


def test_every_documented_attribute_is_handled(statuses) -> None:
    print("\nknown gaps (silently ignored today):")
    for label, issue in sorted(KNOWN_GAPS.items()):
        print(f"  {label} ({issue})")
    unhandled = [a.label for a, state in statuses.items() if state == "unhandled"]
    assert unhandled == [], (
        "documented attributes no plugin, backend or core code handles (implement, refuse, or "
        "list in KNOWN_GAPS with the issue): " + ", ".join(unhandled)
    )


def test_known_gaps_are_not_stale(statuses) -> None:
    by_label = {a.label: state for a, state in statuses.items()}
    stale = [label for label in KNOWN_GAPS if not by_label.get(label, "").startswith("gap")]
    assert stale == [], "handled or undocumented now; remove from KNOWN_GAPS: " + ", ".join(stale)


def test_reviewed_lists_name_documented_fields_of_installed_plugins(statuses) -> None:
    labels = {a.label for a in statuses}
    reviewed = [*CORE_ATTRIBUTES, *READ_WITH, *KNOWN_GAPS]
    assert [label for label in reviewed if label not in labels] == []
    assert len(reviewed) == len(set(reviewed)), "an attribute is in two reviewed lists"
    handlers = coverage._handlers(get_registry())
    orphans = [label for label, (holder, _) in READ_WITH.items() if not handlers.get(holder)]
    assert orphans == [], "read with an attribute no installed plugin handles: " + ", ".join(
        orphans
    )


def test_coverage_page_table_is_the_generated_one(statuses) -> None:
    table = coverage.markdown_table(statuses)
    assert table in COVERAGE_PAGE.read_text(), (
        "docs/api-coverage.md's attribute table is stale: regenerate it with "
        "`python -m nxdplug.cli.coverage --markdown`"
    )


def test_check_config_explain_names_who_handles_each_set_attribute(tiny_checkpoint, capsys) -> None:
    path = tiny_checkpoint("llama")
    code = cli_main(["check-config", "--model-path", str(path), "--explain", "--fused-qkv"])
    out = capsys.readouterr().out
    assert "fused_qkv" in out and "plugin fused_qkv" in out
    assert code == 0
