"""A plugin's objects follow the core's protocols, checked when their records are resolved; a
slot the core gives a default is claimed by one plugin at most."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from nxdplug import NeuronConfig, from_pretrained, hookimpl
from nxdplug.compile.backend import weights_former
from nxdplug.config import InferenceConfig, load_pretrained_config
from nxdplug.contracts import with_defaults
from nxdplug.engine.request_inputs import RequestInputs
from nxdplug.engine.requests import RequestError
from nxdplug.engine.runner import StepRunner
from nxdplug.errors import PluginError
from nxdplug.pipeline import PipelineContext, select_plugins
from nxdplug.plugin_api import claim_slot
from nxdplug.registry import get_registry
from nxdplug.testing import temporary_plugin
from nxdplug.types import CompileBackend, Feature, StepInput

KEYWORD = "tag"


class PlainBuilder:
    """The required members only: the engine's questions get the protocol's answers."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def example(self, batch_size: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {"tag_ids": torch.zeros(batch_size, dtype=torch.long, device=device)}

    def build(self, batch_size: int, keywords: Any, device: torch.device) -> dict:
        return self.example(batch_size, device)

    def reset(self) -> None:
        """Nothing to reset."""


class NoBuild:
    def __init__(self, config: Any) -> None: ...

    def example(self, batch_size: int, device: torch.device) -> dict: ...

    def reset(self) -> None: ...


class RowsFitNotCallable(PlainBuilder):
    rows_fit = 2  # meant as "two distinct tags a step"


class TwoTags(PlainBuilder):
    """Answers the engine: tag "bad" is never served; at most two distinct tags a step."""

    def row_problem(self, keyword: str, value: Any) -> str | None:
        return "no such tag" if value == "bad" else None

    def rows_fit(self, keyword: str, values: list[Any]) -> bool:
        return len({v for v in values if v is not None}) <= 2

    def served_names(self) -> dict[str, dict[str, Any]]:
        return {"tagged-a": {KEYWORD: "a"}}


def step_input_plugin(builder: type) -> Any:
    class Plugin:
        NXDPLUG_API_VERSION = 2

        @hookimpl
        def nxdplug_features(self):
            yield Feature(name="tags", enabled_by=("use_tags",), settings={"use_tags": False})

        @hookimpl
        def nxdplug_step_inputs(self):
            yield StepInput(
                name="tag-inputs",
                enabled_by=("use_tags",),
                builder=f"{__name__}:{builder.__name__}",
                inputs=("tag_ids",),
                keywords=(KEYWORD,),
            )

    return Plugin()


def carrying(tag: str) -> Any:
    """What the engine reads of a request here: its step keywords."""
    return SimpleNamespace(step_keywords={KEYWORD: tag})


@pytest.fixture
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


def tagged_context(checkpoint, builder: type) -> PipelineContext:
    config = InferenceConfig(
        NeuronConfig(torch_dtype="float32", batch_size=2, seq_len=32, use_tags=True),
        load_config=load_pretrained_config(checkpoint),
    )
    return PipelineContext(config, select_plugins(config))


@pytest.mark.parametrize(
    ("builder", "problem"),
    [
        (NoBuild, "has no method 'build'"),
        (RowsFitNotCallable, "'rows_fit' is not callable (a int)"),
    ],
)
def test_a_builder_off_its_protocol_is_refused_naming_the_plugin(
    plugin_manager, checkpoint, builder, problem
) -> None:
    with temporary_plugin(step_input_plugin(builder), "tag-plugin"):
        context = tagged_context(checkpoint, builder)
        with pytest.raises(PluginError) as refused:
            context.step_input_builders  # noqa: B018 (resolving the record checks it)
    message = str(refused.value)
    assert "step input 'tag-inputs' of plugin 'tag-plugin'" in message
    assert f"its builder {__name__}:{builder.__name__}" in message
    assert "nxdplug.pipeline:StepInputBuilder" in message
    assert problem in message


def test_listing_records_resolves_none_of_them(plugin_manager) -> None:
    with temporary_plugin(step_input_plugin(NoBuild), "tag-plugin"):
        assert "tag-inputs" in get_registry().names("step_inputs")


def test_a_builder_without_the_optional_members_serves_every_request(
    plugin_manager, checkpoint
) -> None:
    with temporary_plugin(step_input_plugin(PlainBuilder), "tag-plugin"):
        inputs = RequestInputs(tagged_context(checkpoint, PlainBuilder))
    inputs.check({KEYWORD: "bad"})
    assert inputs.fits([carrying(tag) for tag in "abc"], carrying("d"))
    assert inputs.served_names() == {}


