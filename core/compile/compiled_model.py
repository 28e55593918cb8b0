"""compile(), load(), load_weights() and shard_weights() of an application.

Compiling exports every sub-model and bucket as a pure function of (weights, caches, inputs)
and has the backend turn each into an artefact. Compiling needs shapes only: the graphs are
traced on uninitialized weights, and the checkpoint is read just to write ``weights/``. Loading
checks the folder against the config it is given, loads the graphs, and hands every graph the
same weights and the same KV cache.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import torch
from torch import nn
from tqdm import tqdm

from nxdplug import __version__
from nxdplug.checkpoint.atomic_folders import save_text_atomically, staged_folder, writer_lock
from nxdplug.checkpoint.huge_pages import move_to_huge_pages
from nxdplug.checkpoint.state_dict import (
    check_state_dict,
    dtype_keeping_names,
    is_castable,
    load_tensor_file,
    save_state_dict,
)
from nxdplug.compile.artefacts import (
    CONFIG_FILE,
    GRAPHS,
    MANIFEST,
    WEIGHTS,
    ArtefactError,
    GraphEntry,
    Manifest,
    config_hash,
    differing_fields,
    fetch_graphs,
    file_digest,
    graph_shaping_config,
    publish_graphs,
    store_folder,
    verify_files,
)
from nxdplug.compile.backend import Backend, choose_backend, instantiate, weights_former
from nxdplug.compile.graph_function import GraphFunction
from nxdplug.errors import NotSupportedError
from nxdplug.manager import get_plugin_manager
from nxdplug.modules.kv_cache import kv_cache_managers
from nxdplug.modules.parallel_linear import tp_rank, tp_world_size
from nxdplug.modules.step import StepInputs
from nxdplug.modules.tensor_parallel import (
    is_first_rank,
    shared_by_first_rank,
    this_ranks_shard,
    wait_for_all_ranks,
)
from nxdplug.pipeline import validate
from nxdplug.registry import get_registry

if TYPE_CHECKING:
    from nxdplug.config import InferenceConfig
    from nxdplug.runtime.application import NeuronApplicationBase
    from nxdplug.runtime.model_wrapper import ModelWrapper
    from nxdplug.types import CompileBackend


def weights_file(rank: int) -> str:
    """Where rank ``rank``'s weights go in a compiled folder."""
    return f"{WEIGHTS}/rank{rank}.safetensors"


class CompiledSubModel:
    """Stands in for the model of a ModelWrapper: runs the compiled graph of the bucket."""

    def __init__(
        self,
        graphs: dict[int, Callable[..., torch.Tensor]],
        weights: list[torch.Tensor],
        caches: list[torch.Tensor],
        model: nn.Module,
        extra_input_names: tuple[str, ...],
        weight_names: list[str],
        form_weights: Callable[[list[torch.Tensor]], set[int]],
    ) -> None:
        """``model``: the skeleton, whose KV-cache buffers are ``caches``;
        ``extra_input_names``: the plugins' step inputs, in the order the graphs take them;
        ``weight_names``: the parameter name of each of ``weights`` (none when the weights are
        frozen into the graphs); ``form_weights``: the backend's conversion of stored weights
        into the graphs' form (see :func:`weights_former`), for weights swapped in later."""
        self.graphs = graphs
        self.weights = weights
        self.weight_names = weight_names
        self.form_weights = form_weights
        self.caches = caches
        self.kv_mgr = model.kv_mgr
        self.kv_managers = kv_cache_managers(model)
        self.extra_input_names = extra_input_names

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights every graph takes, by parameter name, as nn.Module names them."""
        return zip(self.weight_names, self.weights, strict=True)

    def __call__(self, step: StepInputs) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The graph of the bucket the attention mask's width names, run on ``step``."""
        graph = self.graphs[step.attention_mask.shape[-1]]
        inputs = step.flatten(self.extra_input_names)
        return graph(self.weights, self.caches, *(t.contiguous() for t in inputs))


