"""The registry: attribution, conflicts, unknown names, records, cache invalidation."""

from __future__ import annotations

import pytest

from nxdplug import hookimpl
from nxdplug.errors import PluginError, UnknownNameError
from nxdplug.registry import get_registry
from nxdplug.testing import temporary_plugin
from nxdplug.types import Feature, ModelArchitecture, Sampler


class ClashingSampler:
    @hookimpl
    def nxdplug_samplers(self):
        yield Sampler(name="greedy", implementation="somewhere.else:Greedy")


class WrongRecord:
    @hookimpl
    def nxdplug_samplers(self):
        yield Feature(name="not-a-sampler")


class FailingHook:
    @hookimpl
    def nxdplug_features(self):
        raise RuntimeError("boom")


def test_every_kind_has_builtin_records(plugin_manager) -> None:
    registry = get_registry()
    assert {"serving_routes", "tool_parsers", "commands"} <= set(plugin_manager.record_kinds)
    for kind in plugin_manager.record_kinds:
        assert registry.records(kind), kind


def test_name_conflict_names_every_provider(plugin_manager) -> None:
    with temporary_plugin(ClashingSampler(), "clash"), pytest.raises(PluginError) as error:
        get_registry().records("samplers")
    message = str(error.value)
    assert "'greedy'" in message and "'sampling'" in message and "'clash'" in message
    assert get_registry().names("samplers") == ["greedy", "multinomial"]


def test_unknown_name_lists_choices_and_suggests(plugin_manager) -> None:
    with pytest.raises(UnknownNameError) as error:
        get_registry().get("samplers", "gredy")
    message = str(error.value)
    assert "Did you mean 'greedy'?" in message
    assert "'greedy', 'multinomial'" in message


def test_unknown_kind_lists_kinds(plugin_manager) -> None:
    with pytest.raises(UnknownNameError, match="model_architectures"):
        get_registry().records("widgets")


def test_wrong_record_type_is_attributed(plugin_manager) -> None:
    with temporary_plugin(WrongRecord(), "wrong"), pytest.raises(PluginError, match="'wrong'"):
        get_registry().records("samplers")


def test_failing_registration_hook_is_attributed(plugin_manager) -> None:
    expected = r"'failing' failed in nxdplug_features.*boom"
    with temporary_plugin(FailingHook(), "failing"), pytest.raises(PluginError, match=expected):
        get_registry().records("features")


def test_registry_sees_registration_changes(plugin_manager) -> None:
    class Extra:
        @hookimpl
        def nxdplug_samplers(self):
            yield Sampler(name="extra", implementation="x.y:Z")

    registry = get_registry()
    assert "extra" not in registry.names("samplers")
    with temporary_plugin(Extra(), "extra-plugin"):
        assert registry.provider("samplers", "extra") == "extra-plugin"
    assert "extra" not in registry.names("samplers")


def test_provided_by_lists_a_plugins_names(plugin_manager) -> None:
    assert get_registry().provided_by("llama") == {
        "model_architectures": ["llama"],
        "state_dict_converters": ["llama-hf"],
    }


def test_find_architecture_by_hf_name_then_model_type(plugin_manager) -> None:
    registry = get_registry()
    assert registry.find_architecture(["Qwen2ForCausalLM"], None).name == "qwen2"
    assert registry.find_architecture(["Qwen3ForCausalLM"], "qwen3").name == "qwen3"
    assert registry.find_architecture([], "mistral").name == "mistral"
    with pytest.raises(UnknownNameError, match="LlamaForCausalLM"):
        registry.find_architecture(["GPTNeoXForCausalLM"], "gpt_neox")


@pytest.mark.parametrize(
    "bad",
    [
        {"name": "Has Space"},
        {"name": "UPPER"},
        {"name": "ok", "implementation": "no_colon_here"},
    ],
)
def test_records_validate_names_and_references(bad) -> None:
    fields = {"name": "ok", "implementation": "pkg.mod:Cls"} | bad
    with pytest.raises(ValueError):
        Sampler(**fields)


def test_records_are_frozen_and_load_lazily() -> None:
    record = ModelArchitecture(
        name="demo",
        model_type="demo",
        application="collections:OrderedDict",
        config_class="collections:Counter",
    )
    with pytest.raises(AttributeError):
        record.name = "other"
    import collections

    assert record.load("application") is collections.OrderedDict
