"""GQA replication of K/V projection weights and query-head padding for the configured
tensor-parallel degree."""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import StateDictConverter, hookimpl

NXDPLUG_API_VERSION = 2


@hookimpl
def nxdplug_state_dict_converters() -> Iterable[StateDictConverter]:
    yield StateDictConverter(
        name="gqa-replication",
        converter="nxdplug.plugins.gqa.convert:lay_out_attention_heads",
        order=110,
        description=(
            "replicate K/V heads (REPLICATE_TO_TP_DEGREE) or convert to MHA; pad query heads "
            "to a multiple of tp_degree"
        ),
    )