@attrs.frozen
class Skeleton:
    """The model with its parameters on the meta device: shapes, names and real caches."""

    model: nn.Module
    function: GraphFunction

    @property
    def caches(self) -> list[torch.Tensor]:
        buffers = dict(self.model.named_buffers())
        return [buffers[name] for name in self.function.cache_names]

    def weight_shapes(self, dtype: torch.dtype | None) -> dict[str, tuple[torch.Size, torch.dtype]]:
        params = dict(self.model.named_parameters())
        kept = dtype_keeping_names(self.model)
        result = {}
        for name in self.function.weight_names:
            param = params[name]
            castable = is_castable(param.dtype) and name not in kept
            target = dtype if dtype is not None and castable else param.dtype
            result[name] = (param.shape, target)
        return result


def _weight_dtype(app: NeuronApplicationBase) -> torch.dtype | None:
    neuron_config = app.neuron_config
    return neuron_config.torch_dtype if neuron_config.cast_type == "config" else None


def build_skeleton(app: NeuronApplicationBase) -> Skeleton:
    from nxdplug.modules.meta_init import parameters_on_meta

    with parameters_on_meta():
        model = app.context.build_model()
    model.requires_grad_(False).eval()
    return Skeleton(model, GraphFunction(model))


def _config_for_backend(app: NeuronApplicationBase, backend_name: str) -> InferenceConfig:
    config = copy.deepcopy(app.config)
    config.neuron_config.compile_backend = backend_name
    return config


def _fingerprint(
    app: NeuronApplicationBase, backend_name: str, backend: Backend
) -> tuple[str, dict, dict]:
    """(config hash, versions, plugin versions) of the graphs this app compiles."""
    config = _config_for_backend(app, backend_name)
    manager = get_plugin_manager()
    record = get_registry().get("compile_backends", backend_name)
    selected = app.plugins.with_backend(record).plugins
    plugins = {name: manager.plugin_info(name).version for name in sorted(selected)}
    versions = {"nxdplug": __version__, **backend.versions(config)}
    variant = app.plugins.kv_cache_strategy.load("implementation").graph_variant()
    if variant:  # none: the hash of folders compiled before variants existed
        versions["kv_cache"] = variant
    shaping = graph_shaping_config(config.to_dict())
    extra = {"backend": backend_name, "plugins": plugins, "compiler_args": app.get_compiler_args()}
    if tp_world_size() > 1:  # one process: the hash of folders compiled before ranks existed
        extra["ranks"] = tp_world_size()
    return config_hash(shaping, versions | extra), versions, plugins


def graphs_digest(app: NeuronApplicationBase) -> tuple[str, bool]:
    """The config hash of the graphs compile() would make for ``app`` (with the backend it
    would choose; NotSupportedError where none writes artefacts), and whether they hold the
    weights."""
    record, backend = choose_backend(app.neuron_config)
    digest, _, _ = _fingerprint(app, record.name, backend)
    return digest, backend.embeds_weights(app.get_compiler_args())


def _files_of_this_rank(manifest: Manifest) -> Manifest:
    """``manifest`` listing only the files this rank reads (all of them with one rank), so
    that no rank reads another's graphs and weights to check them."""
    rank = tp_rank()
    others = {g.file for g in manifest.graphs if g.rank != rank}
    others |= {w for w in manifest.weights if w != weights_file(rank)}
    files = {name: digest for name, digest in manifest.files.items() if name not in others}
    return attrs.evolve(manifest, files=files)


def _reusable(folder: Path, digest: str, needs_weights: bool) -> bool:
    try:
        manifest = Manifest.read(folder)
        verify_files(folder, manifest)  # all files: every rank must reach the same answer
    except ArtefactError:
        return False
    return manifest.config_hash == digest and (bool(manifest.weights) or not needs_weights)


def _say(message: str, quiet: bool) -> None:
    if not quiet and is_first_rank():
        tqdm.write(f"nxdplug: {message}", file=sys.stderr)


def _graph_file(tag: str, bucket: int, suffix: str, rank: int, ranks: int) -> str:
    rank_part = f".rank{rank}" if ranks > 1 else ""
    return f"{GRAPHS}/{tag}-{bucket}{rank_part}{suffix}"


def _graph_plan(
    app: NeuronApplicationBase, suffix: str
) -> Iterator[tuple[ModelWrapper, int, StepInputs, str]]:
    """This rank's graphs: (wrapper, bucket, example inputs, file)."""
    for wrapper in app.models:
        for bucket, example in zip(wrapper.buckets, wrapper.input_generator(), strict=True):
            file = _graph_file(wrapper.tag, bucket, suffix, tp_rank(), tp_world_size())
            yield wrapper, bucket, example, file


