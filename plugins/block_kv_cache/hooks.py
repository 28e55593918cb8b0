"""The block (paged) KV-cache layout (``is_block_kv_layout``), with prefix caching
(``is_prefix_caching``) and chunked prefill (``is_chunked_prefill``) over it.

The ``block`` strategy stores keys and values in ``pa_num_blocks`` blocks of ``pa_block_size``
positions; the serving engine's cache space (``BlockSpace``) lends them as requests grow and
shares the full blocks of common prompt prefixes. Each step's ``block_tables`` input says where
a row's positions lie.
"""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import CliExtension, Feature, KVCacheStrategy, StepInput, hookimpl
from nxdplug.plugins.block_kv_cache.settings import BLOCK_TABLES, ENABLED_BY, SETTINGS, USES_BLOCKS

NXDPLUG_API_VERSION = 2
PACKAGE = "nxdplug.plugins.block_kv_cache"


@hookimpl
def nxdplug_kv_cache_strategies() -> Iterable[KVCacheStrategy]:
    yield KVCacheStrategy(
        name="block",
        implementation=f"{PACKAGE}.cache:BlockKVCache",
        cache_space=f"{PACKAGE}.space:BlockSpace",
        enabled_by=ENABLED_BY,
        description="pa_num_blocks blocks of pa_block_size positions, found by block tables",
    )


@hookimpl
def nxdplug_step_inputs() -> Iterable[StepInput]:
    yield StepInput(
        name="block-tables",
        builder=f"{PACKAGE}.tables:BlockTables",
        inputs=(BLOCK_TABLES,),
        keywords=(BLOCK_TABLES,),
        enabled_by=ENABLED_BY,
        description="each row's blocks of the block KV cache",
    )


@hookimpl
def nxdplug_features() -> Iterable[Feature]:
    yield Feature(
        name="block-kv-layout",
        enabled_by=ENABLED_BY + USES_BLOCKS,
        settings=SETTINGS,
        validate=f"{PACKAGE}.pipeline:validate",
        add_submodels=f"{PACKAGE}.pipeline:add_submodels",
        description="block KV cache, prefix caching and chunked prefill",
    )


@hookimpl
def nxdplug_cli_extensions() -> Iterable[CliExtension]:
    yield CliExtension(
        name="block-kv-layout-flags",
        implementation=f"{PACKAGE}.cli:BlockCacheFlags",
        commands=("inference_demo", "serve"),
        default_settings=f"{PACKAGE}.cli:serve_defaults",
        description="--enable-prefix-caching, --enable-chunked-prefill, --pa-num-blocks, ...",
    )
