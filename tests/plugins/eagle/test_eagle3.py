"""EAGLE-3 drafts (``is_eagle3``) in the ``eagle`` plugin.

A random EAGLE-3 head in the published layout (``fc`` over three target layers, ``midlayer``
with 2h-wide attention input, ``norm``, a draft-vocabulary ``lm_head`` and the ``d2t`` map) is
checked two ways: its proposals equal a from-scratch forward written here from the format
(HF's target hidden states, plain PyTorch), and speculation with it, chain or tree, gives the
target's own tokens (greedy: HF's; sampled: the target's distribution).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from nxdplug.contrib_models.llama import NeuronLlamaForCausalLM
from nxdplug.engine import Engine
from nxdplug.errors import CheckpointError, ConfigError
from nxdplug.modules.step import StepInputs
from nxdplug.plugins.eagle.fused import EAGLE_CONTEXT_TAG
from nxdplug.runtime.model_wrapper import FUSED_SPECULATION_MODEL_TAG
from nxdplug.testing import random_prompts
from tests.plugins.eagle.test_eagle import (
    bigram_target,
    eagle_app,
    eagle_config,
    engine_outputs,
    make_eagle_draft,
    plain_app,
    problems_of,
    reference,
    speculate,
)
from tests.shipped_models import PYCODER, PYCODER_EAGLE, PYCODER_EAGLE3, file_start_prompts

TREE = {0: [1, 2, 3], 1: [4, 5], 2: [6], 4: [7]}


def make_eagle3_draft(
    target: Path,
    folder: Path,
    draft_vocab: int,
    seed: int = 0,
    scale: float = 0.05,
    bigram: bool = False,
    aux_layers: list[int] | None = None,
) -> Path:
    """A random EAGLE-3 head for ``target`` in the authors' and ``speculators``' layout: a
    draft vocabulary of ``draft_vocab`` target ids (``d2t`` offsets, ``t2d`` mask), no
    embedding (the target's is used).

    ``bigram``: a head that guesses the near-bigram target's next token (so some drafts are
    accepted): each pair attends mostly to itself and passes its token's normed embedding
    through (q, k, v read the embedding half; one KV head per query head), and scores it
    with the target's final norm and LM head, as the target nearly does.

    ``aux_layers``: the target layers to read, as the config's
    ``eagle_aux_hidden_state_layer_ids`` (else the default three)."""
    config = json.loads((target / "config.json").read_text())
    hidden, inner, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    ids = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors = {
        "fc.weight": rand(hidden, 3 * hidden),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inner, hidden),
        "midlayer.mlp.up_proj.weight": rand(inner, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inner),
        "midlayer.input_layernorm.weight": 1 + rand(hidden),
        "midlayer.hidden_norm.weight": 1 + rand(hidden),
        "midlayer.post_attention_layernorm.weight": 1 + rand(hidden),
        "norm.weight": 1 + rand(hidden),
        "lm_head.weight": rand(draft_vocab, hidden) * 20,
        "d2t": ids - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    if bigram:
        assert heads == kv_heads, "the pass-through needs one KV head per query head"
        target_weights = load_file(target / "model.safetensors")
        through = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
        tensors |= {
            "midlayer.self_attn.q_proj.weight": 4 * through,
            "midlayer.self_attn.k_proj.weight": 4 * through,
            "midlayer.self_attn.v_proj.weight": through,
            "midlayer.self_attn.o_proj.weight": torch.eye(hidden),
            "midlayer.mlp.down_proj.weight": torch.zeros(hidden, inner),
            "midlayer.input_layernorm.weight": torch.ones(hidden),
            "norm.weight": target_weights["model.norm.weight"].clone(),
            "lm_head.weight": target_weights["lm_head.weight"][ids].clone(),
        }
    config |= {
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "draft_vocab_size": draft_vocab,
    }
    if aux_layers is not None:
        config["eagle_aux_hidden_state_layer_ids"] = aux_layers
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "model.safetensors")
    return folder


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("eagle3") / "target"
    return bigram_target(folder, num_hidden_layers=5, num_key_value_heads=4)


@pytest.fixture(scope="module")
def draft(target, tmp_path_factory) -> Path:
    """A random head over 300 of the 512 tokens, for the format's math."""
    return make_eagle3_draft(target, tmp_path_factory.mktemp("eagle3") / "draft", 300, scale=0.3)