def _graph_entries(app: NeuronApplicationBase, suffix: str) -> tuple[GraphEntry, ...]:
    """The graphs of every rank, as the manifest lists them."""
    ranks = tp_world_size()
    return tuple(
        GraphEntry(wrapper.tag, bucket, _graph_file(wrapper.tag, bucket, suffix, rank, ranks), rank)
        for rank in range(ranks)
        for wrapper in app.models
        for bucket in wrapper.buckets
    )


@contextmanager
def _staged_folder_of_all_ranks(destination: Path) -> Iterator[Path]:
    """A staged folder (see ``staged_folder``) that every rank writes into: the first rank
    makes it and renames it into place; the others get its name and wait for the rename."""
    if not is_first_rank():
        yield Path(shared_by_first_rank(None))
        wait_for_all_ranks()
        return
    with staged_folder(destination) as staging:
        (staging / GRAPHS).mkdir()
        shared_by_first_rank(str(staging))
        yield staging
    wait_for_all_ranks()


def _phase_function(skeleton: Skeleton, wrapper: ModelWrapper) -> GraphFunction:
    phase = wrapper.phase_module(skeleton.model)
    return GraphFunction(skeleton.model, phase, wrapper.extra_input_names, wrapper.phase)


def compile_application(
    app: NeuronApplicationBase, path: Path, *, debug: bool = False, quiet: bool = False
) -> None:
    """Compile ``app`` into ``path``, or reuse what it holds. Once the config is checked, a
    single process holds the folder's writer lock, so that servers started at once on an
    empty cache compile it once and load one complete folder (the ranks of a tensor-parallel
    group, which compile together, do not lock)."""
    record, backend = choose_backend(app.neuron_config)
    config = _config_for_backend(app, record.name)
    validate(config, source=f"compile with the {record.name!r} backend")
    with writer_lock(path) if tp_world_size() == 1 else nullcontext():
        _reuse_or_compile(app, path, record, backend, config, debug=debug, quiet=quiet)


def _reuse_or_compile(
    app: NeuronApplicationBase,
    path: Path,
    record: CompileBackend,
    backend: Backend,
    config: InferenceConfig,
    *,
    debug: bool,
    quiet: bool,
) -> None:
    """What :func:`compile_application` does once the config is checked (and locked)."""
    digest, versions, plugins = _fingerprint(app, record.name, backend)
    compiler_args = app.get_compiler_args()
    frozen = backend.embeds_weights(compiler_args)
    save_weights = bool(app.neuron_config.save_sharded_checkpoint) and not frozen
    if _reusable(path, digest, save_weights):
        _say(f"{path} already holds these graphs (config hash {digest[:12]}); reusing it", quiet)
        app.is_compiled = True
        return

    # A missing checkpoint is reported before the graphs are compiled, not after them
    # (skip_sharding may copy the weights of the folder instead: it is read only then).
    if save_weights and not app.neuron_config.skip_sharding:
        app.weights_source(app.model_path, app.config)
    skeleton = build_skeleton(app)
    shapes = skeleton.weight_shapes(_weight_dtype(app))
    if frozen:  # the graphs hold the weights: trace on the real ones
        real = checkpoint_weights(app, skeleton)
        example_weights = [real[name] for name in shapes]
    else:  # the graphs take the weights as inputs: shapes are all tracing needs
        example_weights = [torch.empty(shape, dtype=dtype) for shape, dtype in shapes.values()]
    # Graphs holding weights are not shared: the store is keyed by config, not by checkpoint.
    # Neither are those of several ranks (each rank would have to fetch its own).
    store = None if frozen or tp_world_size() > 1 else store_folder()
    started = time.perf_counter()
    with _staged_folder_of_all_ranks(path) as staging:
        from_store = store is not None and fetch_graphs(store, digest, staging)
        if from_store:
            _say(f"graphs for config hash {digest[:12]} found in the store {store}", quiet)
        plan = list(_graph_plan(app, backend.artefact_suffix))
        for wrapper, _, example, relative in tqdm(
            plan,
            desc=f"compiling ({record.name})",
            unit="graph",
            disable=quiet or from_store or not is_first_rank(),
        ):
            if not from_store:
                backend.compile_graph(
                    _phase_function(skeleton, wrapper),
                    (example_weights, skeleton.caches, *example.flatten(wrapper.extra_input_names)),
                    staging / relative,
                    debug=debug,
                    compiler_args=compiler_args,
                )
        if save_weights:
            _write_weights(app, path, staging, skeleton)
        wait_for_all_ranks()  # every rank's files are in place
        if is_first_rank():
            entries = _graph_entries(app, backend.artefact_suffix)
            weights = tuple(weights_file(r) for r in range(tp_world_size())) if save_weights else ()
            config.save(staging)
            files = {
                str(p.relative_to(staging)): file_digest(p)
                for p in sorted(staging.rglob("*"))
                if p.is_file()
            }
            manifest = Manifest(
                digest,
                record.name,
                versions,
                plugins,
                entries,
                weights,
                files,
                frozen,
                tp_world_size(),
            )
            save_text_atomically(staging / MANIFEST, manifest.to_json())
        if store is not None and not from_store:
            publish_graphs(store, digest, staging / GRAPHS)
    seconds = time.perf_counter() - started
    _say(f"compiled {len(plan)} graph(s) into {path} in {seconds:.1f} s", quiet)
    app.is_compiled = True


