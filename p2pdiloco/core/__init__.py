"""Decoupled DiLoCo algorithm core (arXiv 2604.21428): pure torch, no I/O.

The names below are imported on first use (PEP 562): the configuration imports the torch-free
modules of this package (``inner``, ``choices``), and importing the package must not import
torch for them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .fragments import Fragment, StaggeredSchedule, TensorSlot, assign_parts, balanced_fragments
    from .inner import InnerConfig, lr_at
    from .learner import Learner
    from .merge import contribution_weight, is_finite_contribution, merge_pseudo_gradients, merge_tensor
    from .outer import FragmentState, fragment_digest, nesterov_outer_step

_LAZY = {
    "Fragment": "fragments", "StaggeredSchedule": "fragments", "TensorSlot": "fragments",
    "assign_parts": "fragments", "balanced_fragments": "fragments",
    "InnerConfig": "inner", "lr_at": "inner", "Learner": "learner",
    "contribution_weight": "merge", "is_finite_contribution": "merge", "merge_pseudo_gradients": "merge",
    "merge_tensor": "merge",
    "FragmentState": "outer", "fragment_digest": "outer", "nesterov_outer_step": "outer",
}
__all__ = [
    "Fragment", "StaggeredSchedule", "TensorSlot", "assign_parts", "balanced_fragments",
    "InnerConfig", "Learner", "lr_at",
    "contribution_weight", "is_finite_contribution", "merge_pseudo_gradients", "merge_tensor",
    "FragmentState", "fragment_digest", "nesterov_outer_step",
]
assert sorted(__all__) == sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
