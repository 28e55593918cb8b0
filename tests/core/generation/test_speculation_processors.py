"""transformers' logits processors under speculation, as HF's assisted generation runs them.

Every speculation mode (a draft model, prompt lookup, Medusa, EAGLE with a chain or a token
tree) scores each verified
position with the processors over the sequence that position follows. Greedy: the tokens equal
HF transformers' own ``generate()`` with the same settings (``min_new_tokens`` holding back an
end-of-sequence token the target wants early; ``repetition_penalty`` and
``no_repeat_ngram_size``, which read the tokens). Sampling: the speculated positions follow the
processed distribution (chi-square against HF's exact marginals).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from nxdplug import HuggingFaceGenerationAdapter
from nxdplug.errors import NotSupportedError
from nxdplug.testing import (
    chi_square_p_value,
    derived_checkpoint,
    exact_top_k_marginals,
    random_prompts,
)
from tests.plugins.draft_speculation.test_draft_speculation import application, target
from tests.plugins.eagle.test_eagle import bigram_target, eagle_app, make_eagle_draft
from tests.plugins.medusa.test_medusa import heads_like_lm_head, medusa_options, with_heads

NEW = 20
LENGTHS = (4, 9)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A near-bigram model (so an EAGLE draft made for it is often right), heads for Medusa."""
    root = tmp_path_factory.mktemp("processors")
    model = bigram_target(root / "target")
    return with_heads(root / "with_heads", model, heads_like_lm_head(model, 4, 0.5, 0))


@pytest.fixture(scope="module")
def hf(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(512, LENGTHS, seed=4)


def hf_generate(hf, prompts, **settings) -> torch.Tensor:
    input_ids, mask = prompts
    with torch.inference_mode():
        return hf.generate(
            input_ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=NEW,
            pad_token_id=0,
            **settings,
        )


@pytest.fixture(scope="module")
def settings(hf, prompts) -> dict[str, dict]:
    """Processor settings that change HF's greedy output of these prompts."""
    plain = hf_generate(hf, prompts, eos_token_id=None)[:, prompts[0].shape[1] :]
    early_eos = int(plain[0, 2])  # row 0 would end after 3 tokens with it as its eos
    assert early_eos not in plain[0, :2].tolist()
    chosen = {
        "min_new_tokens": {"eos_token_id": early_eos, "min_new_tokens": 12},
        "penalties": {"repetition_penalty": 1.6, "no_repeat_ngram_size": 2, "eos_token_id": None},
    }
    for name, options in chosen.items():
        processed = hf_generate(hf, prompts, **options)
        without = {k: v for k, v in options.items() if k == "eos_token_id"}
        assert not torch.equal(processed, hf_generate(hf, prompts, **without)), name
    return chosen


def speculators(checkpoint: Path, root: Path) -> dict:
    batch = len(LENGTHS)
    speculating = target(checkpoint, batch=batch, k=3)
    medusa_tree = [[0], [1], [2], [3], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    eagle_draft = make_eagle_draft(checkpoint, root / "eagle")
    token_tree = {0: [1, 2, 3], 1: [4, 5], 2: [6], 4: [7]}
    return {
        "draft": (speculating, {"assistant_model": application(checkpoint, batch=batch)}),
        "prompt-lookup": (speculating, {"prompt_lookup_num_tokens": 2}),
        "medusa": (application(checkpoint, batch=batch, **medusa_options(medusa_tree)), {}),
        "eagle": (eagle_app(checkpoint, eagle_draft, batch_size=batch), {}),
        "eagle-tree": (
            eagle_app(checkpoint, eagle_draft, 8, batch_size=batch, token_tree_config=token_tree),
            {},
        ),
    }


@pytest.fixture(scope="module")
def apps(checkpoint, tmp_path_factory):
    return speculators(checkpoint, tmp_path_factory.mktemp("speculators"))


@pytest.mark.parametrize("mode", ["draft", "prompt-lookup", "medusa", "eagle", "eagle-tree"])
@pytest.mark.parametrize("name", ["min_new_tokens", "penalties"])
def test_greedy_speculation_with_processors_is_hf_generate(hf, prompts, settings, apps, mode, name):
    app, source = apps[mode]
    expected = hf_generate(hf, prompts, **settings[name])
    input_ids, mask = prompts
    actual = HuggingFaceGenerationAdapter(app).generate(
        input_ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=NEW,
        pad_token_id=0,
        **settings[name],
        **source,
    )
    assert torch.equal(actual, expected)
    if mode != "prompt-lookup":
        assert app.speculation_stats.accepted > 0, "no proposal was accepted: nothing verified"


def test_sampled_speculation_follows_the_processed_distribution(tmp_path, tiny_checkpoint):
    """A draft model and top-k sampling, with a repetition penalty and an end-of-sequence
    token held back by min_new_tokens: each speculated position is drawn from HF's processed
    distribution at that position."""
    rows, calls, top_k, steps = 64, 40, 4, 3
    main = tiny_checkpoint("llama", seed=5, num_hidden_layers=3, initializer_range=0.3)
    draft_path = derived_checkpoint(main, tmp_path / "draft", num_layers=2)
    speculating = target(main, batch=rows, k=2, seq_len=32)
    draft = application(draft_path, batch=rows, seq_len=32)
    prompt = torch.tensor([3, 9, 4, 17, 5])
    eos = int(exact_top_k_marginals(main, prompt, 1, top_k)[0].argmax())  # the likeliest
    processors = LogitsProcessorList(
        [
            RepetitionPenaltyLogitsProcessor(1.5),
            MinNewTokensLengthLogitsProcessor(len(prompt), steps, torch.tensor([eos])),
        ]
    )
    adapter = HuggingFaceGenerationAdapter(speculating)
    torch.manual_seed(0)
    vocab = speculating.config.vocab_size
    counts = torch.zeros(steps, vocab, dtype=torch.long)
    accepted = drafted = 0
    for _ in range(calls):
        out = adapter.generate(
            prompt.expand(rows, -1),
            do_sample=True,
            top_k=top_k,
            max_new_tokens=steps,
            min_new_tokens=steps,
            repetition_penalty=1.5,
            eos_token_id=eos,
            assistant_model=draft,
        )
        for position in range(steps):
            counts[position] += torch.bincount(out[:, len(prompt) + position], minlength=vocab)
        accepted += speculating.speculation_stats.accepted
        drafted += speculating.speculation_stats.drafted
    assert 0 < accepted < drafted, "both acceptance and rejection must happen"
    assert counts[:, eos].sum() == 0
    expected = exact_top_k_marginals(main, prompt, steps, top_k, processors)
    for position, marginal in enumerate(expected):
        assert chi_square_p_value(counts[position], marginal) > 1e-3, position
    unprocessed = exact_top_k_marginals(main, prompt, steps, top_k)
    assert chi_square_p_value(counts[1], unprocessed[1]) < 1e-3


def test_what_cannot_be_exact_is_refused(apps, prompts) -> None:
    """A prefix_allowed_tokens_fn is told each row's index; verified positions are processed
    one row at a time, so it is refused with more than one row."""
    app, source = apps["draft"]
    input_ids, mask = prompts
    with pytest.raises(NotSupportedError, match="PrefixConstrainedLogitsProcessor with 2 rows"):
        HuggingFaceGenerationAdapter(app).generate(
            input_ids,
            attention_mask=mask,
            max_new_tokens=4,
            prefix_allowed_tokens_fn=lambda batch_id, ids: [1, 2, 3],
            **source,
        )
