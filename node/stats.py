"""A node's round records and counters: what status, the report and the metrics show."""

from __future__ import annotations

from dataclasses import dataclass, field

from p2pdiloco.status import RoundRecord  # one finished round: the status snapshot's form

__all__ = ["NodeStats", "RoundRecord"]


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
