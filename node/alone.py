"""No silent solo: the one owner of "when did this node last merge with another node", and the
verdict when that was too long ago (state "alone", with the likely reason)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from p2pdiloco.net.addresses import JOIN_HINT

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Alone:
    """Why a training node has merged with no other node for ``NodeConfig.alone_after`` seconds.

    Attributes:
        reason: "no_peers" (no other node of the run seen: wrong initial peers or run id),
            "other_settings" (nodes of the run seen, all with other settings: they can never
            merge with this one), "unreachable" (nodes of the run with our settings seen, yet
            no round with them, and peers cannot dial this node: behind NAT with no relay slot;
            ``net.reachability``), "no_rounds" (the same while this node is dialable or its
            reachability unknown: they may not be, or always at other versions).
        detail: one line for a person, naming what to check.
        since: Unix time (s) of the last round merged with another node, or of the start of
            training.
    """

    reason: Literal["no_peers", "other_settings", "unreachable", "no_rounds"]
    detail: str
    since: float


class AloneWatch:
    """Tracks this node's last round with another member; :meth:`check` sets :attr:`alone`
    once that is ``alone_after`` seconds ago (and logs it at WARNING once per reason), a round
    with another member clears it. A volunteer whose node trains alone contributes nothing to
    the run, so it must not go unseen."""

    def __init__(self, alone_after: float, run_id: str, tag: str) -> None:
        self.alone_after, self.run_id, self.tag = alone_after, run_id, tag
        self.last_merged: float | None = None  # Unix time; None until training starts
        self.alone: Alone | None = None
        self.joined = False  # set when the node joined an existing run with its manifest (--join)

    def started(self) -> None:
        """Training began: the clock starts."""
        self.last_merged = time.time()

    def merged(self) -> None:
        """A round with at least one other member committed."""
        self.last_merged = time.time()
        if self.alone is not None:
            log.info("merging with other nodes again")
            self.alone = None

    def check(self, others_seen: int, other_settings: Mapping[str, str], advice: str | None = None) -> None:
        """``others_seen``: other nodes of the run with our settings in the last read of the
        records; ``other_settings``: {peer ID: its settings} of nodes of the run that state
        other ones (``StateSync.other_settings``); ``advice``: set when peers cannot dial this
        node (``Reachability.advice``: behind NAT without a relay slot)."""
        if self.last_merged is None:
            return
        quiet = time.time() - self.last_merged
        if quiet < self.alone_after:
            return
        run = self.run_id
        if others_seen and advice:
            alone = Alone("unreachable", f"{others_seen} other node(s) of run '{run}' seen, but no round with them "
                          f"for {quiet:.0f} s: {advice}; nodes behind NAT without a relay cannot dial each other",
                          self.last_merged)
        elif others_seen:
            alone = Alone("no_rounds", f"{others_seen} other node(s) of run '{run}' seen, but no round with them for "
                          f"{quiet:.0f} s: they may not reach this node (check its reachability and announced "
                          "addresses) or be excluding its contributions", self.last_merged)
        elif other_settings:
            kinds = sorted(set(other_settings.values()))
            alone = Alone("other_settings", f"{len(other_settings)} node(s) of run '{run}' use other settings "
                          f"({', '.join(kinds)}; ours: protocol tag {self.tag}): model, fragments, seed, "
                          "wire precision or outer lr, momentum, sync_every differ; use the run's settings",
                          self.last_merged)
        elif self.joined:  # the peers and run ID came from the run's manifest: not the joiner's to check
            alone = Alone("no_peers", f"no other node of run '{run}' seen for {quiet:.0f} s: {JOIN_HINT}",
                          self.last_merged)
        else:
            alone = Alone("no_peers", f"no other node of run '{run}' seen for {quiet:.0f} s: check "
                          "--initial-peers and --run-id", self.last_merged)
        if self.alone is None or self.alone.reason != alone.reason:
            log.warning("training alone, contributing to nobody: %s", alone.detail)
        self.alone = alone
