"""Decoupled DiLoCo algorithm core (arXiv 2604.21428): pure torch, no I/O."""

from .fragments import Fragment, StaggeredSchedule, TensorSlot, assign_parts, balanced_fragments
from .learner import InnerConfig, Learner, lr_at
from .merge import contribution_weight, is_finite_contribution, merge_pseudo_gradients, merge_tensor
from .outer import FragmentState, fragment_digest, nesterov_outer_step

__all__ = [
    "Fragment", "StaggeredSchedule", "TensorSlot", "assign_parts", "balanced_fragments",
    "InnerConfig", "Learner", "lr_at",
    "contribution_weight", "is_finite_contribution", "merge_pseudo_gradients", "merge_tensor",
    "FragmentState", "fragment_digest", "nesterov_outer_step",
]
