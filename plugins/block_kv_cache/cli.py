"""The block layout's command-line flags: NxD Inference's for ``inference_demo``, vLLM's for
``nxdplug serve``.

inference_demo keeps NxD Inference's rule: prefix caching and chunked prefill need
``--enable-block-kv-layout`` (the config check says so). ``nxdplug serve`` follows vLLM, whose
cache is always paged: ``--enable-prefix-caching`` or ``--enable-chunked-prefill`` switches the
block layout on too, and prefix caching is on unless ``--no-enable-prefix-caching`` (or a
setting the block layout refuses) says otherwise.
"""

from __future__ import annotations

import argparse
from typing import Any

from nxdplug.plugin_api import OptionsOnly, positive_int

# A destination only these flags fill: arguments without it are another command's.
MARK = "block_kv_flags"
TITLE = "KV-cache blocks, prefix caching and chunked prefill"
# flag -> (NeuronConfig setting, argparse keywords), per command
_COMMON = {
    "--pa-num-blocks": ("pa_num_blocks", {"type": positive_int, "metavar": "N"}),
    "--pa-block-size": ("pa_block_size", {"type": positive_int, "metavar": "N"}),
    "--max-num-seqs": ("max_batch_size", {"type": positive_int, "metavar": "N"}),
}
_SWITCH = {"action": "store_true", "default": None}
_ON_OFF = {"action": argparse.BooleanOptionalAction, "default": None}
FLAGS = {
    "inference_demo": _COMMON
    | {
        "--enable-block-kv-layout": ("is_block_kv_layout", _SWITCH),
        "--enable-prefix-caching": ("is_prefix_caching", _SWITCH),
        "--enable-chunked-prefill": ("is_chunked_prefill", _SWITCH),
        "--prefix-buckets": ("prefix_buckets", {"nargs": "+", "type": positive_int}),
    },
    "serve": _COMMON
    | {
        "--enable-prefix-caching": ("is_prefix_caching", _ON_OFF),
        "--enable-chunked-prefill": ("is_chunked_prefill", _ON_OFF),
        "--max-num-batched-tokens": (
            "max_num_batched_tokens",
            {"type": positive_int, "metavar": "N"},
        ),
        "--block-size": ("pa_block_size", {"type": positive_int, "metavar": "N"}),
    },
}
HELP = {
    "pa_num_blocks": "KV-cache blocks (default: as many as max_batch_size lines of seq_len)",
    "pa_block_size": "positions per KV-cache block (default 32)",
    "max_batch_size": "requests running at once (max_batch_size)",
    "is_block_kv_layout": "the block KV-cache layout (NxD Inference's paged attention)",
    "is_prefix_caching": "share the cached blocks of common prompt prefixes (serve: on by "
    "default where the config allows the block layout)",
    "is_chunked_prefill": "encode long prompts in chunks beside the running requests",
    "prefix_buckets": "cached-prefix lengths the extension graphs are made for (with the "
    "context-encoding buckets as new tokens)",
    "max_num_batched_tokens": "tokens a step may take with chunked prefill (decoding first)",
}


def serve_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's default: prefix caching on (so the block layout too) unless a flag says."""
    if getattr(args, f"{MARK}_enable_prefix_caching", None) is not None:
        return {}
    return {"is_block_kv_layout": True, "is_prefix_caching": True}


class BlockCacheFlags(OptionsOnly):
    def add_arguments(self, parser: argparse.ArgumentParser, command: str) -> None:
        group = parser.add_argument_group(TITLE)
        for flag, (setting, keywords) in FLAGS[command].items():
            dest = f"{MARK}_{flag.lstrip('-').replace('-', '_')}"
            group.add_argument(flag, dest=dest, help=HELP[setting], **keywords)
        parser.set_defaults(**{MARK: command})

    def neuron_config_kwargs(self, args: argparse.Namespace) -> dict[str, Any]:
        command = getattr(args, MARK, None)
        if command is None:
            return {}
        settings = {}
        for flag, (setting, _) in FLAGS[command].items():
            value = getattr(args, f"{MARK}_{flag.lstrip('-').replace('-', '_')}")
            if value is not None:
                settings[setting] = value
        if command == "serve" and (
            settings.get("is_prefix_caching") or settings.get("is_chunked_prefill")
        ):
            settings["is_block_kv_layout"] = True
        return settings