def _write_weights(
    app: NeuronApplicationBase, previous: Path, staging: Path, skeleton: Skeleton
) -> None:
    """This rank's weights; with skip_sharding, those already in ``previous``."""
    relative = weights_file(tp_rank())
    existing, target = previous / relative, staging / relative
    target.parent.mkdir(exist_ok=True)
    if app.neuron_config.skip_sharding and existing.is_file():
        shutil.copyfile(existing, target)
    else:
        save_state_dict(checkpoint_weights(app, skeleton), target)


def checkpoint_weights(app: NeuronApplicationBase, skeleton: Skeleton) -> dict[str, torch.Tensor]:
    """The HF checkpoint converted to this rank's graph weights, checked against their shapes."""
    shapes = skeleton.weight_shapes(_weight_dtype(app))
    state_dict = this_ranks_shard(skeleton.model, app.get_state_dict(app.model_path, app.config))
    expected = {name: tuple(shape) for name, (shape, _) in shapes.items()}
    tied = {k: v for k, v in state_dict.items() if k in expected}
    check_state_dict(tied, expected, source=app.model_path)
    return {name: tied[name].to(dtype) for name, (_, dtype) in shapes.items()}


def load_application(app: NeuronApplicationBase, path: Path, *, quiet: bool = False) -> None:
    manifest = Manifest.read(path)
    verify_files(path, _files_of_this_rank(manifest))
    record = get_registry().get("compile_backends", manifest.backend)
    backend = instantiate(record)
    reason = backend.unavailable_reason()
    if reason is not None:
        raise NotSupportedError(f"{path} was compiled for {manifest.backend!r}: {reason}")
    _check_fingerprint(app, path, manifest, backend)
    app.context.run_on(record)

    skeleton = build_skeleton(app)
    weights = []
    if not manifest.weights_in_graphs:
        weights_by_name = _stored_weights(app, path, manifest, skeleton)
        weights = [weights_by_name.pop(name) for name in skeleton.function.weight_names]
    caches = skeleton.caches
    loaded: dict[str, dict[int, Callable]] = {}
    mine = [entry for entry in manifest.graphs if entry.rank == tp_rank()]
    for entry in tqdm(mine, desc="loading", unit="graph", disable=quiet or not is_first_rank()):
        graph = backend.load_graph(path / entry.file, weights_in_graph=manifest.weights_in_graphs)
        loaded.setdefault(entry.tag, {})[entry.bucket] = graph
    form_weights = weights_former(backend)
    form_weights(weights)
    move_to_huge_pages(weights)
    for wrapper in app.models:
        if wrapper.tag not in loaded:
            raise ArtefactError(f"{path} has no graphs for {wrapper.tag}; compile again")
        wrapper.model = CompiledSubModel(
            loaded[wrapper.tag],
            weights,
            caches,
            skeleton.model,
            wrapper.extra_input_names,
            skeleton.function.weight_names if weights else [],
            form_weights,
        )
        wrapper.fixed_widths = True
    if not app.neuron_config.skip_warmup:
        warm_up(app)
    app.is_loaded_to_neuron = True
    app.backend_name = manifest.backend
    app.context.bind(app)
    app.reset()


