"""Features over two tensor-parallel ranks (gloo, one process each): the fp8 KV cache and
speculation (a draft model, prompt lookup; Medusa and EAGLE with the trained heads and draft of
pycoder-tiny, so that their branches are accepted as often as in one process).

Each rank's greedy tokens must equal one process's: the fp8 cache's own (it changes the tokens
of this random model, so the unquantized ones are no oracle), HF transformers' greedy tokens for
speculation, which is lossless; Medusa and EAGLE accept as many tokens as in one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nxdplug import HuggingFaceGenerationAdapter, NeuronConfig, from_pretrained
from nxdplug.testing import end_rank_process
from tests.core.modules.test_tensor_parallel import (
    MASK,
    NEW_TOKENS,
    PROMPTS,
    assert_every_rank_generated,
    become_launched_rank,
    generate,
    hf_greedy_tokens,
    spawn_two_ranks,
)
from tests.plugins.eagle.test_eagle import eagle_app
from tests.plugins.medusa.test_medusa import HEADS_FILE as MEDUSA_HEADS
from tests.plugins.medusa.test_medusa import WIDE, load, medusa_options
from tests.shipped_models import PYCODER, PYCODER_EAGLE, PYCODER_MEDUSA, file_start_prompts

pytestmark = pytest.mark.slow

BASE = {"torch_dtype": "float32", "batch_size": 2, "seq_len": 48, "max_context_length": 16}
SPECULATING = {"speculation_length": 3, "trace_tokengen_model": False}


def app_of(checkpoint: str, tp_degree: int, **settings):
    app = from_pretrained(checkpoint, NeuronConfig(**BASE, tp_degree=tp_degree, **settings))
    app.to_cpu()
    return app


def tokens_of(checkpoint: str, case: str, tp_degree: int) -> tuple[torch.Tensor, float | None]:
    """Greedy tokens of PROMPTS with ``case``'s feature, over ``tp_degree`` ranks, and the
    share of speculated tokens accepted (None without speculation)."""
    if case == "fp8":
        return generate(app_of(checkpoint, tp_degree, kv_cache_quant=True)), None
    target = app_of(checkpoint, tp_degree, **SPECULATING)
    how = {"prompt_lookup_num_tokens": 2}
    if case == "draft":  # the target itself as the draft: every speculated token accepted
        how = {"assistant_model": app_of(checkpoint, tp_degree)}
    tokens = HuggingFaceGenerationAdapter(target).generate(
        PROMPTS, attention_mask=MASK, max_new_tokens=NEW_TOKENS, eos_token_id=None, **how
    )
    return tokens, target.speculation_stats.acceptance_rate


CASES = ("fp8", "draft", "prompt-lookup")
TRAINED_CASES = ("medusa", "eagle")
PYCODER_OPTIONS = {"batch_size": 2, "seq_len": 136, "max_context_length": 64}
PYCODER_TOKENS = 32


def pycoder_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """The first two ``file_start`` held-out prompts (64 tokens each)."""
    ids = torch.tensor(file_start_prompts(2))
    return ids, torch.ones_like(ids)


def trained_tokens_of(case: str, tp_degree: int, work: Path) -> tuple[torch.Tensor, float]:
    """pycoder-tiny's greedy tokens with its Medusa heads or EAGLE draft, and the share of
    speculated tokens accepted."""
    if case == "eagle":
        app = eagle_app(PYCODER, PYCODER_EAGLE, k=4, tp_degree=tp_degree, **PYCODER_OPTIONS)
    else:
        app = load(with_medusa_heads(work), tp_degree=tp_degree, **PYCODER_OPTIONS,
                   **medusa_options(WIDE))  # fmt: skip
    ids, mask = pycoder_prompts()
    tokens = HuggingFaceGenerationAdapter(app).generate(
        ids, attention_mask=mask, max_new_tokens=PYCODER_TOKENS, eos_token_id=None
    )
    return tokens, app.speculation_stats.acceptance_rate


def with_medusa_heads(work: Path) -> Path:
    """pycoder-tiny's files and its Medusa heads in one folder (links, made before the ranks
    start)."""
    return work / "pycoder-medusa"


def link_medusa_heads(work: Path) -> None:
    folder = with_medusa_heads(work)
    folder.mkdir()
    for file in [*PYCODER.iterdir(), PYCODER_MEDUSA / MEDUSA_HEADS]:
        (folder / file.name).symlink_to(file)


def _rank(rank: int, world: int, port: int, checkpoint: str, out: str) -> None:
    become_launched_rank(rank, world, port)
    results = {case: tokens_of(checkpoint, case, world) for case in CASES}
    results |= {case: trained_tokens_of(case, world, Path(out)) for case in TRAINED_CASES}
    for case, (tokens, accepted) in results.items():
        torch.save(tokens, Path(out) / f"{case}-{rank}.pt")
        torch.save(accepted, Path(out) / f"{case}-accepted-{rank}.pt")
    end_rank_process()


@pytest.fixture(scope="module")
def two_ranks(tiny_checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    checkpoint = tiny_checkpoint("llama", seed=11)
    work = tmp_path_factory.mktemp("tp2-features")
    link_medusa_heads(work)
    spawn_two_ranks(_rank, str(checkpoint), str(work))
    return checkpoint, work


def test_the_fp8_cache_gives_one_processs_tokens_on_every_rank(two_ranks) -> None:
    checkpoint, work = two_ranks
    expected, _ = tokens_of(str(checkpoint), "fp8", 1)
    assert not torch.equal(expected, hf_greedy_tokens(checkpoint))  # fp8 changes this path
    assert_every_rank_generated(work, "fp8", expected)


@pytest.mark.parametrize("case", ["draft", "prompt-lookup"])
def test_speculation_is_lossless_on_every_rank(two_ranks, case: str) -> None:
    checkpoint, work = two_ranks
    assert_every_rank_generated(work, case, hf_greedy_tokens(checkpoint))
    accepted = [torch.load(work / f"{case}-accepted-{rank}.pt") for rank in range(2)]
    if case == "draft":
        assert accepted == [1.0, 1.0]
    else:  # the lookup drafted, and was right at least once (1 of 111 tokens)
        assert accepted[0] == accepted[1] > 0


@pytest.mark.parametrize("case", TRAINED_CASES)
def test_trained_speculation_is_lossless_and_accepts_as_one_process(two_ranks, case) -> None:
    _, work = two_ranks
    ids, mask = pycoder_prompts()
    plain = HuggingFaceGenerationAdapter(app_of_pycoder()).generate(
        ids, attention_mask=mask, max_new_tokens=PYCODER_TOKENS, eos_token_id=None
    )
    _, accepted = trained_tokens_of(case, 1, work)
    assert accepted > 0.05  # the heads or the draft are right some of the time
    for rank in range(2):
        assert torch.equal(torch.load(work / f"{case}-{rank}.pt"), plain), (case, rank)
        assert torch.load(work / f"{case}-accepted-{rank}.pt") == accepted, (case, rank)


def app_of_pycoder():
    app = from_pretrained(PYCODER, NeuronConfig(torch_dtype="float32", **PYCODER_OPTIONS))
    app.to_cpu()
    return app
