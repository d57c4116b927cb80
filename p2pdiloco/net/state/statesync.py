"""Global-state transfer, and what this node believes of other peers' claims.

Records: every node publishes one DHT record under ``{run}/heads`` with, per fragment, the
version and digest of the global state it holds; how records are published, pushed, read and
filtered is :mod:`p2pdiloco.net.state.heads_records` (a base of :class:`StateSync`).

Transfer: ``state.get`` returns a fragment's Θ and outer momentum (fp32) with its version and digest; the
receiver installs nothing unless the digest of the bytes it got matches the record it chose.

Trust (docs/trust.md). Records are signed DHT records under their owner's peer ID
(``transport.SignedRecords``): nobody can write another node's record. But a signature
proves who claims a state, not that the claim is honest, so a claim has to be earned:

* **Earned heads** (:mod:`p2pdiloco.net.state.heads`): corroborated versions (a claim counts only
  up to ``LEAD`` versions above what two other peers hold) and the fallback of a node ahead
  alone, applied by the node to the records of the peers it trusts only (:attr:`reputation`,
  ``node.vetting``: trust earned by merged rounds or a vetted state, never by counting holders).
* **Bounded moves** (:mod:`p2pdiloco.net.state.bounded_moves`): a downloaded state that moves Θ (or
  whose momentum would move it) further than recent steps, or this node's own, allow for the
  versions apart is refused (``StateSyncError``; counted in ``refused_states``), and every
  peer whose signed record claims it gets a strike.
* **Deliver or be ignored.** A holder that does not deliver the state it claims (no answer
  within the deadline: ``STATE_TIMEOUT_S`` + size / ``MIN_RATE``, or over this node's own
  measured link rate when slower, ``LinkMeter.held_to``) gets a strike; one that
  does not even begin its answer within :meth:`StateSync.first_reply_s` (a few times this
  node's recent transfer times: a staller costs a fraction of a second, not the transfer's
  deadline) gets one too, or from the second time in a row if it delivered to us before; other
  failed deliveries (truncated, refused, an older state than claimed; a newer one is an honest
  holder that moved on) count a strike from the second in a row. A holder with strikes has its
  records ignored for ``IGNORE_S`` × 2^(strikes − 1) seconds (at most ``IGNORE_MAX_S``; ``net.state.strikes``); a
  successful delivery clears its strikes. Rotating digests do not reset anything: strikes
  belong to the peer. Answers that no honest peer sends (a header out of range, a body of the
  wrong size, too short or over the state's bytes, bytes that do not hash to the digest the
  answer states) ban the sender.
* Concurrent downloads of one (fragment, version, digest) share one transfer.

A state it cannot fetch is a state it cannot merge at (invariant I3): ignoring a dead or
lying holder lets the swarm go on from the newest state a live peer holds. If an ignored
peer comes back, its claims count again afterwards and the heads rule (I7) settles any split.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence

from p2pdiloco.core.fragments import Fragment
from p2pdiloco.core.outer import FragmentState
from p2pdiloco.errors import ProtocolError, StateSyncError
from p2pdiloco.net.state import deltas
from p2pdiloco.net.records import parse as rec
from p2pdiloco.net.codecs import wire
from p2pdiloco.net.state.downloads import Downloads
from p2pdiloco.net.state.bounded_moves import FOLLOW_HISTORY, distance, implausible
from p2pdiloco.net.records.patches import Received
from p2pdiloco.net.state.heads_records import PUSH_DEFER_S, HeadsRecords
from p2pdiloco.net.records.pushes import Pusher
from p2pdiloco.net.records.parse import HeadsRecord
from p2pdiloco.net.state.strikes import Strikes
from p2pdiloco.net.transport.swarm import Header, Swarm
from p2pdiloco.trust.reputation import Reputation

log = logging.getLogger(__name__)


class StateSync(HeadsRecords, Downloads):
    """Publishes this node's record and transfers fragment states. One per node; the owner of
    what this node believes about other peers' claims (refused states, strikes, ignores).

    Args:
        swarm: the transport.
        run_id: the run's name.
        fragments: the model's fragments.
        committed: callable returning this node's committed states, one per fragment
            (``node.committed.CommittedStates.states``).
        on_event: called as ``on_event("download_failed", fragment=, version=, donor=, reason=)``
            for each failed download (the node's journal); None: nothing is called.
    """

    def __init__(self, swarm: Swarm, run_id: str, fragments: Sequence[Fragment],
                 committed: Callable[[], Sequence[FragmentState]], on_event: Callable[..., None] | None = None,
                 tag: str = "", outer: tuple[float, float] = (0.0, 0.0), rounds: tuple[int, str] | None = None):
        self.swarm, self.run_id, self.fragments, self.committed = swarm, run_id, tuple(fragments), committed
        self.outer_lr, self.outer_momentum = outer  # the run's outer lr and μ: the momentum bound (_check_plausible)
        # catch-ups as deltas (net.state.deltas), given (H, wire precision); None: full states only
        self.deltas = None if rounds is None else deltas.Deltas(swarm, self.fragments, self.state_bytes, *rounds, outer)
        self.on_event, self.tag = on_event, tag  # tag: our protocol tag (records with another are not ours to follow)
        # nodes of this run that cannot merge with us (``other_settings``): peer -> (tag or "other fragment count", seen at)
        self._other_settings: dict[str, tuple[str, float]] = {}
        self.downloads = self.failed_downloads = 0
        self.fetched: dict[int, tuple[int, int]] = {}  # fragment -> (payload bytes, rounds: 0 for the state) of its last download
        self.refused_states = 0  # downloads refused as implausible (see the module docstring)
        self._seen: dict[int, FragmentState] = {}  # last committed state observed, per fragment
        self._shared: dict[int, int] = {}  # fragment -> version of the last state another peer held too
        self._steps: dict[int, deque[float]] = {i: deque(maxlen=FOLLOW_HISTORY) for i in range(len(self.fragments))}
        self._own: dict[int, float] = {}  # fragment -> the outer step this node's own last contribution would make
        self._refused: set[tuple[int, int, str]] = set()  # (fragment, version, digest) not to follow
        # states this node followed (downloaded): not steps of its own rounds, so _observe does not count them
        self._followed: deque[tuple[int, int, str]] = deque(maxlen=64)
        self._vetted: dict[tuple[int, int, str], FragmentState] = {}  # checked by node.vetting, to install
        self.reputation: Reputation | None = None  # the node's (p2pdiloco.trust.reputation): refusals lower it
        self.strikes = Strikes()  # holders that did not deliver, and the peers ignored (net.state.strikes)
        self._pending: dict[tuple[int, int, str, bool], asyncio.Future] = {}
        self._donors: dict[str, None] = {}  # holders that delivered a state to us (insertion-ordered set)
        self._took: deque[float] = deque(maxlen=FOLLOW_HISTORY)  # seconds of recent successful downloads
        self._changed: dict[str, tuple[float, float]] = {}  # peer -> (its record's t, monotonic s we first saw it)
        self.pusher = Pusher(swarm, "st.heads", PUSH_DEFER_S, 1, rec.BEAT_S)  # pushes our record to the learners we know
        self._known_by: set[str] | None = None  # peers that know what our next publish changes (known_by)
        self.pushes_received: Counter[str] = Counter()  # "received", "other_run", "ignored" (refused)
        self.on_heard: Callable[[str, bool], object] = self.pusher.heard_from  # a peer pushed (hello?): the node widens it
        self._pushed: dict[str, HeadsRecord] = {}  # author -> its newest pushed record, oldest author first
        self.patches = Received(lambda peer, why: self.swarm.drop(peer, why))  # bases of authors' patches
        self._mine: HeadsRecord | None = None  # our last published record
        self._stored: tuple[float, str] = (-math.inf, "")  # monotonic s and life-cycle state of our last DHT store
        self._state: tuple[str, float] = ("", -math.inf)  # our life-cycle state and since when (monotonic s)
        self._pushed_at = -math.inf  # monotonic s of the last record pushed to us
        self._heard = asyncio.Event()  # set at every record pushed to us (greet waits on it)
        self._read: tuple[float, dict[str, HeadsRecord], set[str]] = (-math.inf, {}, set())  # last DHT read:
        # (monotonic s it began, parsed records, every author under the key)

    async def start(self) -> None:
        """Serve ``state.get``, then check that the swarm accepts us (``Swarm.check_admission``
        on the records' owners).

        Raises:
            AccessDenied: the swarm's members refuse this node (private swarm, no valid
                certificate); the message carries their reason.
        """
        await self.swarm.add_handler("state.get", self._on_get, max_payload=0)
        if self.deltas is not None:
            await self.swarm.add_handler("state.deltas", self.deltas.serve, max_payload=0)
        await self.swarm.add_handler("st.heads", self._on_heads, max_payload=0)
        await self.swarm.check_admission(self.heads_key)

    def state_bytes(self, fragment: int) -> int:
        """Bytes of fragment ``fragment``'s state on the wire (Θ and b, fp32)."""
        shapes = [s.shape for s in self.fragments[fragment].slots]
        return wire.wire_nbytes(shapes + shapes, "fp32")

    def _observe(self) -> None:
        """Record the per-version step of every fragment whose committed state moved on."""
        for p, state in enumerate(self.committed()):
            prev = self._seen.get(p)
            followed = (p, state.version, state.digest) in self._followed
            if prev is not None and state.version > prev.version and p in self._steps and not followed:
                step = distance(prev, state) / (state.version - prev.version)
                if math.isfinite(step):
                    self._steps[p].append(step)
            self._seen[p] = state
            self._shared.setdefault(p, state.version)  # the state we started from came from the swarm

    def shared(self, fragment: int, version: int) -> None:
        """Record that another peer held ``fragment`` at ``version`` too (a group formed at it,
        or a state was downloaded): the common ancestor of a later divergence, see
        :meth:`_check_plausible`."""
        self._observe()
        self._shared[fragment] = version

    def own_step(self, fragment: int, size: float) -> None:
        """Record the outer step (L2 distance of Θ) this node's own contribution to ``fragment``
        would make alone (lr·(1 + μ)·‖Δ‖ from a zero buffer, per H steps of progress, times the
        periods one version may hold: ``bounded_moves.periods_per_version``): one honest step no
        peer can inflate, bounding followed states (:meth:`_check_plausible`:
        ``FOLLOW_FACTOR`` times it per version, at most ``OWN_RELATIVE`` × ‖Θ‖; once this node
        has seen steps, when larger than the largest of them). Non-finite or negative sizes are ignored."""
        if math.isfinite(size) and size >= 0:
            self._own[fragment] = size

    def has_seen_steps(self, fragment: int) -> bool:
        """Whether this node has seen a step of ``fragment`` (else it is joining it)."""
        self._observe()
        return bool(self._steps.get(fragment))

    def _check_plausible(self, state: FragmentState) -> None:
        """Raise StateSyncError when ``state`` is not a plausible successor of ours
        (:func:`p2pdiloco.net.state.bounded_moves.implausible`)."""
        self._observe()
        p = state.index
        mine = self.committed()[p]
        reason = implausible(state, mine, self._shared.get(p, mine.version), self._steps.get(p, ()),
                             self._own.get(p, 0.0), self.outer_lr, self.outer_momentum)
        if reason is None:
            return
        self._refused.add((p, state.version, state.digest))
        self.refused_states += 1
        log.warning("not following fragment %d v%d (%s): %s", p, state.version, state.short(), reason)
        raise StateSyncError(f"fragment {p} v{state.version} refused: {reason}")

    def refuse(self, states: Iterable[FragmentState], holders: Iterable[str], reason: str) -> None:
        """Never follow any of ``states`` (each its fragment, version and digest) again; each of
        ``holders`` claimed them: struck once for them all (ignored for a doubling while: a bound
        is evidence, not proof, so no ban) and, with :attr:`reputation`, refuted. ``reason``:
        why they were refused."""
        for state in states:
            key = (state.index, state.version, state.digest)
            self.refused_states += key not in self._refused  # once per state (_check_plausible counts its own)
            self._refused.add(key)
        for holder in holders:
            self.strikes.strike(holder, reason, hard=True)
            if self.reputation is not None:
                self.reputation.refuted(holder, reason)

    def keep_vetted(self, states: Iterable[FragmentState]) -> None:
        """States the node checked before trusting their holder (``node.vetting``): the download
        of the follow that installs one returns it instead of fetching it again."""
        for st in states:
            self._vetted[(st.index, st.version, st.digest)] = st
        while len(self._vetted) > 4 * len(self.fragments):  # bounded: the oldest go
            del self._vetted[next(iter(self._vetted))]

    def _delivered(self, peer: str) -> None:
        self.strikes.delivered(peer)
        self._donors[peer] = None
        if len(self._donors) > 4096:  # bounded: forget the oldest donors
            for p in list(self._donors)[:1024]:
                del self._donors[p]

    async def _on_get(self, peer: str, header: Header, __: bytes) -> tuple[Header, bytes]:
        try:
            request = rec.parse_state_request(header, len(self.fragments))
        except ProtocolError:
            self.swarm.drop(peer, "state_request")
            raise
        state = self.committed()[request.fragment]
        body = wire.encode_view(list(state.theta) + list(state.momentum))  # one copy, not two
        return {"v": state.version, "d": rec.wire_digest(state.digest), "l": state.ledger.to_list()}, body

