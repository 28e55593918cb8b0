"""The command line's side of feature plugins: ``cli_extensions`` records.

Every installed extension may add options to the commands it names, and turn them into
NeuronConfig settings (which may enable it); once a config exists, the extensions it enables
prepare it (before the model is built), add ``generate()`` keywords, and offer the HF
transformers run the benchmark compares with.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from nxdplug.registry import get_registry
from nxdplug.types import CliExtension

if TYPE_CHECKING:
    from pathlib import Path

    from torch import nn
    from transformers import PreTrainedModel

    from nxdplug.config import InferenceConfig
    from nxdplug.runtime.application import NeuronBaseForCausalLM


class CommandLineExtension(Protocol):
    """The implementation of a ``CliExtension`` record (built with no arguments)."""

    def add_arguments(self, parser: argparse.ArgumentParser, command: str) -> None:
        """Options of this feature for ``command`` (every installed extension's run)."""

    def neuron_config_kwargs(self, args: argparse.Namespace) -> dict[str, Any]:
        """NeuronConfig settings from this feature's options, when they were given (every
        installed extension's run; an option the command lacks is absent from ``args``)."""

    def prepare_config(self, args: argparse.Namespace, config: InferenceConfig) -> None:
        """Change the config from the options, before the model is built."""

    def generate_keywords(
        self, args: argparse.Namespace, model: NeuronBaseForCausalLM
    ) -> dict[str, Any]:
        """Keywords for ``generate()`` (a draft application, ...)."""

    def hf_comparison(
        self,
        args: argparse.Namespace,
        model: NeuronBaseForCausalLM,
        load_hf_model: Callable[[Path], PreTrainedModel],
    ) -> tuple[nn.Module, dict[str, Any]] | None:
        """HF transformers' model and ``generate()`` keywords doing what this feature does, for
        ``benchmark --compare-hf``; None when HF has no equivalent. ``load_hf_model(path)``
        loads a checkpoint in the model's dtype."""


class OptionsOnly:
    """Defaults for an extension whose options only make NeuronConfig settings: nothing to
    prepare once the config exists, no ``generate()`` keywords, no HF run of its own."""

    def prepare_config(self, args: argparse.Namespace, config: InferenceConfig) -> None:
        """The settings are complete once made."""

    def generate_keywords(
        self, args: argparse.Namespace, model: NeuronBaseForCausalLM
    ) -> dict[str, Any]:
        return {}

    def hf_comparison(
        self,
        args: argparse.Namespace,
        model: NeuronBaseForCausalLM,
        load_hf_model: Callable[[Path], PreTrainedModel],
    ) -> None:
        return None


def add_extension_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    for record in get_registry().records("cli_extensions"):
        if command in record.commands:
            record.load("implementation")().add_arguments(parser, command)


def extension_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The NeuronConfig settings every installed extension makes of its options."""
    kwargs: dict[str, Any] = {}
    for record in get_registry().records("cli_extensions"):
        kwargs |= record.load("implementation")().neuron_config_kwargs(args)
    return kwargs


def default_settings(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """The NeuronConfig settings the extensions of ``command`` turn on by default."""
    kwargs: dict[str, Any] = {}
    for record in get_registry().records("cli_extensions"):
        if command in record.commands and record.default_settings is not None:
            kwargs |= record.load("default_settings")(args)
    return kwargs


def _enabled_records(config: InferenceConfig) -> Iterator[CliExtension]:
    for record in get_registry().records("cli_extensions"):
        if record.is_enabled_by(config.neuron_config):
            yield record


def enabled_extensions(config: InferenceConfig) -> Iterator[CommandLineExtension]:
    """The extensions ``config`` enables, built."""
    for record in _enabled_records(config):
        yield record.load("implementation")()


def enabling_settings(config: InferenceConfig, command: str) -> tuple[str, ...]:
    """The NeuronConfig attributes (``enabled_by``) of the extensions of ``command`` that
    ``config`` enables."""
    names: dict[str, None] = {}
    for record in _enabled_records(config):
        if command in record.commands:
            names |= dict.fromkeys(record.enabled_by)
    return tuple(names)


def prepare_config(args: argparse.Namespace, config: InferenceConfig) -> None:
    for extension in enabled_extensions(config):
        extension.prepare_config(args, config)


def generate_keywords(args: argparse.Namespace, model: NeuronBaseForCausalLM) -> dict[str, Any]:
    keywords: dict[str, Any] = {}
    for extension in enabled_extensions(model.config):
        keywords |= extension.generate_keywords(args, model)
    return keywords


def hf_comparison(
    args: argparse.Namespace,
    model: NeuronBaseForCausalLM,
    load_hf_model: Callable[[Path], PreTrainedModel],
) -> tuple[nn.Module, dict[str, Any]] | None:
    """The first enabled extension's HF equivalent, if any offers one."""
    for extension in enabled_extensions(model.config):
        comparison = extension.hf_comparison(args, model, load_hf_model)
        if comparison is not None:
            return comparison
    return None
