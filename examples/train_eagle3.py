"""Train an EAGLE-3 draft head for pycoder-tiny on this machine's CPU.

The corpus is the one pycoder-tiny was trained on (``../shared/models/README.md``): the Python
standard library's source without its ``test``, ``tests`` and ``idle_test`` folders and
without the held-out files listed in ``heldout_files.txt``, each file preceded by token 0.

The head is EAGLE-3's (as :mod:`nxdplug.plugins.eagle.draft3` runs it): ``fc`` over the inputs
of three target layers (``--aux-layers``, written to the config as vLLM's
``eagle_aux_hidden_state_layer_ids``; by default 2, L//2 and L-3), one layer whose attention
reads the token's normed embedding beside the normed feature, a final norm and an LM head over
the ``--draft-vocab`` most frequent tokens of the corpus (by default the whole vocabulary;
``d2t`` maps them to target ids). Training is EAGLE-3's "training-time test": step 0 drafts
from the target's features at every position; step j drafts from step j-1's own outputs, each
position attending to the real pairs before it and to its own earlier steps, so later draft
steps are trained on the features they will see. The loss at each step is the cross-entropy
against the frozen target's next-token distribution (restricted to the draft vocabulary),
weighted 0.8^j. The head runs under bf16 autocast (float32 weights) unless ``--float32``.

The shipped head (``examples/models/pycoder-tiny-eagle3``):

    python examples/train_eagle3.py --target ../shared/models/pycoder-tiny \\
        --output examples/models/pycoder-tiny-eagle3 --minutes 65 \\
        --steps-unrolled 4 --aux-layers 1 3 5

Writes ``config.json``, ``model.safetensors`` (bf16 weights, int64 ``d2t``, bool ``t2d``; no
embedding, as published heads) and ``training.json`` (settings and the validation history).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sysconfig
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

SKIPPED_FOLDERS = {"test", "tests", "idle_test", "site-packages"}


def corpus_files(stdlib: Path, heldout: set[str]) -> tuple[list[Path], list[Path]]:
    """The training and held-out ``.py`` files, by relative path."""
    train, held = [], []
    for path in sorted(stdlib.rglob("*.py")):
        relative = path.relative_to(stdlib)
        if SKIPPED_FOLDERS & set(relative.parts[:-1]):
            continue
        (held if relative.as_posix() in heldout else train).append(path)
    return train, held


def token_stream(files: list[Path], tokenizer: AutoTokenizer) -> torch.Tensor:
    ids: list[int] = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        ids += [0, *tokenizer(text)["input_ids"]]
    return torch.tensor(ids)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding of x [batch, heads, seq, dim] at ``positions`` [seq]."""
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    angles = positions.float()[:, None] * inv[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], dim=-1)
    return x * cos + half * sin


