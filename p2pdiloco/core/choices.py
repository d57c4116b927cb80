"""Named choices of the algorithm core that a node's settings are checked against, without
torch (the configuration imports this module; the code that acts on them imports torch).

* ``OUTLIER_POLICIES``: what the robust merge (:func:`p2pdiloco.core.robust.robust_merge`) does
  with a contribution whose norm is more than ``outlier_factor`` times the round's median norm
  or that points against the reducer's own Δ (docs/trust.md §5): ``clip`` scales it down to
  that bound or weighs it by its alignment, ``drop`` leaves it out, ``off`` takes it as it is.
* ``DEFAULT_OUTLIER_FACTOR``: that factor's default (unitless ratio of L2 norms).
"""

from __future__ import annotations

import typing
from typing import Literal

__all__ = ["OutlierPolicy", "OUTLIER_POLICIES", "DEFAULT_OUTLIER_FACTOR"]

OutlierPolicy = Literal["clip", "drop", "off"]
OUTLIER_POLICIES: tuple[str, ...] = typing.get_args(OutlierPolicy)
DEFAULT_OUTLIER_FACTOR = 1.25
