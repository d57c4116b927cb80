"""A node's round records and counters: what status, the report and the metrics show."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RoundRecord:
    """One finished outer round as this node saw it."""

    fragment: int
    version: int  # version produced
    members: int
    seconds: float
    committed: bool
    reason: str = ""
    digest: str = ""  # the committed state's (12 hex), else ""
    fraction: float = 0.0  # of an outer period, the step this round applied (round_fraction); committed only
    share: float = 0.0  # of the fragment, the part this node reduced (bandwidth-aware shares); committed only


@dataclass
class NodeStats:
    state: str = "starting"
    rounds_committed: int = 0
    rounds_failed: int = 0
    rounds_late: int = 0
    rounds_alone: int = 0  # committed rounds of this node alone (one member)
    rounds_excluded: int = 0  # rounds merged without our contribution: kept, rebased, offered again
    catchups: int = 0
    resyncs: int = 0  # catch-ups to a state at the version already held (another digest won: I7)
    tokens_merged: int = 0  # tokens of this node's contributions that went into a merge
    internal_errors: int = 0  # background steps that raised (logged with a traceback, never fatal)
    recent: list[RoundRecord] = field(default_factory=list)