@pytest.fixture(scope="module")
def guessing(target, tmp_path_factory) -> Path:
    """A head over most of the vocabulary that guesses right often enough to exercise
    acceptance."""
    return make_eagle3_draft(target, tmp_path_factory.mktemp("eagle3") / "guess", 448, bigram=True)


@pytest.fixture(scope="module")
def chosen_layers(target, tmp_path_factory) -> Path:
    """A random head that names the layers it reads (the embedding, layers 2 and 4's inputs)."""
    folder = tmp_path_factory.mktemp("eagle3") / "chosen"
    return make_eagle3_draft(target, folder, 300, seed=1, scale=0.3, aux_layers=[0, 2, 4])


# --- the draft's math, against a forward written from the format ---


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding (halves rotated) of x [heads, seq, dim] at ``positions``."""
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions.double()[:, None] * inv[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], dim=-1)
    return (x * cos + half * sin).to(x.dtype)


def reference_drafts(target: Path, draft: Path, prompt: list[int], first: int, k: int) -> list[int]:
    """k greedy EAGLE-3 drafts after ``prompt`` and the target's token ``first``: the pairs
    (x_{t+1}, the inputs of the config's target layers, else 2, L//2, L-3, at t) through fc,
    then each draft's own output fed back, every step recomputed over the whole sequence (no
    cache)."""
    config = json.loads((draft / "config.json").read_text())
    weights = load_file(draft / "model.safetensors")
    target_weights = load_file(target / "model.safetensors")
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    layers = hf.config.num_hidden_layers
    read = config.get("eagle_aux_hidden_state_layer_ids") or (2, layers // 2, layers - 3)
    aux = torch.cat([states[i][0] for i in read], dim=-1)
    eps, theta = config["rms_norm_eps"], config.get("rope_theta", 10000.0)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    embed = target_weights["model.embed_tokens.weight"]
    w = {name.removeprefix("midlayer."): tensor for name, tensor in weights.items()}

    def layer(tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        seq = len(tokens)
        x = torch.cat(
            [
                rms(embed[tokens], w["input_layernorm.weight"], eps),
                rms(features, w["hidden_norm.weight"], eps),
            ],
            dim=-1,
        )
        q = (x @ w["self_attn.q_proj.weight"].T).view(seq, heads, -1).transpose(0, 1)
        key = (x @ w["self_attn.k_proj.weight"].T).view(seq, kv_heads, -1).transpose(0, 1)
        value = (x @ w["self_attn.v_proj.weight"].T).view(seq, kv_heads, -1).transpose(0, 1)
        positions = torch.arange(seq)
        q, key = rotate(q, positions, theta), rotate(key, positions, theta)
        key = key.repeat_interleave(heads // kv_heads, dim=0)
        value = value.repeat_interleave(heads // kv_heads, dim=0)
        scores = q @ key.transpose(1, 2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(torch.ones(seq, seq).triu(1).bool(), float("-inf"))
        attended = (scores.softmax(-1) @ value).transpose(0, 1).reshape(seq, -1)
        h = features + attended @ w["self_attn.o_proj.weight"].T
        normed = rms(h, w["post_attention_layernorm.weight"], eps)
        gated = torch.nn.functional.silu(normed @ w["mlp.gate_proj.weight"].T)
        return h + (gated * (normed @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T

    tokens = [*prompt[1:], first]
    features = aux @ weights["fc.weight"].T
    drafts = []
    for _ in range(k):
        out = layer(tokens, features)
        logits = rms(out[-1], weights["norm.weight"], eps) @ weights["lm_head.weight"].T
        draft_id = int(logits.argmax())
        drafts.append(draft_id + int(weights["d2t"][draft_id]))
        tokens.append(drafts[-1])
        features = torch.cat([features, out[-1:]])
    return drafts


@pytest.mark.parametrize("head", ["draft", "chosen_layers"])
def test_proposals_are_the_formats_forward(target, head, request):
    draft = request.getfixturevalue(head)
    app = eagle_app(target, draft, k=3, batch_size=1, is_eagle3=True)
    prompt = random_prompts(512, (9,), seed=2)[0][0].tolist()
    tokens = torch.tensor([prompt])
    mask, positions = torch.ones_like(tokens), torch.arange(len(prompt))[None]
    seq_ids = torch.zeros(1, dtype=torch.long)
    app.reset()
    logits, feature = app.submodel(EAGLE_CONTEXT_TAG)(StepInputs(tokens, mask, positions, seq_ids))
    first = int(logits[0, -1].argmax())
    pending = torch.tensor([[first, 0, 0, 0]])
    features = feature.new_zeros(1, 4, feature.shape[-1])
    features[:, :1] = feature
    step = StepInputs(
        pending,
        torch.ones_like(pending),
        len(prompt) - 1 + torch.arange(4)[None],
        seq_ids,
        {
            "pending_features": features,
            "pending_count": torch.ones(1, dtype=torch.long),
            "draft_noise": torch.zeros(1, 3, 512),
            "inv_temperature": torch.ones(1, 1),
        },
    )
    drafts = app.submodel(FUSED_SPECULATION_MODEL_TAG)(step)[0]
    expected = reference_drafts(target, draft, prompt, first, 3)
    assert drafts[0].tolist() == expected
    assert len(set(expected)) > 1, "the drafts should vary"


# --- losslessness ---


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("lengths", [(7,), (3, 11)], ids=["batch1", "batch2-padded"])
def test_output_is_the_targets(target, draft, guessing, lengths, tree):
    ids, mask = random_prompts(512, lengths, seed=len(lengths))
    expected = reference(target, ids, mask, 24, batch_size=len(lengths))
    assert all(len(set(row.tolist())) > 3 for row in expected[:, ids.shape[1] :])
    options = {"batch_size": len(lengths), "is_eagle3": True}
    if tree is not None:
        options |= {"k": 8, "token_tree_config": tree}
    for head in (draft, guessing):
        app = eagle_app(target, head, **options)
        assert torch.equal(speculate(app, ids, mask, 24), expected)
    stats = app.speculation_stats
    assert stats.accepted > 0 and stats.row_calls < len(lengths) * 23, stats


def test_compiled_tree_matches_eager(target, guessing, tmp_path):
    """The compiled tree graph (the target read at three layers, the draft's fc and 2h-wide
    attention, its vocabulary map, the tree's levels and mask) speculates as the eager one,
    in generate() and in the serving engine. The EAGLE-1 chain's graphs are compiled in
    ``test_eagle.py``; both share the phases' code."""
    ids, mask = random_prompts(512, (4, 10), seed=6)
    options = {"is_eagle3": True, "token_tree_config": TREE, "enable_bucketing": False}
    options["is_continuous_batching"] = True
    eager_app = eagle_app(target, guessing, 8, **options)
    eager = speculate(eager_app, ids, mask, 20)
    assert torch.equal(eager, reference(target, ids, mask, 20))
    NeuronLlamaForCausalLM(target, eagle_config(target, guessing, 8, **options)).compile(
        tmp_path / "compiled", quiet=True
    )
    loaded = NeuronLlamaForCausalLM(target, eagle_config(target, guessing, 8, **options))
    loaded.load(tmp_path / "compiled", quiet=True)
    assert torch.equal(speculate(loaded, ids, mask, 20), eager)
    assert loaded.speculation_stats == eager_app.speculation_stats
    assert loaded.speculation_stats.accepted > 0
    engine = Engine(loaded, eos_token_ids=[], speculative_config={"method": "eagle3"})
    assert engine_outputs(engine, ids, mask, 20) == eager[:, ids.shape[1] :].tolist()
    assert engine.speculation.metrics.accepted_tokens > 0


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_the_engine_serves_eagle3(target, guessing, tree):
    """vLLM's eagle3 method, a chain or a token tree: HF's greedy tokens; the eagle method is
    refused for this head."""
    ids, mask = random_prompts(512, (4, 10), seed=6)
    options = {"is_eagle3": True, "is_continuous_batching": True}
    if tree is not None:
        options |= {"k": 8, "token_tree_config": tree}
    app = eagle_app(target, guessing, **options)
    engine = Engine(app, eos_token_ids=[], speculative_config={"method": "eagle3"})
    plain = speculate(plain_app(target), ids, mask, 20, eos_token_id=None)
    assert engine_outputs(engine, ids, mask, 20) == plain[:, ids.shape[1] :].tolist()
    assert engine.speculation.metrics.accepted_tokens > 0
    with pytest.raises(ConfigError, match="use method 'eagle3'"):
        Engine(app, eos_token_ids=[], speculative_config={"method": "eagle"})


# --- configuration and checkpoints ---


def test_config_and_checkpoint_errors(target, draft, tmp_path):
    assert problems_of(eagle_config(target, draft, is_eagle3=True)) == ""
    shallow = bigram_target(tmp_path / "shallow", num_hidden_layers=3)
    assert "the target has only 3 layers" in problems_of(
        eagle_config(shallow, draft, is_eagle3=True)
    )
    named = make_eagle3_draft(shallow, tmp_path / "named", 300, aux_layers=[0, 1, 2])
    assert problems_of(eagle_config(shallow, named, is_eagle3=True)) == ""
    for wrong in ([0, 1, 3], [1, 2], [0, 1, True]):
        config = json.loads((named / "config.json").read_text())
        config["eagle_aux_hidden_state_layer_ids"] = wrong
        (named / "config.json").write_text(json.dumps(config))
        assert "expected three layer ids from 0 to 2" in problems_of(
            eagle_config(shallow, named, is_eagle3=True)
        )
    alone = eagle_config(target, draft, is_eagle3=True, enable_eagle_speculation=False)
    assert "is_eagle3=True says the fused draft is an EAGLE-3 head" in problems_of(alone)
    weights = load_file(draft / "model.safetensors")
    del weights["d2t"]
    no_map = tmp_path / "no-map"
    no_map.mkdir()
    (no_map / "config.json").write_text((draft / "config.json").read_text())
    save_file(weights, no_map / "model.safetensors")
    with pytest.raises(CheckpointError, match="has no d2t map"):
        eagle_app(target, no_map, is_eagle3=True)
    with pytest.raises(CheckpointError, match=r"is an EAGLE-3 head .* set is_eagle3=True"):
        eagle_app(target, draft)
    eagle1 = make_eagle_draft(target, tmp_path / "eagle1")
    with pytest.raises(CheckpointError, match=r"is an EAGLE-1 head .* set is_eagle3=False"):
        eagle_app(target, eagle1, is_eagle3=True)


# --- the trained head for pycoder-tiny ---

# The issue's goal: EAGLE-3 keeps at least 1.2x EAGLE-1's tokens per target call. Measured when
# the head was shipped (65 minutes of training, layers 1, 3, 5, the whole vocabulary), on the
# shipped bf16-rounded target and EAGLE-1 draft: 3.354 against 2.449 (1.37x).
EAGLE3_OVER_EAGLE1 = 1.2


def test_pycoder_head_is_lossless_and_accepted():
    """The shipped EAGLE-3 head (``examples/train_eagle3.py``) against the EAGLE-1 draft, k=4
    chains, greedy, on the held-out prompts: both lossless, and the head keeps at least 1.2x
    the tokens per target call (``EAGLE3_OVER_EAGLE1``)."""
    prompts = file_start_prompts(20)
    options = {"batch_size": 4, "seq_len": 136, "max_context_length": 64}
    apps = {
        "eagle1": eagle_app(PYCODER, PYCODER_EAGLE, k=4, **options),
        "eagle3": eagle_app(PYCODER, PYCODER_EAGLE3, k=4, is_eagle3=True, **options),
    }
    plain = plain_app(PYCODER, **options)
    per_call = {name: [0, 0] for name in apps}
    for start in range(0, 20, 4):
        ids = torch.tensor(prompts[start : start + 4])
        mask = torch.ones_like(ids)
        expected = speculate(plain, ids, mask, 64, eos_token_id=None)
        for name, app in apps.items():
            assert torch.equal(speculate(app, ids, mask, 64, eos_token_id=None), expected)
            per_call[name][0] += app.speculation_stats.emitted
            per_call[name][1] += app.speculation_stats.row_calls
    eagle1, eagle3 = (emitted / calls for emitted, calls in per_call.values())
    print(f"pycoder-tiny tokens per target call, k=4: EAGLE-1 {eagle1:.3f}, EAGLE-3 {eagle3:.3f}")
    assert eagle3 >= EAGLE3_OVER_EAGLE1 * eagle1


def test_the_benchmarks_baseline_drops_the_draft_settings():
    """``nxdplug benchmark`` compares with the same target without speculation."""
    from nxdplug import NeuronConfig
    from nxdplug.cli.speculation import without_speculation

    speculating = NeuronConfig(
        enable_eagle_speculation=True,
        is_eagle3=True,
        speculation_length=8,
        token_tree_config=TREE,
        trace_tokengen_model=False,
    )
    plain = without_speculation(speculating)
    assert not (plain.enable_eagle_speculation or plain.is_eagle3 or plain.enable_token_tree)
    assert plain.token_tree_config is None and plain.trace_tokengen_model
