"""The core stays small: it imports no plugin or model, and names features only by the NxD
Inference attribute and API names the reference documents (or by its own extension points)."""

from __future__ import annotations

import ast
import importlib.util
import io
import re
import tokenize
from pathlib import Path

import attrs
import pytest
import torch

from nxdplug import hookspecs
from tests import REPO_ROOT

ROOT = REPO_ROOT
CORE = ROOT / "core"
REFERENCE = ROOT.parent / "shared" / "reference"
# The test kit is a plugin installed under its own import path (pyproject's package-dir).
OUTSIDE_CORE = ("nxdplug.plugins", "nxdplug.contrib_models", "nxdplug.testing")

# Feature names: a core identifier or string word holding one of these is a feature's logic
# leaking into core, unless the reference documents the name.
FEATURE_WORDS = re.compile(
    r"medusa|eagle|lora|quant|fp8|float8|f8e4m3|f8e5m2|int8|moe|expert|on_device|on-device"
    r"|prompt_?logprob|prompt_rank|prompt_top",
    re.IGNORECASE,
)
# Building blocks the reference names as reusable modules of the core (NxD's RouterTopK,
# ExpertMLPs and MoE, NxD Inference's initialize_moe_module), which may use the words of their
# own subject inside their folder.
BUILDING_BLOCKS = {CORE / "modules" / "moe": re.compile(r"moe|expert", re.IGNORECASE)}
# Names of the contract of an extension point the core defines: the quantization-methods
# record's implementation is asked for quantize_state_dict, as NxD Inference names it; a
# quantized checkpoint format is found by the quant_method of config.json's
# quantization_config, as transformers finds it, and lists the quant_methods it reads.
EXTENSION_CONTRACT = {"quantize_state_dict", "quantization_config", "quant_method", "quant_methods"}


def core_files() -> list[Path]:
    return sorted(CORE.rglob("*.py"))


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [(node.lineno, ref) for ref in re.findall(r"nxdplug\.[\w.]+", node.value)]
    return found


def test_core_imports_no_plugin_and_no_model() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line} {module}"
        for path in core_files()
        for line, module in imported_modules(path)
        if module.startswith(OUTSIDE_CORE)
    ]
    assert offenders == []


def plugin_files() -> list[Path]:
    """The built-in plugins and model families, and the example third-party packages."""
    folders = [
        "plugins",
        "contrib_models",
        "examples/nxdplug-softcap/src",
        "examples/nxdplug-gptneox/src",
    ]
    return sorted(path for folder in folders for path in (ROOT / folder).rglob("*.py"))


def test_plugins_import_the_core_only_through_the_plugin_api() -> None:
    """A plugin takes nxdplug's objects from ``nxdplug.plugin_api`` (besides other plugins),
    so that the core's modules may move without breaking any plugin."""
    allowed = ("nxdplug.plugin_api", *OUTSIDE_CORE, "nxdplug.nxdi")
    offenders = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.module}"
        for path in plugin_files()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        and node.module
        and node.module.split(".")[0] == "nxdplug"
        and not node.module.startswith(allowed)
    ]
    assert offenders == []


def test_the_plugin_api_names_resolve_lazily() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import nxdplug.plugin_api as api\n"
        "from nxdplug.plugin_api import Feature, hookimpl\n"
        "assert 'torch' not in sys.modules, 'records imported torch'\n"
        "missing = [n for n in api.__all__ if getattr(api, n, None) is None]\n"
        "print(len(api.__all__), missing)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    count, missing = out.stdout.split(maxsplit=1)
    assert int(count) > 100 and missing.strip() == "[]"


def documented_names() -> set[str]:
    """Code names of the reference: ``literals`` and identifiers (snake_case, CamelCase), not
    prose words; and the fields of the config classes, which declare NxD Inference's
    attributes."""
    text = "".join(p.read_text(errors="replace") for p in sorted(REFERENCE.glob("*")))
    literals = {w for lit in re.findall(r"``([^`]+)``", text) for w in re.findall(r"\w+", lit)}
    identifiers = {w for w in re.findall(r"[A-Za-z_]\w*", text) if re.search(r"_|[a-z][A-Z]", w)}
    return literals | identifiers | config_fields()


