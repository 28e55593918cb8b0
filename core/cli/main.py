"""The ``nxdplug`` command.

Each of the core's subcommands is one row of :data:`COMMANDS`: a name, a help line, a function
that adds its arguments and a function that runs it and returns the exit code; plugins add
theirs (``serve``, ``benchmark``, ``inference_demo``, ...) as ``nxdplug_commands`` records. A
user error (any :class:`~nxdplug.errors.NxdPlugError`, an ``OSError`` about a path, a usage
error) is printed as one ``nxdplug: error: ...`` paragraph without a traceback; ``--verbose``
adds the traceback.
Anything else is a bug and keeps its traceback. Heavy modules (torch, transformers, model code)
are imported inside the commands that need them, so ``nxdplug plugins list`` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import attrs

from nxdplug import __version__
from nxdplug.cli.inference import (
    add_check_config_arguments,
    add_compile_arguments,
    add_run_arguments,
    run_check_config,
    run_compile,
    run_run,
)
from nxdplug.cli.plugins import (
    add_plugins_doctor_arguments,
    add_plugins_list_arguments,
    run_plugins_doctor,
    run_plugins_hooks,
    run_plugins_list,
)
from nxdplug.errors import NxdPlugError, PluginError
from nxdplug.manager import get_plugin_manager
from nxdplug.registry import get_registry

PROG = "nxdplug"


@attrs.frozen
class Command:
    """One subcommand: either ``run`` (a leaf) or ``subcommands`` (a group like ``plugins``)."""

    name: str
    help: str
    run: Callable[[argparse.Namespace], int] | None = None
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    subcommands: tuple[Command, ...] = ()


class UsageError(Exception):
    """The command line itself is wrong (exit code 2, as argparse)."""


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


# the command table ----------------------------------------------------------------------------

COMMANDS: tuple[Command, ...] = (
    Command(
        "plugins",
        "inspect installed plugins",
        subcommands=(
            Command(
                "list",
                "list every plugin, its origin, status and what it provides",
                run=run_plugins_list,
                add_arguments=add_plugins_list_arguments,
            ),
            Command(
                "doctor",
                "check that every plugin loads, matches the hooks and clashes with none "
                "(exit 1 on problems)",
                run=run_plugins_doctor,
                add_arguments=add_plugins_doctor_arguments,
            ),
            Command(
                "hooks",
                "print the hook reference (Markdown) generated from the hook specifications",
                run=run_plugins_hooks,
            ),
        ),
    ),
    Command(
        "check-config",
        "resolve a checkpoint plus options into plugins and list every problem (exit 1 if any)",
        run=run_check_config,
        add_arguments=add_check_config_arguments,
    ),
    Command(
        "compile",
        "compile every sub-model and bucket into a folder that loads without recompiling",
        run=run_compile,
        add_arguments=add_compile_arguments,
    ),
    Command(
        "run",
        "generate from prompts on the CPU and optionally check accuracy against HF",
        run=run_run,
        add_arguments=add_run_arguments,
    ),
)


def plugin_commands() -> tuple[Command, ...]:
    """The commands plugins register (``nxdplug_commands``): ``serve``, ``benchmark``, ..."""
    core = {command.name for command in COMMANDS}
    commands = []
    for record in get_registry().records("commands"):
        if record.name in core:
            provider = get_registry().provider("commands", record.name)
            raise PluginError(
                f"plugin {provider!r} registers the command {record.name!r}, which is one of "
                "nxdplug's own; rename it, or deny the plugin (NXDPLUG_DENY_PLUGINS)"
            )
        commands.append(
            Command(
                record.name,
                record.description,
                run=_loaded_on_call(record),
                add_arguments=record.load("add_arguments"),
            )
        )
    return tuple(commands)


def _loaded_on_call(record: Any) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        return record.load("run")(args)

    return run


def build_parser() -> argparse.ArgumentParser:
    """The parser of the core's commands and the plugins'."""
    parser = _ArgumentParser(prog=PROG, description="The NxD Inference API on CPU and CUDA.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="show tracebacks of reported errors"
    )
    _add_commands(parser, COMMANDS + plugin_commands())
    return parser


def _add_commands(parser: argparse.ArgumentParser, commands: Sequence[Command]) -> None:
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for command in commands:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        # Accepted after the command name too; SUPPRESS keeps a global -v from being reset.
        sub.add_argument(
            "-v",
            "--verbose",
            action="store_true",
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )
        if command.add_arguments is not None:
            command.add_arguments(sub)
        if command.subcommands:
            _add_commands(sub, command.subcommands)
        else:
            sub.set_defaults(handler=command.run)


def main(argv: list[str] | None = None) -> int:
    """Run the ``nxdplug`` command line and return its exit code."""
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        return _main(argv)


def console_main() -> NoReturn:
    """The ``nxdplug`` console script: :func:`main`, then :func:`exit_with` its exit code."""
    exit_with(main())


def exit_with(exit_code: int) -> NoReturn:
    """Exit the process: a rank of a launched process group through
    :func:`~nxdplug.modules.tensor_parallel.end_rank_process` (the interpreter's teardown of a
    used gloo group may abort the process), any other the usual way."""
    distributed = sys.modules.get("torch.distributed")  # imported by any command that used it
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        from nxdplug.modules.tensor_parallel import end_rank_process

        end_rank_process(exit_code)
    sys.exit(exit_code)


def _main(argv: list[str] | None) -> int:
    try:
        parser = build_parser()
    except NxdPlugError as exc:
        return _report(str(exc), exit_code=1)
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        return _report(str(exc) + _disabled_plugins_hint(str(exc)), exit_code=2)
    except SystemExit as exc:  # --help and --version exit through argparse
        return exc.code if isinstance(exc.code, int) else 0
    try:
        with _results_from_first_rank_only():
            return args.handler(args)
    except (NxdPlugError, OSError) as exc:
        if args.verbose:
            traceback.print_exc()
        return _report(_describe(exc), exit_code=1)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def _disabled_plugins_hint(message: str) -> str:
    """An unknown command may be one of a plugin that the allow- or deny-list disabled."""
    if "invalid choice" not in message:
        return ""
    disabled = [i.name for i in get_plugin_manager().plugin_infos() if i.status == "disabled"]
    if not disabled:
        return ""
    return (
        f"; plugins may add commands, and these are disabled by NXDPLUG_ALLOW_PLUGINS / "
        f"NXDPLUG_DENY_PLUGINS: {', '.join(disabled)}"
    )


def _results_from_first_rank_only() -> contextlib.AbstractContextManager:
    """Under ``torchrun`` every rank runs the command; rank 0 alone prints what it computed.
    (The launcher's ``RANK`` is read directly: importing torch here would slow every command.)"""
    if os.environ.get("RANK", "0") == "0":
        return contextlib.nullcontext()
    return contextlib.redirect_stdout(io.StringIO())


def _show_warning(message: Warning | str, *args: Any, **kwargs: Any) -> None:
    """Warnings (a plugin that failed to load, ...) as one line, without the source line."""
    print(f"{PROG}: warning: {message}", file=sys.stderr)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror and exc.filename:
        target = f" -> {exc.filename2}" if exc.filename2 else ""
        return f"{exc.filename}{target}: {exc.strerror}"
    return str(exc) or type(exc).__name__


def _report(message: str, *, exit_code: int) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return exit_code


if __name__ == "__main__":
    console_main()
