"""Placement: every tensor the core and the plugins make for a request is made on the
application's device.

There is no GPU here, so a second device is stood in for: each run is repeated with torch's
default device set to ``meta``. A tensor made without saying where (``torch.arange(n)``,
``torch.tensor(rows)``) then lands on ``meta`` and the first operation mixing it with the
model's CPU tensors fails, as a CPU tensor would next to a CUDA model. The second run must
give the first run's tokens. The runs are eager: a compiled model runs the same host code
(bucket padding, step inputs, speculators) around its graphs.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import GenerationConfig

from nxdplug import HuggingFaceGenerationAdapter, NeuronConfig, from_pretrained, hookimpl
from nxdplug.config import LoraServingConfig, OnDeviceSamplingConfig
from nxdplug.engine import Engine, SamplingSettings
from nxdplug.testing import temporary_plugin
from nxdplug.types import CompileBackend
from tests.plugins.eagle.test_eagle import eagle_app, make_eagle_draft
from tests.plugins.lora.test_lora import ADAPTERS, MASK, PROMPTS, ROWS, save_adapters
from tests.plugins.medusa.test_medusa import heads_like_lm_head, medusa_options, with_heads

SETTINGS = {"batch_size": 3, "seq_len": 64, "max_context_length": 16, "torch_dtype": "float32"}
NEW_TOKENS = 10


def same_on_another_default_device(
    run: Callable[[], torch.Tensor | list[list[int]]],
) -> torch.Tensor:
    """``run()`` twice, the second time with ``meta`` as torch's default device; both seeded
    alike. Returns the tokens after checking that both runs gave them."""
    torch.manual_seed(0)
    expected = torch.as_tensor(run())
    torch.manual_seed(0)
    with torch.device("meta"):
        tokens = run()
    tokens = torch.as_tensor(tokens, device="cpu") if isinstance(tokens, list) else tokens
    assert tokens.device == torch.device("cpu")
    assert torch.equal(tokens, expected)
    return tokens


def app_of(checkpoint, **options):
    app = from_pretrained(checkpoint, NeuronConfig(**(SETTINGS | options)))
    app.to_cpu()
    return app


def generate(app, **options) -> torch.Tensor:
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0, **options
    )
    return HuggingFaceGenerationAdapter(app).generate(
        PROMPTS, attention_mask=MASK, generation_config=config
    )


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama", initializer_range=0.15)


@pytest.mark.parametrize(
    "sampling", [{"do_sample": False}, {"do_sample": True, "top_k": 8, "temperature": 0.9}]
)
def test_generate_on_the_host(checkpoint, sampling) -> None:
    app = app_of(checkpoint)
    tokens = same_on_another_default_device(lambda: generate(app, **sampling))
    assert len(set(tokens[:, -NEW_TOKENS:].flatten().tolist())) > NEW_TOKENS


@pytest.mark.parametrize("dynamic", [False, True])
def test_on_device_sampling(checkpoint, dynamic) -> None:
    sampling = OnDeviceSamplingConfig(do_sample=True, top_k=8, dynamic=dynamic)
    app = app_of(checkpoint, on_device_sampling_config=sampling)
    same_on_another_default_device(lambda: generate(app, do_sample=True, top_k=8))


@pytest.mark.parametrize("sampling", [{"do_sample": False}, {"do_sample": True, "top_k": 8}])
def test_draft_model_and_prompt_lookup(checkpoint, tiny_checkpoint, sampling) -> None:
    target = app_of(checkpoint, speculation_length=3, trace_tokengen_model=False)
    draft = app_of(tiny_checkpoint("llama", seed=5, initializer_range=0.15))
    adapter = HuggingFaceGenerationAdapter(target)

    def speculate(**how) -> torch.Tensor:
        return adapter.generate(
            PROMPTS, attention_mask=MASK, max_new_tokens=NEW_TOKENS, pad_token_id=0, **how
        )

    same_on_another_default_device(lambda: speculate(assistant_model=draft, **sampling))
    same_on_another_default_device(lambda: speculate(prompt_lookup_num_tokens=2))


def test_medusa(checkpoint, tmp_path) -> None:
    heads = heads_like_lm_head(checkpoint, 4, 0.5, 0)
    folder = with_heads(tmp_path / "medusa", checkpoint, heads)
    app = app_of(folder, **medusa_options([[0], [1], [0, 0], [0, 0, 0]]))
    same_on_another_default_device(lambda: generate(app))


@pytest.mark.parametrize("sampling", [{"do_sample": False}, {"do_sample": True, "top_k": 8}])
def test_eagle(checkpoint, tmp_path, sampling) -> None:
    draft = make_eagle_draft(checkpoint, tmp_path / "draft")
    app = eagle_app(checkpoint, draft, batch_size=3)
    same_on_another_default_device(lambda: generate(app, **sampling))


def test_lora_adapter_ids(checkpoint, tmp_path) -> None:
    paths = save_adapters(checkpoint, tmp_path, ADAPTERS)
    lora = LoraServingConfig(max_loras=2, max_lora_rank=8, lora_ckpt_paths=paths)
    app = app_of(checkpoint, lora_config=lora)
    adapter = HuggingFaceGenerationAdapter(app)
    same_on_another_default_device(
        lambda: adapter.generate(
            PROMPTS, attention_mask=MASK, adapter_ids=ROWS, max_new_tokens=NEW_TOKENS
        )
    )


@pytest.mark.parametrize(
    "options",
    [{}, {"on_device_sampling_config": OnDeviceSamplingConfig(dynamic=True, global_topk=16)}],
    ids=["host", "on-device"],
)
def test_engine(checkpoint, options) -> None:
    app = app_of(checkpoint, is_continuous_batching=True, **options)
    seeded = {} if options else {"seed": 7}

    def serve() -> list[list[int]]:
        engine = Engine(app)
        ids = [
            engine.add_request(
                list(range(5 + row, 10 + 2 * row)),
                SamplingSettings(NEW_TOKENS, 0.8, top_k=8, ignore_eos=True, **seeded),
            )
            for row in range(3)
        ]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        while engine.has_unfinished():
            for output in engine.step():
                tokens[output.request_id] += output.token_ids
        return [tokens[i] for i in ids]

    same_on_another_default_device(serve)


def test_to_cpu_runs_on_the_cpu_whatever_backend_is_selected(plugin_manager, checkpoint) -> None:
    class ElsewhereBackend:
        @hookimpl
        def nxdplug_compile_backends(self):
            yield CompileBackend(name="elsewhere", implementation="x.y:Z", device="meta")

    with temporary_plugin(ElsewhereBackend(), "elsewhere-backend"):
        app = app_of(checkpoint, compile_backend="elsewhere")
        assert app.device == torch.device("cpu")  # to_cpu(): the eager backend's device
        app = from_pretrained(checkpoint, NeuronConfig(**SETTINGS, compile_backend="elsewhere"))
        assert app.device == torch.device("meta")  # where compile() and load() would put it