def _check_fingerprint(
    app: NeuronApplicationBase, path: Path, manifest: Manifest, backend: Backend
) -> None:
    digest, versions, plugins = _fingerprint(app, manifest.backend, backend)
    if digest == manifest.config_hash:
        return
    stored = json.loads((path / CONFIG_FILE).read_text())
    current = _config_for_backend(app, manifest.backend).to_dict()
    differences = differing_fields(graph_shaping_config(stored), graph_shaping_config(current))
    differences += differing_fields(
        {"versions": manifest.versions, "plugins": manifest.plugins, "ranks": manifest.ranks},
        {"versions": versions, "plugins": plugins, "ranks": tp_world_size()},
    )
    detail = "; ".join(differences) or "the compiler arguments differ"
    raise ArtefactError(
        f"{path} was compiled for a different configuration ({detail}). Compile again for this "
        "config, or load with the config the folder was compiled with "
        f"(InferenceConfig.load({str(path)!r}))."
    )


def _stored_weights(
    app: NeuronApplicationBase, path: Path, manifest: Manifest, skeleton: Skeleton
) -> dict[str, torch.Tensor]:
    if not manifest.weights:
        return checkpoint_weights(app, skeleton)  # save_sharded_checkpoint=False: shard at load
    file = path / weights_file(tp_rank())
    weights = load_tensor_file(file)
    shapes = skeleton.weight_shapes(_weight_dtype(app))
    check_state_dict(weights, {n: tuple(s) for n, (s, _) in shapes.items()}, str(file))
    return weights


def warm_up(app: NeuronApplicationBase) -> None:
    """Run every graph once on its example inputs, then clear the cache they wrote."""
    for wrapper in app.models:
        for example in wrapper.input_generator():
            wrapper.model(example)
    for manager in app.context_encoding_model.model.kv_managers:
        manager.reset()


def _refuse_frozen(manifest: Manifest, path: Path) -> None:
    if manifest.weights_in_graphs:
        raise NotSupportedError(
            f"the weights of {path} are frozen into its graphs (compiler argument "
            "freezing=true); compile again to change them"
        )


def load_weights(app: NeuronApplicationBase, path: Path) -> None:
    """Swap the weights of a loaded model for those of ``path`` (no recompilation)."""
    manifest = Manifest.read(path)
    verify_files(path, _files_of_this_rank(manifest))
    _refuse_frozen(manifest, path)
    compiled = app.context_encoding_model.model
    if not isinstance(compiled, CompiledSubModel):
        raise NotSupportedError("load_weights() needs a model loaded with load(); call it first")
    skeleton = build_skeleton(app)
    stored = _stored_weights(app, path, manifest, skeleton)
    # Every sub-model holds this one list: a weight in the graphs' own form is replaced, the
    # others are written into, so that references to them stay valid.
    new = [stored.pop(name) for name in skeleton.function.weight_names]
    replaced = compiled.form_weights(new)
    for index, weight in enumerate(new):
        if index in replaced:
            compiled.weights[index] = weight
        else:
            compiled.weights[index].copy_(weight)


def shard_weights(app: NeuronApplicationBase, path: Path) -> None:
    """Write the checkpoint's weights, in the compiled graphs' layout, into the compiled folder
    ``path`` (its manifest is updated to list and hash them)."""
    manifest = Manifest.read(path)
    _refuse_frozen(manifest, path)
    (path / WEIGHTS).mkdir(exist_ok=True)
    save_state_dict(checkpoint_weights(app, build_skeleton(app)), path / weights_file(tp_rank()))
    wait_for_all_ranks()
    if is_first_rank():
        written = tuple(weights_file(r) for r in range(tp_world_size()))
        files = dict(manifest.files) | {f: file_digest(path / f) for f in written}
        updated = attrs.evolve(manifest, weights=written, files=files)
        save_text_atomically(path / MANIFEST, updated.to_json())
    wait_for_all_ranks()
