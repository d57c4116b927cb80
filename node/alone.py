"""No silent solo: the one owner of "when did this node last merge with another node", the
verdict when it merges with nobody (state "alone", with the likely reason), and the exit code of
a node that was meant to join a swarm and never merged with another node (docs/operating.md,
"Exit codes")."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from p2pdiloco.net.transport.addresses import JOIN_HINT

log = logging.getLogger(__name__)

NEVER_MERGED_EXIT = 3  # exit code: given peers to join, ran to the end of its budget, merged with nobody
DAEMON_LOST_EXIT = 4  # exit code: its libp2p daemon (p2pd) died and could not be started again (node.main.keep_daemon)

Reason = Literal["started_alone", "no_peers", "quorum", "no_relay", "other_settings", "unreachable", "no_rounds"]

START_ALONE_HINT = ("no --join or --initial-peers: this node starts a swarm of its own and merges with no other "
                    "node until one joins it; to train with a run pass --join MANIFEST or --initial-peers MULTIADDR")


@dataclass(frozen=True)
class Alone:
    """Why a training node merges with no other node.

    Attributes:
        reason: said from the first seconds: "started_alone" (started with no peers to join:
            ``START_ALONE_HINT``), "no_peers" (given peers, yet no other node of the run seen:
            wrong initial peers or run id, or its nodes are gone), "quorum" (fewer nodes of the
            run with our settings seen than ``outer.min_quorum``: no round can form), "no_relay"
            (behind NAT, it lost every relay slot it held and merged nothing since:
            ``Reachability.lost_relay``; it comes first, as the nodes it no longer sees may be
            gone only for it). Said once
            nothing merged for ``NodeConfig.alone_after`` seconds: "other_settings" (nodes of
            the run seen, all with other settings: they can never merge with this one),
            "unreachable" (nodes of the run with our settings seen, yet no round with them, and
            peers cannot dial this node: behind NAT with no relay slot; ``net.transport.reachability``),
            "no_rounds" (the same while this node is dialable or its reachability unknown).
        detail: one line for a person, naming what to check or pass.
        since: Unix time (s) of the last round merged with another node, or of the start of
            training.
    """

    reason: Reason
    detail: str
    since: float


class AloneWatch:
    """Tracks this node's last round with another member; :meth:`check` sets :attr:`alone`
    (and logs it at WARNING once per reason), a round with another member clears it. A
    volunteer whose node trains alone contributes nothing to the run, so it must not go unseen.

    Args:
        alone_after: seconds without a merge with another node after which nodes of the run
            that are seen, but never merged with, make the node "alone".
        run_id, tag: the run and this node's protocol tag (named in the details).
        min_quorum: ``outer.min_quorum``: the smallest group that may merge.
        meant_to_join: the node was given peers to join (``--join`` or ``--initial-peers``).
    """

    def __init__(self, alone_after: float, run_id: str, tag: str, min_quorum: int = 1,
                 meant_to_join: bool = True) -> None:
        self.alone_after, self.run_id, self.tag = alone_after, run_id, tag
        self.min_quorum, self.meant_to_join = min_quorum, meant_to_join
        self.last_merged: float | None = None  # Unix time; None until training starts
        self.alone: Alone | None = None
        self.joined = False  # set when the node joined an existing run with its manifest (--join)

    def started(self) -> None:
        """Training began: the clock starts; a node given no peers is alone from now on."""
        self.last_merged = time.time()
        if not self.meant_to_join:
            self._set(Alone("started_alone", START_ALONE_HINT, self.last_merged))

    def merged(self) -> None:
        """A round with at least one other member committed."""
        self.last_merged = time.time()
        if self.alone is not None:
            log.info("merging with other nodes again")
            self.alone = None

    def check(self, others_seen: int, other_settings: Mapping[str, str], advice: str | None = None,
              read: bool = True, relay_lost_at: float | None = None) -> None:
        """``others_seen``: other nodes of the run with our settings in the last read of the
        records; ``other_settings``: {peer ID: its settings} of nodes of the run that state
        other ones (``StateSync.other_settings``); ``advice``: set when peers cannot dial this
        node (``Reachability.advice``: behind NAT without a relay slot); ``read``: the records
        were read at least once (before that, only the verdicts that need no read are made);
        ``relay_lost_at``: Unix time (s) at which this node, behind NAT, lost its last relay
        slot (``Reachability.lost_at``), None while it holds one or never held one.
        The first call starts the clock (:meth:`started`) when nothing did."""
        if self.last_merged is None:
            self.started()
        quiet = time.time() - self.last_merged
        run, since = self.run_id, self.last_merged
        if relay_lost_at is not None and since <= relay_lost_at:
            self._set(Alone("no_relay", f"behind NAT, this node lost every relay slot {time.time() - relay_lost_at:.0f} s "
                                        "ago and merged with no node since: peers cannot dial it; it merges again once "
                                        "a relay is back (restart the node to reserve a slot on its initial peers), or "
                                        "forward a port and set swarm.announce", since))
            return
        if read and self.min_quorum > others_seen + 1:
            self._set(Alone("quorum", f"outer.min_quorum is {self.min_quorum} but {others_seen + 1} node(s) of run "
                                      f"'{run}' with this node's settings are seen: no round can form; lower "
                                      "outer.min_quorum (--set outer.min_quorum=N) or start more nodes", since))
            return
        if read and not others_seen and not other_settings:
            if not self.meant_to_join:
                self._set(Alone("started_alone", START_ALONE_HINT, since))
            elif self.joined:  # the peers and run ID came from the run's manifest: not the joiner's to check
                self._set(Alone("no_peers", f"no other node of run '{run}' seen for {quiet:.0f} s: {JOIN_HINT}",
                                since))
            else:
                self._set(Alone("no_peers", f"no other node of run '{run}' seen for {quiet:.0f} s: its nodes may be "
                                            "gone; check --initial-peers and --run-id", since))
            return
        if quiet < self.alone_after:
            if self.alone is not None and self.alone.reason in ("started_alone", "no_peers", "quorum", "no_relay"):
                self.alone = None  # nodes of the run are seen now: they get alone_after to merge
            return
        if others_seen and advice:
            alone = Alone("unreachable", f"{others_seen} other node(s) of run '{run}' seen, but no round with them "
                          f"for {quiet:.0f} s: {advice}; nodes behind NAT without a relay cannot dial each other", since)
        elif others_seen:
            alone = Alone("no_rounds", f"{others_seen} other node(s) of run '{run}' seen, but no round with them for "
                          f"{quiet:.0f} s: they may not reach this node (check its reachability and announced "
                          "addresses) or be excluding its contributions", since)
        else:
            kinds = sorted(set(other_settings.values()))
            alone = Alone("other_settings", f"{len(other_settings)} node(s) of run '{run}' use other settings "
                          f"({', '.join(kinds)}; ours: protocol tag {self.tag}): model, fragments, seed, "
                          "wire precision or outer lr, momentum, sync_every differ; use the run's settings", since)
        self._set(alone)

    def _set(self, alone: Alone) -> None:
        if self.alone is None or self.alone.reason != alone.reason:
            log.warning("training alone, contributing to nobody: %s", alone.detail)
        self.alone = alone

    def exit_code(self, reached: int, budget_ended: bool) -> int:
        """The node's exit code at its end: ``NEVER_MERGED_EXIT`` when it was meant to join a
        swarm, ran to the end of its budget (not stopped by a signal) and reached no other node
        (``reached``: rounds committed with another member, plus rounds merged without its
        contribution that it took, plus states it took from peers: 0 means it trained on its
        own); else 0 (a node started alone on purpose, or stopped by its supervisor)."""
        return NEVER_MERGED_EXIT if self.meant_to_join and budget_ended and not reached else 0
