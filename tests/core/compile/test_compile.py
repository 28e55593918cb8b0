"""Compile once, load anywhere: the inductor backend, the compiled folder, the artefact store.

One tiny model is compiled once for the module (two graphs, about 20 s on 2 cores) with a
shared artefact store, so the other compiles here are store hits.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nxdplug import HuggingFaceGenerationAdapter, NeuronConfig, from_pretrained
from nxdplug.compile.artefacts import ArtefactError, Manifest
from nxdplug.errors import NotSupportedError
from nxdplug.plugins.inductor_backend import prepacked_linear
from nxdplug.plugins.inductor_backend.backend import InductorBackend, annotated_graph

SETTINGS = {"torch_dtype": "float32", "batch_size": 2, "seq_len": 64, "max_context_length": 16}
PROMPTS = torch.tensor([[0, 0, 5, 17, 42, 9], [8, 250, 31, 99, 7, 3]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])


def app_for(path: Path, **options):
    return from_pretrained(path, NeuronConfig(**(SETTINGS | options)))


def generate(app, new_tokens: int = 24) -> torch.Tensor:
    adapter = HuggingFaceGenerationAdapter(app)
    return adapter.generate(
        PROMPTS, attention_mask=MASK, max_new_tokens=new_tokens, eos_token_id=None
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("artefact-store")


@pytest.fixture(scope="module")
def compiled(tiny_checkpoint, tmp_path_factory, store):
    """(checkpoint, compiled folder), compiled once with the store enabled."""
    checkpoint = tiny_checkpoint("llama", seed=7)
    folder = tmp_path_factory.mktemp("compiled") / "llama"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NXDPLUG_CACHE_DIR", str(store))
        app_for(checkpoint).compile(folder, quiet=True)
    return checkpoint, folder


@pytest.fixture
def with_store(monkeypatch, store):
    monkeypatch.setenv("NXDPLUG_CACHE_DIR", str(store))


def test_folder_layout_and_recorded_backend(compiled) -> None:
    _, folder = compiled
    manifest = Manifest.read(folder)
    assert manifest.backend == "inductor"
    assert {(g.tag, g.bucket) for g in manifest.graphs} == {
        ("context_encoding_model", 16),
        ("token_generation_model", 64),
    }
    assert manifest.weights == ("weights/rank0.safetensors",)
    assert set(manifest.files) == {g.file for g in manifest.graphs} | {
        "weights/rank0.safetensors",
        "neuron_config.json",
    }
    assert {"nxdplug", "torch", "device"} <= set(manifest.versions)
    assert "llama" in manifest.plugins
    saved = json.loads((folder / "neuron_config.json").read_text())
    assert saved["neuron_config"]["compile_backend"] == "inductor"
    assert not list(folder.parent.glob(".*partial"))


LOAD_IN_FRESH_PROCESS = """
import sys, torch
from nxdplug import HuggingFaceGenerationAdapter, NeuronConfig, from_pretrained
settings = {settings!r}
app = from_pretrained(sys.argv[1], NeuronConfig(**settings))
app.load(sys.argv[2], quiet=True)
prompts = torch.tensor({prompts}); mask = torch.tensor({mask})
out = HuggingFaceGenerationAdapter(app).generate(
    prompts, attention_mask=mask, max_new_tokens=24, eos_token_id=None)
