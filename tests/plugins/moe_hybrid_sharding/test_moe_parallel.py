"""Experts laid out over two gloo ranks: expert parallelism, tensor parallelism within experts,
and hybrid sharding (each phase its own layout), each against HF's greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nxdplug import HuggingFaceGenerationAdapter, from_pretrained
from nxdplug.config import load_pretrained_config
from nxdplug.contrib_models.mixtral.modeling_mixtral import (
    MixtralInferenceConfig,
    MixtralNeuronConfig,
)
from nxdplug.pipeline import config_problems
from nxdplug.testing import end_rank_process
from tests.core.modules.test_tensor_parallel import (
    MASK,
    NEW_TOKENS,
    PROMPTS,
    assert_every_rank_generated,
    become_launched_rank,
    hf_greedy_tokens,
    spawn_two_ranks,
)

pytestmark = pytest.mark.slow

SETTINGS = {
    "torch_dtype": "float32",
    "batch_size": 2,
    "seq_len": 48,
    "max_context_length": 16,
    "tp_degree": 2,
    "enable_bucketing": False,
}
LAYOUTS = {
    "experts-split-over-ranks": {"moe_ep_degree": 2},
    "each-expert-split": {"moe_tp_degree": 2},
    "hybrid-cte-tp-tkg-ep": {
        "hybrid_sharding_config": {
            "moe_cte_tp_degree": 2,
            "moe_cte_ep_degree": 1,
            "moe_tkg_tp_degree": 1,
            "moe_tkg_ep_degree": 2,
        }
    },
    "hybrid-cte-ep-tkg-tp": {
        "hybrid_sharding_config": {
            "moe_cte_tp_degree": 1,
            "moe_cte_ep_degree": 2,
            "moe_tkg_tp_degree": 2,
            "moe_tkg_ep_degree": 1,
        }
    },
}
COMPILED = "hybrid-cte-tp-tkg-ep"


def generate(app) -> torch.Tensor:
    adapter = HuggingFaceGenerationAdapter(app)
    return adapter.generate(
        PROMPTS, attention_mask=MASK, max_new_tokens=NEW_TOKENS, eos_token_id=None
    )


def expert_shapes(app) -> dict[str, list[int]]:
    model = app.context_encoding_model.model
    return {
        name: list(p.shape) for name, p in model.named_parameters() if "layers.0.mlp.expert" in name
    }


def _rank(rank: int, world: int, port: int, checkpoint: str, work: str) -> None:
    become_launched_rank(rank, world, port)
    import torch.distributed as dist

    try:
        for name, layout in LAYOUTS.items():
            app = from_pretrained(checkpoint, MixtralNeuronConfig(**SETTINGS, **layout))
            app.to_cpu()
            torch.save(generate(app), Path(work) / f"{name}-{rank}.pt")
            (Path(work) / f"{name}-{rank}.json").write_text(json.dumps(expert_shapes(app)))
        app = from_pretrained(checkpoint, MixtralNeuronConfig(**SETTINGS, **LAYOUTS[COMPILED]))
        app.compile(Path(work) / "compiled", quiet=True)
        app.load(Path(work) / "compiled", quiet=True)
        torch.save(generate(app), Path(work) / f"compiled-{rank}.pt")
        end_rank_process()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_run(tiny_checkpoint, tmp_path_factory):
    checkpoint = tiny_checkpoint("mixtral", seed=3, num_local_experts=8, num_experts_per_tok=2)
    work = tmp_path_factory.mktemp("moe-parallel")
    spawn_two_ranks(_rank, str(checkpoint), str(work))
    return work, hf_greedy_tokens(checkpoint)


@pytest.mark.parametrize("layout", [*LAYOUTS, "compiled"])
def test_every_rank_generates_hf_greedy_tokens(two_rank_run, layout) -> None:
    work, expected = two_rank_run
    assert_every_rank_generated(work, layout, expected)


# Layer 0's expert weights on one rank: 8 experts, hidden 64, inner 128 (gate and up stacked).
WHOLE = {"gate_up_proj": [8, 256, 64], "down_proj": [8, 64, 128]}
BY_EXPERT = {"gate_up_proj": [4, 256, 64], "down_proj": [4, 64, 128]}
BY_INNER = {"gate_up_proj": [8, 128, 64], "down_proj": [8, 64, 64]}


def named(shapes: dict[str, list[int]], prefix: str) -> dict[str, list[int]]:
    return {f"layers.0.mlp.expert_mlps.{prefix}{k}": v for k, v in shapes.items()}


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        ("experts-split-over-ranks", named(BY_EXPERT, "")),
        ("each-expert-split", named(BY_INNER, "")),
        (
            "hybrid-cte-tp-tkg-ep",
            named(BY_INNER, "context_encoding.") | named(BY_EXPERT, "token_generation."),
        ),
        (
            "hybrid-cte-ep-tkg-tp",
            named(BY_EXPERT, "context_encoding.") | named(BY_INNER, "token_generation."),
        ),
    ],
)
def test_each_rank_holds_its_share_of_the_experts(two_rank_run, layout, expected) -> None:
    work, _ = two_rank_run
    for rank in range(2):
        assert json.loads((work / f"{layout}-{rank}.json").read_text()) == expected


BAD_LAYOUTS = {
    "moe_cte_tp_degree (2) x moe_cte_ep_degree (2) must equal tp_degree (2)": {
        "hybrid_sharding_config": {"moe_cte_tp_degree": 2, "moe_cte_ep_degree": 2}
    },
    "leave moe_tp_degree and moe_ep_degree at 1": {
        "moe_ep_degree": 2,
        "hybrid_sharding_config": {"moe_cte_tp_degree": 2, "moe_tkg_ep_degree": 2},
    },
    "moe_tkg_ep_degree (3) must divide the number of experts (8)": {
        "tp_degree": 3,
        "hybrid_sharding_config": {"moe_cte_tp_degree": 3, "moe_tkg_ep_degree": 3},
    },
}


@pytest.mark.parametrize("expected", sorted(BAD_LAYOUTS))
def test_invalid_degree_combinations_are_refused(tiny_checkpoint, expected) -> None:
    checkpoint = tiny_checkpoint("mixtral", seed=3, num_local_experts=8, num_experts_per_tok=2)
    config = MixtralInferenceConfig(
        MixtralNeuronConfig(**(SETTINGS | BAD_LAYOUTS[expected])),
        load_config=load_pretrained_config(checkpoint),
    )
    problems = config_problems(config)
    assert any(expected in p for p in problems), problems