def config_fields() -> set[str]:
    import nxdplug.config

    classes = [v for v in vars(nxdplug.config).values() if isinstance(v, type) and attrs.has(v)]
    modules = {path.stem for path in (CORE / "config").glob("*.py")}
    return modules | {field.name for cls in classes for field in attrs.fields(cls)}


def extension_point_names() -> set[str]:
    """The hooks, registry kinds and record classes the core itself defines."""
    kinds = hookspecs.RECORD_KINDS
    names = {kind.name for kind in kinds} | {kind.hook for kind in kinds}
    names |= {kind.record_type.__name__ for kind in kinds}
    return names | {name for cls in hookspecs.SPEC_CLASSES for name in vars(cls)}


def torch_names() -> set[str]:
    """torch's dtypes and tensor attributes, which checkpoint code reads by name."""
    dtypes = {
        str(v).removeprefix("torch.") for v in vars(torch).values() if isinstance(v, torch.dtype)
    }
    return dtypes | set(dir(torch.Tensor))


def code_words(path: Path) -> list[tuple[int, str]]:
    """Identifiers, and string literals that are names (attribute names, keys, references),
    without comments, docstrings and messages."""
    words = []
    previous = tokenize.NEWLINE
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type in (tokenize.COMMENT, tokenize.NL):
            continue
        starts_statement = previous in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
        if token.type == tokenize.NAME:
            words.append((token.start[0], token.string))
        elif token.type == tokenize.STRING and not starts_statement:
            text = token.string.strip("\"'")
            if re.fullmatch(r"[\w.:\-]+", text):
                words += [(token.start[0], w) for w in re.findall(r"[A-Za-z_]\w*", text)]
        previous = token.type
    return words


def own_subject(path: Path, word: str) -> bool:
    """Whether ``word`` names only the subject of the building block ``path`` belongs to."""
    for folder, subject in BUILDING_BLOCKS.items():
        if path.is_relative_to(folder) and not FEATURE_WORDS.search(subject.sub("", word)):
            return True
    return False


def feature_words(paths: list[Path], allowed: set[str]) -> list[str]:
    return [
        f"{path.name}:{line} {word}"
        for path in paths
        for line, word in code_words(path)
        if FEATURE_WORDS.search(word)
        and word.lstrip("_") not in allowed
        and not own_subject(path, word)
    ]


needs_reference = pytest.mark.skipif(
    not REFERENCE.is_dir(), reason=f"the API reference is not at {REFERENCE}"
)


def building_block_names() -> set[str]:
    """What the building blocks define, which the plugin API names when it exports them."""
    return {
        node.name
        for folder in BUILDING_BLOCKS
        for path in folder.rglob("*.py")
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.FunctionDef | ast.ClassDef)
    }


@needs_reference
def test_core_names_features_only_by_documented_names() -> None:
    allowed = documented_names() | extension_point_names() | torch_names() | EXTENSION_CONTRACT
    allowed |= building_block_names()
    offenders = feature_words(core_files(), allowed)
    assert offenders == [], "feature logic belongs in its plugin: " + "; ".join(offenders)


@needs_reference
def test_the_word_check_catches_feature_code(tmp_path: Path) -> None:
    """The check is not vacuous: feature code is caught, docstrings and comments are not."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        '''"""Medusa trees are a plugin's business."""


def build_medusa_tree(is_medusa):  # a medusa comment
    return {"mode": "eagle-fused", "on": is_medusa, "why": "EAGLE is prose here"}
