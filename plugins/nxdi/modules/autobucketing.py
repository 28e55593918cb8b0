"""NxD Inference's ``modules.autobucketing``: bucket lists for plain causal-LM bucketing.

Not provided: the prefix-caching, chunked-prefill and batch-bucketing functions
(``generate_2d_buckets_*``, ``generate_buckets_on_chunk_size``,
``generate_buckets_for_chunked_prefill_cte``), features nxdplug lacks.
"""

from __future__ import annotations

from nxdplug.nxdi.reexport import reexport

reexport(
    __name__,
    {
        name: f"nxdplug.config.buckets:{name}"
        for name in (
            "generate_buckets",
            "generate_buckets_for_cte",
            "generate_buckets_for_tkg",
            "generate_buckets_for_speculation",
            "generate_buckets_for_fused_spec",
        )
    },
)
