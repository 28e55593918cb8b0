"""The hook the inductor backend adds for other plugins: operators it may stack.

A plugin implementing it marks its implementation ``@hookimpl(optionalhook=True)``, so that it
still loads where the inductor backend is not installed (or denied).
"""

from __future__ import annotations

from collections.abc import Iterable

from nxdplug.plugin_api import RecordKind, hookspec
from nxdplug.plugins.inductor_backend.records import StackableLinear


class InductorSpecs:
    """What plugins add to the inductor backend."""

    @hookspec
    def nxdplug_stackable_linears(self) -> Iterable[StackableLinear]:
        """Register an operator that multiplies as a linear does, so that compiled graphs stack
        its calls on one input into one call by stacked operands.

        .. code-block:: python

            @nxdplug.hookimpl(optionalhook=True)
            def nxdplug_stackable_linears():
                yield StackableLinear(
                    name="my-int8-matmul",
                    operator="my_pkg.kernels:int8_matmul_op",
                    row_arguments=(1, 2),  # weight, per-row scales
                    row_multiple=4,  # the weight is held in tiles of four rows
                )
        """


RECORD_KINDS = (
    RecordKind(
        "stackable_linears", "nxdplug_stackable_linears", StackableLinear, "stackable linear"
    ),
)
