"""One learner's inner loop and its view of the global fragment states.

Source: Decoupled DiLoCo (arXiv 2604.21428): each learner trains its own copy
with AdamW (DiLoCo inner defaults, arXiv 2311.08105: lr 4e-4, linear warmup then cosine decay,
weight decay 0.1), counts tokens and steps per fragment since it last received that fragment,
computes pseudo-gradients Δ = Θ_p(anchor) − θ_p, and on arrival of a merged fragment
overwrites θ_p, resets the counters of p and keeps its AdamW state.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .fragments import Fragment
from .inner import InnerConfig, lr_at
from .outer import FragmentState, Ledger

__all__ = ["InnerConfig", "Learner", "global_states_of", "lr_at"]

log = logging.getLogger(__name__)


def _cpu32(p: Tensor) -> Tensor:
    return p.detach().to("cpu", torch.float32)


class Learner:
    """Inner AdamW training of ``model`` plus per-fragment anchors and counters.

    model: ``model(inputs [B, T] int64) -> logits [B, T, V]``; fragments: must cover every
    parameter of ``model.named_parameters()`` exactly once, ``fragments[p].index == p``.
    Attributes: ``step`` (completed inner steps), ``global_states`` (anchor of each fragment,
    version 0 from the model's own weights with zero momentum). Raises ValueError on a bad cover.
    """

    def __init__(self, model: nn.Module, fragments: Sequence[Fragment], inner: InnerConfig) -> None:
        self.model, self.fragments, self.inner = model, tuple(fragments), inner
        named = dict(model.named_parameters())
        names = [s.name for f in self.fragments for s in f.slots]
        if sorted(names) != sorted(named):
            raise ValueError("fragments must cover every model parameter exactly once")
        for p, f in enumerate(self.fragments):
            if f.index != p:
                raise ValueError(f"fragment at position {p} has index {f.index}")
            for s in f.slots:
                if tuple(named[s.name].shape) != s.shape:
                    raise ValueError(f"{s.name}: shape {tuple(named[s.name].shape)} != slot {s.shape}")
        self._params = [[named[s.name] for s in f.slots] for f in self.fragments]
        groups = [{"params": [q for q in named.values() if q.dim() >= 2], "weight_decay": inner.weight_decay},
                  {"params": [q for q in named.values() if q.dim() < 2], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr_at(0, inner), betas=inner.betas)
        self.step = 0
        self.rewarm_from = -1  # inner step where a joiner's fresh AdamW state started (-1: never)
        self._tokens = [0] * len(self.fragments)
        self._steps = [0] * len(self.fragments)
        self._since = [0] * len(self.fragments)  # anchor version at which each fragment's counters started
        self.global_states = [
            FragmentState.create(p, 0, ps, [torch.zeros(t.shape) for t in ps]) for p, ps in enumerate(self._params)]

    def current_lr(self) -> float:
        """Learning rate the next ``inner_step`` will use: ``lr_at(step)``, ramped up linearly
        over ``warmup_steps`` inner steps again from ``rewarm_from`` (see :meth:`join_at`)."""
        lr = lr_at(self.step, self.inner)
        if 0 <= self.rewarm_from <= self.step < self.rewarm_from + self.inner.warmup_steps:
            lr *= (self.step - self.rewarm_from + 1) / self.inner.warmup_steps
        return lr

    def join_at(self, step: int) -> None:
        """Take the swarm's place in the learning-rate schedule on joining (``step``: inner
        steps; never backwards) and warm the inner optimizer up again from there: its AdamW
        moments are fresh, and at the swarm's full rate its first pseudo-gradients would be
        larger than the others' (measured 1.6x for ~30 steps), so the rate ramps up linearly
        over ``warmup_steps`` as at the start of a run (the usual Adam warm-up, arXiv
        1908.03265). A learner that already took ``warmup_steps`` steps of its own (it trained
        alone before it found the swarm) keeps its rate."""
        young = self.step < self.inner.warmup_steps  # moments still fresh: it has not trained on its own
        if step > self.step:
            self.step = step
        if young:
            self.rewarm_from = self.step

    def inner_step(self, inputs: Tensor, targets: Tensor) -> float:
        """One AdamW step on a batch; inputs, targets: int64 [B, T]. Returns the mean
        cross-entropy (nats per token) before the step. Counts one step and B·T tokens for
        every fragment. A non-finite loss is returned without stepping or counting, so the
        weights and AdamW state are never poisoned. Raises ValueError on bad shapes."""
        if inputs.dim() != 2 or inputs.shape != targets.shape:
            raise ValueError(f"inputs and targets must both be [B, T], got {tuple(inputs.shape)}, {tuple(targets.shape)}")
        self.model.train()
        device = next(self.model.parameters()).device
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        # bf16 autocast on CUDA only; parameters, AdamW state and all merge arithmetic stay fp32
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = self.model(inputs)  # [B, T, V]
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        value = loss.item()
        if not math.isfinite(value):
            log.warning("non-finite loss %s at inner step %d: step skipped", value, self.step)
            return value
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.inner.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = self.current_lr()
        self.optimizer.step()
        self.step += 1
        n = inputs.numel()
        self._tokens = [t + n for t in self._tokens]
        self._steps = [s + 1 for s in self._steps]
        return value

    def _check(self, p: int) -> int:
        if not 0 <= p < len(self.fragments):
            raise ValueError(f"fragment index {p} out of range [0, {len(self.fragments)})")
        return p

    def counters(self, p: int) -> tuple[int, int]:
        """(tokens, steps) since fragment p was last installed (the merge weight's inputs).
        Raises ValueError on an unknown fragment."""
        return self._tokens[self._check(p)], self._steps[p]

    def span(self, p: int) -> int:
        """Rounds that merged fragment p while its current progress was made, the next one
        included: anchor version − version at which the counters started + 1 (>= 1). More than
        1 after following others' rounds with the progress rebased on top
        (``round_fraction``'s input). Raises ValueError on an unknown fragment."""
        return self.global_states[self._check(p)].version - self._since[p] + 1

    def pseudo_gradient(self, p: int) -> list[Tensor]:
        """Δ_p = anchor Θ_p − θ_p: new fp32 CPU tensors in slot shapes (positive along the
        direction of descent taken, like a gradient), never aliasing params or anchors.
        Source: arXiv 2604.21428 (pseudo-gradient). Raises ValueError on an unknown fragment."""
        return [a - _cpu32(q) for a, q in zip(self.global_states[self._check(p)].theta, self._params[p])]

    def progress_norm(self, p: int) -> float:
        """‖Δ_p‖₂ = ‖anchor Θ_p − θ_p‖ over all of fragment p's slots (fp32, a float): the size of
        the local progress not yet merged. Raises ValueError on an unknown fragment."""
        return math.sqrt(sum(float(d.norm()) ** 2 for d in self.pseudo_gradient(p)))

    def install(self, state: FragmentState, rebase: bool = False) -> None:
        """Adopt a new global state of fragment ``state.index`` as its anchor.

        rebase=False: θ_p ← Θ_p (copied into the parameters) and counters of p reset.
        rebase=True: θ_p ← Θ_p − (old anchor − θ_p): local progress since the old anchor is kept
        on top of the new global value, and so are the counters (for a node that catches up on a
        version it missed, invariant I3 in docs/architecture.md). AdamW state is kept in both
        cases.
        Raises ValueError on an unknown index or slot shape mismatch."""
        p = self._check(state.index)
        if [tuple(t.shape) for t in state.theta] != [s.shape for s in self.fragments[p].slots]:
            raise ValueError(f"state of fragment {p} does not match its slot shapes")
        old = self.global_states[p]
        with torch.no_grad():
            for q, new, anchor in zip(self._params[p], state.theta, old.theta):
                q.copy_(new - (anchor - _cpu32(q)) if rebase else new)
        if not rebase:
            self._tokens[p] = self._steps[p] = 0
            self._since[p] = state.version
        else:
            self._since[p] = min(self._since[p], state.version)
        self.global_states[p] = state

    def install_keeping_flight(self, state: FragmentState, sent: Sequence[Tensor], tokens: int, steps: int) -> None:
        """Adopt the merge that contains our contribution ``sent`` (the Δ_p sent, fp32, slot
        shapes, made after ``steps`` steps and ``tokens`` tokens) while keeping the progress
        made since it was sent: θ_p ← Θ_new + (θ_p − (Θ_anchor − sent)); the counters keep only
        the steps and tokens taken since sending.

        This is :meth:`install` (overwrite) plus the inner steps that ran while the round was
        in flight, which the paper's overwrite on arrival drops (arXiv 2604.21428); they are
        contributed at the next round instead (as in asynchronous Local-SGD, arXiv
        2401.09135). With nothing trained in flight both are identical.
        Raises ValueError on an unknown index, shape mismatch or counters larger than ours."""
        p = self._check(state.index)
        if [tuple(t.shape) for t in state.theta] != [s.shape for s in self.fragments[p].slots]:
            raise ValueError(f"state of fragment {p} does not match its slot shapes")
        if not (0 <= tokens <= self._tokens[p] and 0 <= steps <= self._steps[p]):
            raise ValueError(f"sent counters ({tokens}, {steps}) exceed fragment {p}'s ({self._tokens[p]}, {self._steps[p]})")
        old = self.global_states[p]
        with torch.no_grad():
            for q, new, anchor, d in zip(self._params[p], state.theta, old.theta, sent):
                q.copy_(new + (_cpu32(q) - (anchor - d)))
        self._tokens[p] -= tokens
        self._steps[p] -= steps
        self._since[p] = state.version
        self.global_states[p] = state

    def state_dict(self, *, copy_tensors: bool = True) -> dict:
        """Everything needed to resume: model, optimizer, inner config, step, counters and the
        versions they started at, global states (tensors, versions, digests). The lr schedule is
        a pure function of ``step``, so restoring the step restores it. A deep copy, or with
        ``copy_tensors=False`` the live tensors themselves (no memory added: 20 bytes per
        parameter less), valid only until the next step or install, for a caller that
        serializes them at once in the training thread (node/checkpoint.py)."""
        live = {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "inner": asdict(self.inner), "step": self.step, "rewarm_from": self.rewarm_from,
            "tokens": list(self._tokens), "steps": list(self._steps), "since": list(self._since),
            "global_states": [{"index": s.index, "version": s.version, "theta": list(s.theta),
                               "momentum": list(s.momentum), "digest": s.digest,
                               "ledger": s.ledger.to_list()}
                              for s in self.global_states],
        }
        return copy.deepcopy(live) if copy_tensors else live

    def load_state_dict(self, d: dict) -> None:
        """Restore from ``state_dict()``. Raises ValueError when the fragment count differs or a
        global state's digest does not match its tensors (corrupt checkpoint)."""
        P = len(self.fragments)
        if len(d["global_states"]) != P or len(d["tokens"]) != P or len(d["steps"]) != P:
            raise ValueError(f"checkpoint has a different number of fragments (expected {P})")
        states = global_states_of(d)
        if d["inner"] != asdict(self.inner):
            log.warning("checkpoint inner config %s differs from current %s; using current", d["inner"], asdict(self.inner))
        self.model.load_state_dict(d["model"])
        self.optimizer.load_state_dict(d["optimizer"])
        self.step = int(d["step"])
        self.rewarm_from = int(d.get("rewarm_from", -1))
        self._tokens, self._steps = [int(t) for t in d["tokens"]], [int(s) for s in d["steps"]]
        # checkpoints written before "since" existed: counters as if they started at the anchor
        self._since = [min(int(v), s.version) for v, s in zip(d.get("since", [s.version for s in states]), states)]
        self.global_states = states


def global_states_of(d: dict) -> list[FragmentState]:
    """The global states Θ_p held in ``d``, a :meth:`Learner.state_dict`: one
    :class:`FragmentState` per fragment, in fragment order, each digest recomputed from its
    tensors. Raises ValueError (or KeyError, TypeError on a malformed dict) when a state is
    out of place or its digest does not match its tensors (a corrupt checkpoint)."""
    states = [FragmentState.create(g["index"], g["version"], g["theta"], g["momentum"],
                                   Ledger(*g.get("ledger", (-1, 0, 0.0)))) for g in d["global_states"]]
    for p, (s, g) in enumerate(zip(states, d["global_states"])):
        if s.index != p or s.digest != g["digest"]:
            raise ValueError(f"checkpoint global state of fragment {p} is corrupt (digest mismatch)")
    return states