print(out.tolist())
"""


def test_fresh_process_loads_and_generates_the_eager_tokens(compiled) -> None:
    checkpoint, folder = compiled
    script = LOAD_IN_FRESH_PROCESS.format(
        settings=SETTINGS, prompts=PROMPTS.tolist(), mask=MASK.tolist()
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(checkpoint), str(folder)],
        capture_output=True,
        text=True,
        check=True,
    )
    loaded = torch.tensor(json.loads(result.stdout.strip().splitlines()[-1]))
    eager = app_for(checkpoint)
    eager.to_cpu()
    expected = generate(eager)
    assert torch.equal(loaded, expected)
    assert len(set(expected[0, 6:].tolist())) >= 4


def test_loaded_model_state(compiled) -> None:
    checkpoint, folder = compiled
    app = app_for(checkpoint)
    app.load(folder, quiet=True)
    assert app.is_loaded_to_neuron and app.backend_name == "inductor"
    cache = app.context_encoding_model.model.kv_mgr
    generate(app, 4)
    assert app.kv_cache_populated
    assert any(buffer.abs().sum() > 0 for buffer in cache.buffers())
    app.reset_kv_cache()
    assert all(buffer.abs().sum() == 0 for buffer in cache.buffers())


def test_linear_weights_are_prepacked_once_for_every_graph(compiled, monkeypatch) -> None:
    """The projections are held once, in oneDNN's layout, by the one list every sub-model
    passes to its graphs, those of one input stacked (Q/K/V in q_proj's place, gate/up in
    gate_proj's); embeddings and norms stay plain. Without oneDNN the same graphs run on the
    plain (stacked) weights and give the same tokens."""
    checkpoint, folder = compiled
    app = app_for(checkpoint)
    app.load(folder, quiet=True)
    held = app.weight_tensors()
    prepacked = {name for name, tensor in held.items() if tensor.is_mkldnn}
    projections = {n for n in held if n.endswith(("_proj.weight", "lm_head.weight"))}
    stacked_away = {n for n in projections if n.endswith(("k_proj.weight", "v_proj.weight"))}
    stacked_away |= {n for n in projections if n.endswith("up_proj.weight")}
    assert {n for n in projections if held[n].numel() == 0} == stacked_away
    assert prepacked == projections - stacked_away and len(prepacked) == 4 * 2 + 1
    assert held["layers.0.self_attn.q_proj.weight"].shape == (64 + 2 * 32, 64)  # Q, K, V
    assert app.token_generation_model.model.weights is app.context_encoding_model.model.weights
    tokens = generate(app)

    monkeypatch.setattr(prepacked_linear, "prepacking_available", lambda: False)
    plain = app_for(checkpoint)
    plain.load(folder, quiet=True)
    assert not any(tensor.is_mkldnn for tensor in plain.weight_tensors().values())
    assert torch.equal(generate(plain), tokens)


def test_second_compile_is_a_cache_hit(compiled, capsys) -> None:
    checkpoint, folder = compiled
    before = {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}
    app = app_for(checkpoint)
    app.compile(folder)
    assert "reusing it" in capsys.readouterr().err
    assert app.is_compiled
    assert before == {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def test_store_hit_compiles_nothing(compiled, tmp_path, with_store, monkeypatch, capsys) -> None:
    checkpoint, _ = compiled

    def no_compiling(*args, **kwargs):
        raise AssertionError("the store should have provided the graphs")

    monkeypatch.setattr(InductorBackend, "compile_graph", no_compiling)
    app_for(checkpoint).compile(tmp_path / "from-store")
    assert "found in the store" in capsys.readouterr().err
    app = app_for(checkpoint)
    app.load(tmp_path / "from-store", quiet=True)
    assert generate(app, 4).shape == (2, 10)


def test_mismatched_config_is_refused_naming_the_fields(compiled) -> None:
    checkpoint, folder = compiled
    app = app_for(checkpoint, batch_size=1, seq_len=48)
    with pytest.raises(ArtefactError) as error:
        app.load(folder, quiet=True)
    message = str(error.value)
    assert "neuron_config.batch_size: 2 -> 1" in message
    assert "neuron_config.seq_len: 64 -> 48" in message


def test_runtime_only_settings_do_not_force_a_recompile(compiled) -> None:
    checkpoint, folder = compiled
    app_for(checkpoint, skip_warmup=True).load(folder, quiet=True)


@pytest.mark.parametrize("damage", ["corrupt", "delete"])
def test_damaged_file_is_refused_by_name(compiled, tmp_path, damage) -> None:
    checkpoint, folder = compiled
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    graph = next((copy / "graphs").glob("token_generation_model-*"))
    if damage == "corrupt":
        data = bytearray(graph.read_bytes())
        data[len(data) // 2] ^= 0xFF
        graph.write_bytes(bytes(data))
    else:
        graph.unlink()
    expected = "is corrupted" if damage == "corrupt" else "is missing"
    with pytest.raises(ArtefactError, match=f"graphs/{graph.name} {expected}"):
        app_for(checkpoint).load(copy, quiet=True)


def test_not_a_compiled_folder(tmp_path, tiny_checkpoint) -> None:
    with pytest.raises(ArtefactError, match=r"manifest\.json is missing"):
        app_for(tiny_checkpoint("llama", seed=7)).load(tmp_path, quiet=True)


def test_load_weights_swaps_weights_without_recompiling(
    compiled, tiny_checkpoint, tmp_path, with_store
) -> None:
    checkpoint, folder = compiled
    other = tiny_checkpoint("llama", seed=8)
    app_for(other).compile(tmp_path / "other", quiet=True)  # store hit: graphs are shared
    app = app_for(checkpoint)
    app.load(folder, quiet=True)
    graphs = app.context_encoding_model.model.graphs
    app.load_weights(tmp_path / "other")
    assert app.context_encoding_model.model.graphs is graphs
    eager = app_for(other)
    eager.to_cpu()
    assert torch.equal(generate(app), generate(eager))


def test_weights_read_from_the_checkpoint_when_not_saved(compiled, tmp_path, with_store) -> None:
    checkpoint, _ = compiled
    folder = tmp_path / "no-weights"
    app_for(checkpoint, save_sharded_checkpoint=False).compile(folder, quiet=True)
    assert not (folder / "weights").exists()
    app = app_for(checkpoint, save_sharded_checkpoint=False)
    app.load(folder, quiet=True)
    eager = app_for(checkpoint)
    eager.to_cpu()
    assert torch.equal(generate(app, 8), generate(eager, 8))
    app.shard_weights(folder)
    assert Manifest.read(folder).weights == ("weights/rank0.safetensors",)
    app_for(checkpoint).load(folder, quiet=True)


def test_failed_compile_leaves_no_folder(compiled, tmp_path, monkeypatch) -> None:
    checkpoint, _ = compiled
    calls = []

    def fail_on_second(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("killed half-way")
        Path(args[2]).write_bytes(b"half")

    monkeypatch.setattr(InductorBackend, "compile_graph", fail_on_second)
    target = tmp_path / "target"
    with pytest.raises(RuntimeError, match="killed half-way"):
        app_for(checkpoint, seq_len=32).compile(target, quiet=True)
    # no folder, staged or not; only the lock file concurrent compiles of it take
    assert [p.name for p in tmp_path.iterdir()] == [".target.lock"]


def test_requested_backend_is_used_or_refused_never_replaced(compiled, tmp_path) -> None:
    checkpoint, _ = compiled
    with pytest.raises(NotSupportedError, match="torch-neuronx is not installed"):
        app_for(checkpoint, compile_backend="neuron").compile(tmp_path / "n", quiet=True)
    with pytest.raises(NotSupportedError, match="writes no compiled artefacts"):
        app_for(checkpoint, compile_backend="eager").compile(tmp_path / "e", quiet=True)
    assert not any(tmp_path.iterdir())


def test_backend_from_the_environment(compiled, tmp_path, monkeypatch) -> None:
    checkpoint, _ = compiled
    monkeypatch.setenv("NXDPLUG_BACKEND", "neuron")
    with pytest.raises(NotSupportedError, match="'neuron' compile backend is not available"):
        app_for(checkpoint).compile(tmp_path / "n", quiet=True)


def test_debug_graph_is_annotated_with_source_lines(tmp_path, monkeypatch) -> None:
    class Tiny(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x) * 2

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", lambda *a, **k: None)
    output = tmp_path / "tiny.pt2"
    InductorBackend().compile_graph(
        Tiny(), (torch.ones(3),), output, debug=True, compiler_args=None
    )
    text = output.with_suffix(".graph.txt").read_text()
    assert "aten.relu" in text and "return torch.relu(x) * 2" in text
    program = torch.export.export(Tiny(), (torch.ones(3),))
    assert annotated_graph(program) == text


def test_cli_compile_then_run_from_the_folder(compiled, tmp_path, with_store, capsys) -> None:
    from nxdplug.cli.main import main

    checkpoint, _ = compiled
    options = ["--torch-dtype", "float32", "--batch-size", "2", "--seq-len", "64"]
    options += ["--max-context-length", "16"]
    folder = tmp_path / "cli"
    assert (
        main(
            [
                "compile",
                "--model-path",
                str(checkpoint),
                "--compiled-model-path",
                str(folder),
                "--quiet",
                *options,
            ]
        )
        == 0
    )
    code = main(
        [
            "run",
            "--model-path",
            str(checkpoint),
            "--compiled-model-path",
            str(folder),
            "--prompt",
            "def f(x):",
            "--prompt",
            "import os",
            "--max-new-tokens",
            "8",
            "--check-accuracy-mode",
            "token-matching",
            "--quiet",
            *options,
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "inductor backend" in out and "token matching: PASS" in out


def test_frozen_weights_generate_the_eager_tokens_and_refuse_swaps(
    compiled, tmp_path, with_store, store
) -> None:
    """freezing=true folds the weights into each graph: no weights/ folder, no store entry,
    the eager tokens, and load_weights / shard_weights refuse rather than do nothing."""
    checkpoint, _ = compiled
    folder = tmp_path / "frozen"
    entries_before = set(store.iterdir())
    app = app_for(checkpoint)
    app.compiler_args = "freezing=true"
    app.compile(folder, quiet=True)
    manifest = Manifest.read(folder)
    assert manifest.weights_in_graphs and manifest.weights == ()
    assert not (folder / "weights").exists()
    assert set(store.iterdir()) == entries_before
    app.load(folder, quiet=True)
    assert app.context_encoding_model.model.weights == []
    eager = app_for(checkpoint)
    eager.to_cpu()
    assert torch.equal(generate(app), generate(eager))
    with pytest.raises(NotSupportedError, match="frozen into its graphs"):
        app.load_weights(folder)
    with pytest.raises(NotSupportedError, match="frozen into its graphs"):
        app.shard_weights(folder)


def test_compiler_args_are_part_of_the_config_hash(compiled) -> None:
    checkpoint, folder = compiled
    app = app_for(checkpoint)
    app.compiler_args = "freezing=true"
    with pytest.raises(ArtefactError, match="compiled for a different configuration"):
        app.load(folder, quiet=True)


def test_bad_compiler_args_are_a_config_error(compiled, tmp_path) -> None:
    from nxdplug.errors import ConfigError

    checkpoint, _ = compiled
    app = app_for(checkpoint)
    app.compiler_args = "freezing"
    with pytest.raises(ConfigError, match="not KEY=VALUE"):
        app.compile(tmp_path / "bad", quiet=True)


def test_sampling_settings_fed_as_inputs_do_not_shape_the_graphs() -> None:
    from nxdplug.compile.artefacts import graph_shaping_config

    def config(**sampling):
        return {"neuron_config": {"batch_size": 1, "on_device_sampling_config": sampling}}

    base = graph_shaping_config(config(do_sample=True, top_k=5, temperature=0.7, global_topk=64))
    other = graph_shaping_config(config(do_sample=True, top_k=9, temperature=1.3, global_topk=64))
    assert base == other
    assert base != graph_shaping_config(config(do_sample=True, top_k=5, global_topk=32))
