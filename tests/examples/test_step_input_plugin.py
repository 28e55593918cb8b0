"""A feature that adds a per-row input without touching core: the tutorial's banned tokens.

``docs/write-a-feature-plugin.md`` walks through this plugin. ``ban_tokens=True`` enables it;
``generate(..., banned_token_ids=ids)`` (or ``forward``) gives each row one token it may not
produce (-1: none), and the graph masks that token's logit. HF transformers with a per-row
logits processor doing the same is the oracle.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from transformers import LogitsProcessor, LogitsProcessorList

from nxdplug import HuggingFaceGenerationAdapter, NeuronConfig, from_pretrained, hookimpl
from nxdplug.errors import ConfigError, NotSupportedError
from nxdplug.modules.step import StepInputs
from nxdplug.plugin_api import claim_slot
from nxdplug.testing import temporary_plugin
from nxdplug.types import Feature, StepInput

INPUT = "banned_token_ids"


class BannedTokenInputs:
    """The host side: each step's ``banned_token_ids`` [batch], -1 where a row bans nothing."""

    def __init__(self, config: Any) -> None:
        self.vocab_size = config.vocab_size

    def example(self, batch_size: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {INPUT: torch.full((batch_size,), -1, dtype=torch.long, device=device)}

    def build(self, batch_size: int, keywords: dict, device: torch.device) -> dict:
        ids = keywords.get(INPUT)
        if ids is None:
            return self.example(batch_size, device)
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.shape != (batch_size,) or not ((ids >= -1) & (ids < self.vocab_size)).all():
            raise ValueError(f"{INPUT} must be [{batch_size}] token ids or -1; got {ids}")
        return {INPUT: ids.to(device)}

    def reset(self) -> None:
        """Nothing carries over from one generation to the next."""


class BanThenOutput(nn.Module):
    """The model's output stage, given logits with each row's banned token at -inf."""

    def __init__(self, output_stage: nn.Module) -> None:
        super().__init__()
        self.output_stage = output_stage

    def forward(self, logits: torch.Tensor, step: StepInputs) -> Any:
        banned = step[INPUT]
        vocab = torch.arange(logits.shape[-1], device=logits.device)
        mask = (vocab == banned[:, None])[:, None, :]  # [batch, 1, vocab]; -1 matches nothing
        return self.output_stage(logits.masked_fill(mask, float("-inf")), step)


def ban_in_output(model: nn.Module, context: Any) -> None:
    claim_slot(model, "output_stage", BanThenOutput(model.output_stage), claimant="banned-tokens")


class BannedTokensPlugin:
    NXDPLUG_API_VERSION = 2

    @hookimpl
    def nxdplug_features(self):
        yield Feature(
            name="banned-tokens",
            enabled_by=("ban_tokens",),
            settings={"ban_tokens": False},
            transform_model=f"{__name__}:ban_in_output",
            conflicts_with=("on-device-sampling",),  # it would replace the output stage
        )

    @hookimpl
    def nxdplug_step_inputs(self):
        yield StepInput(
            name="banned-tokens",
            enabled_by=("ban_tokens",),
            builder=f"{__name__}:BannedTokenInputs",
            inputs=(INPUT,),
            keywords=(INPUT,),
        )


class BanPerRow(LogitsProcessor):
    """HF's side of the comparison: the same ban as a logits processor."""

    def __init__(self, banned: torch.Tensor) -> None:
        self.banned = banned

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        rows = (self.banned >= 0).nonzero().squeeze(-1)
        scores = scores.clone()
        scores[rows, self.banned[rows]] = float("-inf")
        return scores


PROMPTS = torch.tensor([[5, 9, 13, 2, 8], [0, 0, 7, 3, 11]])
MASK = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
NEW_TOKENS = 10


@pytest.fixture
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama", initializer_range=0.15)


@pytest.fixture
def plugin(plugin_manager):
    with temporary_plugin(BannedTokensPlugin(), "banned-tokens") as registered:
        yield registered


def make_app(checkpoint, **options):
    config = NeuronConfig(torch_dtype="float32", batch_size=2, seq_len=32, **options)
    app = from_pretrained(checkpoint, config)
    app.to_cpu()
    return app


def generate(app, **kwargs) -> torch.Tensor:
    adapter = HuggingFaceGenerationAdapter(app)
    out = adapter.generate(PROMPTS, attention_mask=MASK, max_new_tokens=NEW_TOKENS, **kwargs)
    return out[:, PROMPTS.shape[1] :]


def hf_generate(checkpoint, banned: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    out = model.generate(
        PROMPTS,
        attention_mask=MASK,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        logits_processor=LogitsProcessorList([BanPerRow(banned)]),
    )
    return out[:, PROMPTS.shape[1] :]


def test_each_row_bans_its_own_token_as_hf_does(plugin, checkpoint) -> None:
    app = make_app(checkpoint, ban_tokens=True)
    plain = generate(app)
    assert len(set(plain[0].tolist())) > 2  # the greedy path varies
    banned = torch.tensor([int(plain[0, 0]), -1])  # row 0 bans its first greedy token
    ours = generate(app, banned_token_ids=banned)
    assert torch.equal(ours, hf_generate(checkpoint, banned))
    assert int(banned[0]) not in ours[0].tolist()
    assert torch.equal(ours[1], plain[1])  # the row that bans nothing is unchanged


def test_the_input_exists_only_when_the_config_enables_it(plugin, checkpoint) -> None:
    app = make_app(checkpoint)
    assert app.context_encoding_model.extra_input_names == ()
    with pytest.raises(NotSupportedError, match="'banned-tokens' step input, enabled by ban"):
        generate(app, banned_token_ids=torch.tensor([3, -1]))
    enabled = make_app(checkpoint, ban_tokens=True)
    assert enabled.token_generation_model.extra_input_names == (INPUT,)


def test_it_refuses_on_device_sampling(plugin, checkpoint) -> None:
    with pytest.raises(ConfigError, match="'banned-tokens' cannot be combined"):
        make_app(checkpoint, ban_tokens=True, on_device_sampling_config={"do_sample": False})


def test_compiled_graphs_take_the_input(plugin, checkpoint, tmp_path) -> None:
    config = NeuronConfig(torch_dtype="float32", batch_size=2, seq_len=32, ban_tokens=True)
    app = from_pretrained(checkpoint, config)
    app.compile(tmp_path / "compiled", quiet=True)
    app.load(tmp_path / "compiled", quiet=True)
    assert app.backend_name == "inductor"
    banned = torch.tensor([-1, int(generate(app)[1, 0])])  # row 1 bans its first greedy token
    assert torch.equal(generate(app, banned_token_ids=banned), hf_generate(checkpoint, banned))