class Eagle3Head(nn.Module):
    """The head's parameters under their published names, and the training-time-test forward."""

    def __init__(self, config: dict, draft_vocab: int) -> None:
        super().__init__()
        hidden, inner = config["hidden_size"], config["intermediate_size"]
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = hidden // self.heads
        self.eps, self.theta = config["rms_norm_eps"], float(config.get("rope_theta", 10000.0))
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.q_proj = nn.Linear(2 * hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.input_norm = nn.Parameter(torch.ones(hidden))
        self.hidden_norm = nn.Parameter(torch.ones(hidden))
        self.post_norm = nn.Parameter(torch.ones(hidden))
        self.norm = nn.Parameter(torch.ones(hidden))
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        batch, seq, _ = x.shape
        return x.view(batch, seq, heads, self.head_dim).transpose(1, 2)

    def unrolled(self, embeds: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Draft logits [batch, seq, draft_vocab] of each step j: at index c, the draft of
        position c+j from the pairs (x_{t+1}, g_t), t <= c, and its own steps 1..j.
        ``embeds`` [batch, seq + steps, hidden] are the tokens' embeddings from x_1 on."""
        batch, seq, _ = aux.shape
        group = self.heads // self.kv_heads
        positions = torch.arange(seq)
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        feature = self.fc(aux)
        keys, values, outputs = [], [], []
        for step in range(steps):
            x = torch.cat(
                [
                    rms_norm(embeds[:, step : step + seq], self.input_norm, self.eps),
                    rms_norm(feature, self.hidden_norm, self.eps),
                ],
                dim=-1,
            )
            q = rotary(self._split(self.q_proj(x), self.heads), positions + step, self.theta)
            k = rotary(self._split(self.k_proj(x), self.kv_heads), positions + step, self.theta)
            v = self._split(self.v_proj(x), self.kv_heads)
            keys.append(k.repeat_interleave(group, dim=1))
            values.append(v.repeat_interleave(group, dim=1))
            scale = 1 / math.sqrt(self.head_dim)
            first = (q @ keys[0].transpose(2, 3)) * scale
            first = first.masked_fill(~causal, float("-inf"))
            own = [(q * key).sum(-1, keepdim=True) * scale for key in keys[1:]]
            weights = torch.cat([first, *own], dim=-1).softmax(dim=-1)
            attended = weights[..., :seq] @ values[0]
            for i, value in enumerate(values[1:]):
                attended = attended + weights[..., seq + i : seq + i + 1] * value
            attended = attended.transpose(1, 2).reshape(batch, seq, -1)
            h = feature + self.o_proj(attended)
            normed = rms_norm(h, self.post_norm, self.eps)
            h = h + self.down_proj(F.silu(self.gate_proj(normed)) * self.up_proj(normed))
            outputs.append(self.lm_head(rms_norm(h, self.norm, self.eps)))
            feature = h
        return outputs

    def published(self, d2t: torch.Tensor, t2d: torch.Tensor) -> dict[str, torch.Tensor]:
        """The weights under the names EAGLE-3 checkpoints use (bf16), with the maps."""
        names = {
            "fc.weight": self.fc.weight,
            "midlayer.self_attn.q_proj.weight": self.q_proj.weight,
            "midlayer.self_attn.k_proj.weight": self.k_proj.weight,
            "midlayer.self_attn.v_proj.weight": self.v_proj.weight,
            "midlayer.self_attn.o_proj.weight": self.o_proj.weight,
            "midlayer.mlp.gate_proj.weight": self.gate_proj.weight,
            "midlayer.mlp.up_proj.weight": self.up_proj.weight,
            "midlayer.mlp.down_proj.weight": self.down_proj.weight,
            "midlayer.input_layernorm.weight": self.input_norm,
            "midlayer.hidden_norm.weight": self.hidden_norm,
            "midlayer.post_attention_layernorm.weight": self.post_norm,
            "norm.weight": self.norm,
            "lm_head.weight": self.lm_head.weight,
        }
        tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in names.items()}
        return tensors | {"d2t": d2t, "t2d": t2d}


def target_batch(
    target: nn.Module, windows: torch.Tensor, layers: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The three layers' inputs [batch, seq, 3h] and the next-token distribution [batch, seq,
    vocab] of the frozen target."""
    with torch.no_grad():
        out = target(windows, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
    return aux, out.logits.softmax(dim=-1)


def step_losses(
    logits: list[torch.Tensor], probs: torch.Tensor, vocab_ids: torch.Tensor
) -> tuple[torch.Tensor, list[float]]:
    """Weighted cross-entropy of each step against the target (restricted to the draft
    vocabulary), and each step's top-1 agreement with the target's argmax."""
    seq = probs.shape[1]
    total, agreement = torch.zeros(()), []
    for step, step_logits in enumerate(logits):
        usable = seq - 1 - step  # position c drafts x_{c+step+2}: the target's row c+step+1
        wanted = probs[:, step + 1 : step + 1 + usable][..., vocab_ids]
        wanted = wanted / wanted.sum(-1, keepdim=True).clamp(min=1e-9)
        log_q = step_logits[:, :usable].log_softmax(dim=-1)
        total = total + 0.8**step * -(wanted * log_q).sum(-1).mean()
        target_top = probs[:, step + 1 : step + 1 + usable].argmax(-1)
        draft_top = vocab_ids[step_logits[:, :usable].argmax(-1)]
        agreement.append(float((target_top == draft_top).float().mean()))
    return total, agreement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--heldout", type=Path, default=None, help="heldout_files.txt")
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument(
        "--draft-vocab", type=int, default=None, help="default: the target's vocabulary"
    )
    parser.add_argument(
        "--aux-layers",
        type=int,
        nargs=3,
        default=None,
        help="the target layers whose inputs the head reads (default: 2, L//2, L-3)",
    )
    parser.add_argument("--steps-unrolled", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--float32",
        action="store_true",
        help="train the head in float32 (default: bf16 autocast, float32 weights; about 1.7x "
        "faster a step on CPUs with AVX512-BF16)",
    )
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)

    heldout_list = args.heldout or args.target.parent / "heldout_files.txt"
    heldout = set(heldout_list.read_text().split())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train_files, held_files = corpus_files(stdlib, heldout)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    train, held = token_stream(train_files, tokenizer), token_stream(held_files, tokenizer)
    print(f"corpus: {len(train_files)} files, {len(train)} tokens; held out {len(held)}")

    config = json.loads((args.target / "config.json").read_text())
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    num_layers = config["num_hidden_layers"]
    layers = tuple(args.aux_layers or (2, num_layers // 2, num_layers - 3))
    draft_vocab = args.draft_vocab or config["vocab_size"]
    embedding = target.get_input_embeddings().weight.detach()

    counts = Counter(train.tolist())
    if draft_vocab >= config["vocab_size"]:
        vocab_ids = torch.arange(config["vocab_size"])
    else:
        vocab_ids = torch.tensor(sorted(t for t, _ in counts.most_common(draft_vocab)))
    d2t = vocab_ids - torch.arange(len(vocab_ids))
    t2d = torch.zeros(config["vocab_size"], dtype=torch.bool)
    t2d[vocab_ids] = True
    covered = sum(counts[t] for t in vocab_ids.tolist()) / len(train)
    print(f"draft vocabulary: {len(vocab_ids)} tokens, {covered:.1%} of the corpus")

    head = Eagle3Head(config, len(vocab_ids))
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight[vocab_ids])
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95))
    span = args.seq + args.steps_unrolled

    def windows(stream: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        return torch.stack([stream[s : s + span] for s in starts.tolist()])

    def batch_loss(rows: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        aux, probs = target_batch(target, rows[:, : args.seq], layers)
        embeds = embedding[rows[:, 1:]]  # x_{t+1} for each step's shift
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.float32):
            logits = head.unrolled(embeds, aux, args.steps_unrolled)
        return step_losses([step.float() for step in logits], probs, vocab_ids)

    generator = torch.Generator().manual_seed(1)
    held_rows = windows(held, torch.arange(0, 48 * args.seq, args.seq))
    history, started, step = [], time.time(), 0
    budget = args.minutes * 60
    total_steps = None
    while True:
        elapsed = time.time() - started
        if total_steps is None and step == 20:
            total_steps = int(20 * budget / elapsed)
            print(f"{elapsed / 20:.2f} s a step: {total_steps} steps")
        if total_steps is not None and step >= total_steps:
            break
        warm = min(1.0, (step + 1) / 100)
        progress = step / total_steps if total_steps else 0.0
        for group in optimizer.param_groups:
            group["lr"] = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        starts = torch.randint(0, len(train) - span, (args.batch,), generator=generator)
        loss, _ = batch_loss(windows(train, starts))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % 200 == 0 or step == total_steps:
            with torch.no_grad():
                val_loss, agreement = batch_loss(held_rows)
            minutes = (time.time() - started) / 60
            history.append(
                {
                    "step": step,
                    "minutes": round(minutes, 2),
                    "val_loss": round(float(val_loss), 4),
                    "val_top1_vs_target_by_step": [round(a, 4) for a in agreement],
                }
            )
            print(history[-1], flush=True)

    args.output.mkdir(parents=True, exist_ok=True)
    draft_config = {
        **config,
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "draft_vocab_size": len(vocab_ids),
        "eagle_aux_hidden_state_layer_ids": list(layers),
        "torch_dtype": "bfloat16",
    }
    (args.output / "config.json").write_text(json.dumps(draft_config, indent=2) + "\n")
    save_file(head.published(d2t, t2d), args.output / "model.safetensors")
    record = {
        "target": args.target.name,
        "corpus_files": len(train_files),
        "corpus_tokens": len(train),
        "corpus_sha256": hashlib.sha256(train.numpy().tobytes()).hexdigest(),
        "draft_vocab": len(vocab_ids),
        "draft_vocab_coverage": round(covered, 4),
        "target_layers_read": list(layers),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "steps": step,
        "wall_minutes": round((time.time() - started) / 60, 2),
        "history": history,
        "torch": torch.__version__,
    }
    (args.output / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