def test_a_builders_optional_members_answer_the_engine(plugin_manager, checkpoint) -> None:
    with temporary_plugin(step_input_plugin(TwoTags), "tag-plugin"):
        inputs = RequestInputs(tagged_context(checkpoint, TwoTags))
    with pytest.raises(RequestError, match="no such tag"):
        inputs.check({KEYWORD: "bad"})
    inputs.check({KEYWORD: "a"})
    running = [carrying("a"), carrying("b")]
    assert inputs.fits(running, carrying("a"))
    assert not inputs.fits(running, carrying("c"))
    assert inputs.served_names() == {"tagged-a": {KEYWORD: "a"}}


class FormsNothing:
    name = "forms-nothing"
    form_graph_weights = None  # not a method: refused


class StoresAsIs:
    """No ``form_graph_weights``: the graphs take the weights as stored."""


def backend_plugin(implementation: type) -> Any:
    class Plugin:
        NXDPLUG_API_VERSION = 2

        @hookimpl
        def nxdplug_compile_backends(self):
            yield CompileBackend(name="odd", implementation=f"{__name__}:{implementation.__name__}")

    return Plugin()


def test_a_backend_member_that_is_not_a_method_is_refused(plugin_manager) -> None:
    with temporary_plugin(backend_plugin(FormsNothing), "odd-backend"):
        record = get_registry().get("compile_backends", "odd")
        with pytest.raises(PluginError, match="compile backend 'odd' of plugin 'odd-backend'"):
            record.load("implementation")


def test_a_backend_without_form_graph_weights_keeps_the_stored_weights() -> None:
    weights = [torch.ones(2)]
    assert weights_former(StoresAsIs())(weights) == set()
    assert weights[0].equal(torch.ones(2))


class Owner:
    def __init__(self) -> None:
        self.stage = "core default"


def test_a_slot_keeps_the_core_default_until_claimed() -> None:
    owner = Owner()
    assert owner.stage == "core default"
    claim_slot(owner, "stage", "first", claimant="plugin-a")
    claim_slot(owner, "stage", "first, again", claimant="plugin-a")  # its own: allowed
    assert owner.stage == "first, again"


def test_a_second_claimant_of_a_slot_is_refused_naming_both() -> None:
    owner = Owner()
    claim_slot(owner, "stage", "first", claimant="plugin-a")
    with pytest.raises(PluginError, match=r"'plugin-b' and 'plugin-a' both claim Owner\.stage"):
        claim_slot(owner, "stage", "second", claimant="plugin-b")
    assert owner.stage == "first"
    claim_slot(Owner(), "stage", "another owner's", claimant="plugin-b")


def test_a_slot_the_core_does_not_give_is_refused() -> None:
    with pytest.raises(PluginError, match=r"Owner\.stag, which is not an attribute"):
        claim_slot(Owner(), "stag", "typo", claimant="plugin-a")


def claim_output_stage(name: str) -> Any:
    def claim(model: torch.nn.Module, context: PipelineContext) -> None:
        claim_slot(model, "output_stage", torch.nn.Identity(), claimant=name)

    return claim


first_output_stage = claim_output_stage("first-output")
second_output_stage = claim_output_stage("second-output")


class TwoOutputStages:
    NXDPLUG_API_VERSION = 2

    @hookimpl
    def nxdplug_features(self):
        for name in ("first", "second"):
            yield Feature(
                name=f"{name}-output",
                enabled_by=("two_outputs",),
                settings={"two_outputs": False},
                transform_model=f"{__name__}:{name}_output_stage",
            )


def test_two_plugins_claiming_the_output_stage_are_refused_naming_both(
    plugin_manager, checkpoint
) -> None:
    with temporary_plugin(TwoOutputStages(), "two-outputs"):
        app = from_pretrained(
            checkpoint, NeuronConfig(torch_dtype="float32", batch_size=1, seq_len=32)
        )
        app.to_cpu()  # neither enabled: the core's output stage
        app = from_pretrained(
            checkpoint,
            NeuronConfig(torch_dtype="float32", batch_size=1, seq_len=32, two_outputs=True),
        )
        with pytest.raises(PluginError) as refused:
            app.to_cpu()
    message = str(refused.value)
    assert "'first-output'" in message and "'second-output'" in message
    assert "output_stage" in message


class OneRank:
    def run(self, step: Any) -> Any:
        return step


class Broadcasting(OneRank):
    def __init__(self) -> None:
        self.sent: list[tuple[str, tuple]] = []

    def call_on_followers(self, function: str, args: tuple) -> None:
        self.sent.append((function, args))


def test_a_runner_of_one_rank_has_no_followers_to_call() -> None:
    with_defaults(OneRank(), StepRunner).call_on_followers("pkg.mod:load", ("a",))
    broadcaster = Broadcasting()
    with_defaults(broadcaster, StepRunner).call_on_followers("pkg.mod:load", ("a",))
    assert broadcaster.sent == [("pkg.mod:load", ("a",))]
    assert with_defaults(OneRank(), StepRunner).run("step") == "step"
    # a call every rank makes together runs here alone, with the application given
    assert with_defaults(OneRank(), StepRunner).call_on_every_rank(2, "operator:add", (3,)) == 5