'''
    )
    allowed = documented_names() | extension_point_names()
    assert feature_words([sample], allowed) == [
        "sample.py:4 build_medusa_tree",
        "sample.py:5 eagle",
    ]


@needs_reference
def test_prompt_log_probabilities_are_a_plugins_words(tmp_path: Path) -> None:
    """Prompt log-probabilities live in their plugin (issue #46 item 5): the reference names
    none of their words, so the core code that once served them would be caught."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        'PROMPT_LOGPROBS = "prompt_logprobs"\n'
        "asked = request.settings.prompt_logprobs\n"
        "score = PromptLogprob(outputs.prompt_ranks, outputs.prompt_top_ids)\n"
    )
    allowed = documented_names() | extension_point_names()
    assert feature_words([sample], allowed) == [
        "sample.py:1 PROMPT_LOGPROBS",
        "sample.py:1 prompt_logprobs",
        "sample.py:2 prompt_logprobs",
        "sample.py:3 PromptLogprob",
        "sample.py:3 prompt_ranks",
        "sample.py:3 prompt_top_ids",
    ]


@needs_reference
def test_a_building_block_may_name_its_own_subject_only(monkeypatch, tmp_path: Path) -> None:
    folder = tmp_path / "moe"
    folder.mkdir()
    sample = folder / "blocks.py"
    sample.write_text("def route(expert_index, moe_degrees, lora_slots, expert_lora):\n    pass\n")
    monkeypatch.setitem(BUILDING_BLOCKS, folder, BUILDING_BLOCKS[CORE / "modules" / "moe"])
    allowed = documented_names() | extension_point_names()
    assert feature_words([sample], allowed) == ["blocks.py:1 lora_slots", "blocks.py:1 expert_lora"]


def test_the_core_share_does_not_grow_back() -> None:
    """The core's share of the shipped Python (``make core-share``): at most 45%, the
    application layers (serve, benchmark, nxdplug.nxdi) and the test kit (nxdplug.testing)
    being plugins, not core."""
    spec = importlib.util.spec_from_file_location("core_share", ROOT / ".ci" / "core_share.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.core_share() <= 0.45


# The core's packages from the bottom up: a module imports only from its own layer and below
# (TYPE_CHECKING imports aside). Issue #46 item 4.
LAYERS = (
    (
        "__init__",
        "errors",
        "lazy",
        "contracts",
        "slots",
        "types",
        "hookspecs",
        "manager",
        "registry",
    ),
    ("checkpoint",),
    ("config",),
    ("modules",),
    ("pipeline",),
    ("compile",),
    ("runtime",),
    ("engine",),
    ("generation",),
    ("cli", "plugin_api"),
)


def runtime_imports(path: Path) -> list[str]:
    """The modules ``path`` imports, at module level or in functions, not for type checkers."""
    found = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.extend(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module:
                found.append(child.module)
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def test_core_packages_import_in_layer_order() -> None:
    layer = {name: index for index, names in enumerate(LAYERS) for name in names}
    against = set()
    for path in core_files():
        relative = path.relative_to(CORE)
        own = relative.parts[0] if len(relative.parts) > 1 else relative.stem
        for module in runtime_imports(path):
            parts = module.split(".")
            if parts[0] != "nxdplug" or module.startswith(OUTSIDE_CORE):
                continue
            target = parts[1] if len(parts) > 1 else "__init__"
            if layer[target] > layer[own]:
                against.add((relative.as_posix(), module))
    assert against == set(), "an import against the layer order"


# Contracts name the real classes (InferenceConfig, PipelineContext, the application), not Any:
# issue #46 item 3.
UNTYPED_NAMES = {"config", "context", "app"}


def untyped_contracts(paths: list[Path]) -> list[tuple[Path, int, str]]:
    """``config: Any``, ``context: Any`` and ``app: Any``: parameters and annotated names."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.arg):
                name, annotation = node.arg, node.annotation
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                name, annotation = node.target.id, node.annotation
            else:
                continue
            if name in UNTYPED_NAMES and annotation and ast.unparse(annotation) == "Any":
                found.append((path, node.lineno, name))
    return found


def test_contracts_are_typed_with_real_classes() -> None:
    folders = [CORE, ROOT / "plugins", ROOT / "contrib_models"]
    found = untyped_contracts(sorted(p for folder in folders for p in folder.rglob("*.py")))
    listed = "\n".join(f"{path.relative_to(ROOT)}:{line} {name}" for path, line, name in found)
    assert found == [], listed


def test_the_contract_count_sees_parameters_and_fields(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "class C:\n    config: Any\n\n"
        "def f(context: Any, app: Any, neuron_config: Any, config: Config) -> None: ...\n"
    )
    assert untyped_contracts([sample]) == [
        (sample, 2, "config"),
        (sample, 4, "context"),
        (sample, 4, "app"),
    ]
