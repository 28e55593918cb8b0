"""Packaging rules: the explicit package list, installed names only, documented hooks."""

from __future__ import annotations

import ast
import inspect
import tomllib
from pathlib import Path

import pytest

from nxdplug.manager import create_plugin_manager
from tests import REPO_ROOT

ROOT = REPO_ROOT
PACKAGE_DIRS = {
    "nxdplug": "core",
    "nxdplug.plugins": "plugins",
    "nxdplug.contrib_models": "contrib_models",
    "nxdplug.nxdi": "plugins/nxdi",
    "nxdplug.testing": "plugins/testing",
}
FORBIDDEN_TOP_LEVEL = {"core", "plugins", "contrib_models"}


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def package_of(path: Path) -> str:
    """The package a folder is installed as: the mapping of its nearest mapped ancestor."""
    package, folder = max(
        (item for item in PACKAGE_DIRS.items() if path.is_relative_to(ROOT / item[1])),
        key=lambda item: len(item[1]),
    )
    return ".".join([package, *path.relative_to(ROOT / folder).parts])


def packages_on_disk() -> set[str]:
    return {
        package_of(init.parent)
        for folder in PACKAGE_DIRS.values()
        for init in (ROOT / folder).rglob("__init__.py")
    }


def test_package_dir_mapping() -> None:
    assert pyproject()["tool"]["setuptools"]["package-dir"] == PACKAGE_DIRS


def test_explicit_package_list_matches_the_folders() -> None:
    assert set(pyproject()["tool"]["setuptools"]["packages"]) == packages_on_disk()


def test_every_plugin_folder_is_an_entry_point() -> None:
    entry_points = pyproject()["project"]["entry-points"]["nxdplug"]
    modules = {value.rsplit(".", 1)[0] for value in entry_points.values()}
    plugin_packages = {
        p
        for p in packages_on_disk()
        if p.startswith(("nxdplug.plugins.", "nxdplug.contrib_models.")) and p.count(".") == 2
    }
    assert plugin_packages | {"nxdplug.nxdi", "nxdplug.testing"} == modules


def test_every_non_python_source_file_ships_as_package_data() -> None:
    """A file beside the modules that is not Python (the int8 matmul's C++ source, a header in a
    folder of a package) is only in an installed wheel when package-data names it, by its path
    from the package's folder."""
    listed = pyproject()["tool"]["setuptools"]["package-data"]
    shipped = {(package, name) for package, names in listed.items() for name in names}
    found = set()
    for folder in PACKAGE_DIRS.values():
        for path in (ROOT / folder).rglob("*"):
            if (
                path.is_file()
                and path.suffix not in (".py", ".pyc")
                and "__pycache__" not in path.parts
            ):
                package = next(p for p in path.parents if (p / "__init__.py").exists())
                found.add((package_of(package), path.relative_to(package).as_posix()))
    assert found == shipped


def python_files() -> list[Path]:
    folders = ["core", "plugins", "contrib_models", "tests", "examples"]
    return [f for folder in folders for f in (ROOT / folder).rglob("*.py")]


@pytest.mark.parametrize("path", python_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_imports_the_source_folders_as_packages(path: Path) -> None:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            assert name.split(".")[0] not in FORBIDDEN_TOP_LEVEL, f"{path}:{node.lineno} {name}"


def hook_specs() -> list[tuple[str, object]]:
    return [
        (name, function)
        for spec_class in create_plugin_manager().spec_classes
        for name, function in inspect.getmembers(spec_class, inspect.isfunction)
        if name.startswith("nxdplug_")
    ]


@pytest.mark.parametrize(
    ("name", "function"), hook_specs(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_hook_is_documented_with_an_example(name, function) -> None:
    doc = inspect.getdoc(function) or ""
    assert "@nxdplug.hookimpl" in doc and f"def {name}(" in doc, name
    assert "return" in inspect.get_annotations(function, eval_str=False)


@pytest.mark.parametrize(
    ("name", "function"), hook_specs(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_hook_is_implemented_somewhere_in_the_tests_or_plugins(name, function) -> None:
    this_file = Path(__file__).resolve()
    sources = [p for p in (ROOT / "tests").rglob("*.py") if p.resolve() != this_file]
    sources += list((ROOT / "plugins").rglob("hooks.py"))
    sources += list((ROOT / "contrib_models").rglob("hooks.py"))
    assert any(f"def {name}(" in p.read_text() for p in sources), f"{name} is never implemented"


def test_public_api_names_resolve() -> None:
    import nxdplug

    for name in nxdplug.__all__:
        assert getattr(nxdplug, name) is not None, name
    from nxdplug.contrib_models.llama import LlamaInferenceConfig, NeuronLlamaForCausalLM
    from nxdplug.contrib_models.mistral import NeuronMistralForCausalLM
    from nxdplug.contrib_models.qwen2 import NeuronQwen2ForCausalLM
    from nxdplug.contrib_models.qwen3 import NeuronQwen3ForCausalLM

    assert issubclass(NeuronLlamaForCausalLM, nxdplug.NeuronBaseForCausalLM)
    assert issubclass(NeuronMistralForCausalLM, NeuronLlamaForCausalLM)
    assert issubclass(NeuronQwen2ForCausalLM, NeuronLlamaForCausalLM)
    assert issubclass(NeuronQwen3ForCausalLM, NeuronLlamaForCausalLM)
    assert issubclass(LlamaInferenceConfig, nxdplug.InferenceConfig)
    assert NeuronLlamaForCausalLM.get_config_cls() is LlamaInferenceConfig
