"""The goodput simulator replayed on the timeline a chaos run actually had.

Each node incarnation becomes a simulator session (:class:`p2pdiloco.sim.swarm.Sessions`):
online from its spawn (first incarnations: from ``t0``) to its kill, training from its first
'training' status, at the measured standalone rate. Merges follow
:func:`p2pdiloco.sim.swarm_modes.decoupled` with one whole-model merge every ``round_s`` =
H inner steps of one node (``outer.sync_every x data.batch_size x model.block_size / rate``):
each fragment of the real node merges once per H steps, so a kill loses about H/2 steps of
unmerged progress in both. Freezes and slowdowns are not modelled (None is returned for runs
that had any).
"""

from __future__ import annotations

import math

import numpy as np

from p2pdiloco.chaos.observe import NodeTrack
from p2pdiloco.config import DataConfig, OuterConfig
from p2pdiloco.model import ModelConfig


def round_seconds(settings: dict[str, str], tokens_per_s: float) -> float:
    """Seconds one node takes for H inner steps at ``tokens_per_s``."""
    H = int(settings.get("outer.sync_every", OuterConfig().sync_every))
    B = int(settings.get("data.batch_size", DataConfig.__dataclass_fields__["batch_size"].default))
    L = int(settings.get("model.block_size", ModelConfig().block_size))
    return H * B * L / tokens_per_s


def replay_goodput(tracks: list[NodeTrack], t0: float, t1: float, tokens_per_s: float,
                   settings: dict[str, str], merge_s: float = 1.0) -> float | None:
    """Simulated goodput (merged / (nodes x rate x duration)) for the run's real timeline."""
    from p2pdiloco.sim.swarm import Sessions, SwarmParams  # noqa: PLC0415
    from p2pdiloco.sim.swarm_modes import decoupled  # noqa: PLC0415

    if tokens_per_s <= 0 or t1 <= t0:
        return None
    start, end, ready = [], [], []
    for tr in tracks:
        for life in tr.lives:
            if life.ended is not None and life.ended <= t0:
                continue
            s = max(0.0, life.spawned - t0) if life.restart else 0.0
            if s >= t1 - t0:
                continue
            e = math.inf if life.ended is None or life.ended >= t1 else life.ended - t0
            r = s if not life.restart else (life.training_at - t0 if life.training_at is not None else math.inf)
            start.append(s), end.append(e), ready.append(min(r, e))
    duration = t1 - t0
    round_s = max(round_seconds(settings, tokens_per_s), merge_s)
    quorum = int(settings.get("outer.min_quorum", OuterConfig().min_quorum))
    p = SwarmParams(peers=len(tracks), tokens_per_s=tokens_per_s, speed_sigma=0.0, round_compute_s=round_s,
                    latency_s=merge_s, grace_s=0.0, bandwidth_mbps=1e12, model_params=1.0,
                    min_quorum=min(quorum, len(tracks)), horizon_s=duration)
    sessions = Sessions(np.asarray(start), np.asarray(end), np.asarray(ready), np.full(len(start), tokens_per_s))
    return decoupled(p, sessions).merged_tokens / (len(tracks) * tokens_per_s * duration)
