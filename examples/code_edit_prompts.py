"""Prompts of a code-editing load for ``nxdplug benchmark-serving --prompt-file``.

    python examples/code_edit_prompts.py --output /tmp/edit.jsonl
    nxdplug benchmark-serving --model-path examples/models/pycoder-tiny --prompt-file \
        /tmp/edit.jsonl --concurrency 1 --num-requests 16 --max-tokens 96 \
        --compare-server-options="--speculative-config '{\"method\": \"ngram\", ...}'"

An edit's answer repeats most of the code it was given. Each prompt here is the start of a
Python file (``--lines`` lines of the standard library by default), a blank line, then the
file's first ``--restart`` lines again: a model continuing it writes the file a second time,
which n-gram speculation finds in the prompt. Written as JSON lines with a ``prompt`` field.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path


def edit_prompt(source: str, lines: int, restart: int) -> str | None:
    """``source``'s first ``lines`` lines, a blank line, then its first ``restart`` lines; None
    when it is too short or has no code in its first lines."""
    head = source.splitlines()[:lines]
    if len(head) < lines or not any(line.strip() for line in head[:restart]):
        return None
    return "\n".join(head) + "\n\n" + "\n".join(head[:restart]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="the JSON lines file")
    parser.add_argument(
        "--source",
        type=Path,
        default=Path(sysconfig.get_paths()["stdlib"]),
        help="a folder of .py files (default: this Python's standard library)",
    )
    parser.add_argument("--count", type=int, default=32, help="prompts to write")
    parser.add_argument("--lines", type=int, default=12, help="lines of each file's start")
    parser.add_argument("--restart", type=int, default=3, help="of those, repeated after")
    args = parser.parse_args(argv)
    prompts = []
    for path in sorted(args.source.glob("*.py")):
        prompt = edit_prompt(path.read_text(errors="replace"), args.lines, args.restart)
        if prompt is not None:
            prompts.append(prompt)
        if len(prompts) == args.count:
            break
    if len(prompts) < args.count:
        parser.error(f"{args.source} has only {len(prompts)} .py files long enough")
    partial = args.output.with_name(args.output.name + ".partial")
    partial.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    partial.replace(args.output)
    print(f"wrote {len(prompts)} prompts to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
