"""``nxdplug serve --enable-prompt-logprobs`` (and ``compile`` / ``check-config``, which must
build the same phases): compiles the scoring phase, so that requests may ask for ``echo`` with
``logprobs`` or vLLM's ``prompt_logprobs``."""

from __future__ import annotations

import argparse
from typing import Any

from nxdplug.plugin_api import OptionsOnly
from nxdplug.plugins.prompt_logprobs.hooks import SETTING


class PromptLogprobsCommandLine(OptionsOnly):
    def add_arguments(self, parser: argparse.ArgumentParser, command: str) -> None:
        parser.add_argument_group("prompt log-probabilities").add_argument(
            "--enable-prompt-logprobs",
            action="store_true",
            default=None,
            help="a context encoding that also scores each prompt token (one more graph per "
            "context bucket): serve then answers echo with logprobs and prompt_logprobs",
        )

    def neuron_config_kwargs(self, args: argparse.Namespace) -> dict[str, Any]:
        if getattr(args, SETTING, None) is None:
            return {}
        return {SETTING: True}
