"""Swarm records and global-state transfer.

Records: every node publishes one DHT record under ``{run}/heads`` (subkey: its peer ID)
with, per fragment, the version and digest of the global state it holds, plus heartbeat
figures (inner step, tokens/s, loss). Readers pick, per fragment, the newest version; at a
version held with two digests (two groups merged the same version: split brain, invariant
I7) the digest held by more peers wins, ties to the smaller digest, so every node resolves
it the same way and the losers re-sync.

Transfer: ``state.get`` returns a fragment's Θ and outer momentum (fp32) with its version
and digest; the receiver recomputes the digest over the bytes it got and installs nothing
unless it matches the record it chose (a partial or stale download is discarded).

Trust: records are signed DHT records under their owner's peer ID (``transport.SignedRecords``):
nobody can write or overwrite another node's record, and entries under a subkey that is not
an Ed25519 peer ID are ignored, so every holder counted by :func:`newest_heads` is a peer that
signed its claim. A download is accepted only from a holder and only if the digest over the
received bytes equals the (version, digest) of those signed records. On start, a node asks a
few record owners whether they accept it (``trust.hello``): a node refused by a private swarm
stops with the members' reason instead of training alone.

Plausible follows. A signature proves who published a state, not that it came from an honest
merge: a member alone in its group (K = 1) merges only its own contribution, so a poisoning
member could publish a wrecked state at a higher version and every node would follow it. A
downloaded state is therefore refused (``StateSyncError``; counted in ``refused_states``) when
it is not finite, or when it moves Θ away from this node's committed state by more than
``FOLLOW_RELATIVE`` × (versions ahead) × ‖Θ‖ of that state, or, once this node has seen a step
of that fragment, by more than ``FOLLOW_FACTOR`` × (versions ahead) × the median of the last
``FOLLOW_HISTORY`` per-version steps it saw (its own commits and accepted follows). Both bounds
are far above honest steps (momentum grows a step at most about 1.5 times per version); a
wrongly refused state is followed anyway once a later version is within the bounds.
Refused (version, digest) pairs, and every record of a banned peer, are left out of
:meth:`StateSync.records`, so the heads rule looks past them. Source of the rule: the same
median-norm bound as the robust merge (``core.merge.robust_merge``), applied to outer steps.

Unreachable heads. A state that no holder could deliver ``UNREACHABLE_AFTER`` times in a row
(its only holders died: their records outlive them by up to ``HEAD_TTL``) is left out of
:meth:`StateSync.records` for ``UNREACHABLE_S`` seconds, so the swarm goes on from the newest state a live peer holds
instead of retrying a dead donor before every round; a state it cannot fetch is a state it
cannot merge at (invariant I3). If the holder comes back, its state counts again afterwards
and the heads rule (I7) settles any split.
"""

from __future__ import annotations

import hashlib
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from p2pdiloco.core.fragments import Fragment
from p2pdiloco.core.outer import FragmentState, fragment_digest
from p2pdiloco.errors import NetworkError, ProtocolError, StateSyncError
from p2pdiloco.net import wire
from p2pdiloco.net.transport import Header, Swarm
from p2pdiloco.trust.identity import is_peer_id

log = logging.getLogger(__name__)

HEAD_TTL = 60.0  # seconds a heartbeat record lives without refresh
FOLLOW_FACTOR = 10.0  # a followed state may move Θ this many times the median recent step per version
FOLLOW_HISTORY = 16  # recent per-version steps kept per fragment
UNREACHABLE_AFTER = 3  # downloads of a head that failed at every holder, in a row, before it is ignored
UNREACHABLE_S = 15.0  # seconds a head no holder could deliver is ignored
FOLLOW_RELATIVE = 4.0  # ... and at most this many times ‖Θ‖ per version, even before any step was seen


@dataclass(frozen=True)
class Head:
    """The swarm's newest state of one fragment, and who holds it."""

    version: int
    digest: str
    holders: tuple[str, ...]


def newest_heads(records: dict[str, Any], num_fragments: int) -> list[Head | None]:
    """Per fragment, the winning (version, digest) among peers' records and its holders.

    Rule (invariant I7): highest version; at equal versions, most holders, then the smaller
    digest. Malformed records are ignored.
    """
    votes: list[dict[tuple[int, str], list[str]]] = [{} for _ in range(num_fragments)]
    for peer, rec in records.items():
        frags = rec.get("f") if isinstance(rec, dict) else None
        if not isinstance(frags, list) or len(frags) != num_fragments:
            continue
        for p, item in enumerate(frags):
            if isinstance(item, list) and len(item) == 2 and type(item[0]) is int and isinstance(item[1], str) \
                    and len(item[1]) == 64:
                votes[p].setdefault((item[0], item[1]), []).append(peer)
    heads: list[Head | None] = []
    for v in votes:
        if not v:
            heads.append(None)
            continue
        (version, digest), holders = max(v.items(), key=lambda kv: (kv[0][0], len(kv[1]), _neg(kv[0][1])))
        heads.append(Head(version, digest, tuple(sorted(holders))))
    return heads


def _neg(digest: str) -> tuple[int, ...]:
    return tuple(-ord(c) for c in digest)


def is_behind(mine: FragmentState, head: Head | None) -> bool:
    """True when ``head`` should replace ``mine`` (newer version, or same version, other digest)."""
    if head is None:
        return False
    return head.version > mine.version or (head.version == mine.version and head.digest != mine.digest)


class StateSync:
    """Publishes this node's record and transfers fragment states. One per node.

    Args:
        swarm: the transport.
        run_id: the run's name.
        fragments: the model's fragments.
        current: callable returning this node's committed global states (one per fragment).
    """

    def __init__(self, swarm: Swarm, run_id: str, fragments: Sequence[Fragment],
                 current: Callable[[], Sequence[FragmentState]]):
        self.swarm, self.run_id, self.fragments, self.current = swarm, run_id, tuple(fragments), current
        self.downloads = 0
        self.failed_downloads = 0
        self.refused_states = 0  # downloads refused as implausible (see the module docstring)
        self._seen: dict[int, FragmentState] = {}  # last committed state observed, per fragment
        self._steps: dict[int, deque[float]] = {i: deque(maxlen=FOLLOW_HISTORY) for i in range(len(self.fragments))}
        self._refused: set[tuple[int, int, str]] = set()  # (fragment, version, digest) not to follow
        self._unreachable: dict[tuple[int, int, str], float] = {}  # same key -> ignored until (monotonic s)
        self._failed: dict[tuple[int, int, str], int] = {}  # same key -> downloads failed in a row

    @property
    def heads_key(self) -> str:
        return f"{self.run_id}/heads"

    async def start(self) -> None:
        """Serve ``state.get``, then check that the swarm accepts us (``Swarm.check_admission``
        on the records' owners).

        Raises:
            AccessDenied: the swarm's members refuse this node (private swarm, no valid
                certificate); the message carries their reason.
        """
        await self.swarm.add_handler("state.get", self._on_get)
        await self.swarm.check_admission(self.heads_key)

    async def publish(self, extra: dict[str, Any]) -> None:
        """Store this node's record: per-fragment [version, digest] plus ``extra`` figures."""
        record = {"f": [[s.version, s.digest] for s in self.current()], "t": time.time(), **extra}
        await self.swarm.store(self.heads_key, self.swarm.peer_id, record, HEAD_TTL)

    async def records(self) -> dict[str, Any]:
        """Every live node's record, {peer ID: record}: only records under a peer ID, which
        the DHT accepted only when signed by that peer (and, in a private swarm, a member),
        none of a banned peer, and with every refused (version, digest) replaced by None."""
        self._observe()
        now = time.monotonic()
        self._unreachable = {k: t for k, t in self._unreachable.items() if t > now}
        skip = self._refused | self._unreachable.keys()
        out = {}
        for peer, rec in (await self.swarm.get(self.heads_key)).items():
            if not is_peer_id(peer) or peer in self.swarm.bans:
                continue
            frags = rec.get("f") if isinstance(rec, dict) else None
            if skip and isinstance(frags, list):
                rec = dict(rec, f=[None if isinstance(item, list) and len(item) == 2
                                   and (p, item[0], item[1]) in skip else item
                                   for p, item in enumerate(frags)])
            out[peer] = rec
        return out

    def _observe(self) -> None:
        """Record the per-version step of every fragment whose committed state moved on."""
        for p, state in enumerate(self.current()):
            prev = self._seen.get(p)
            if prev is not None and state.version > prev.version and p in self._steps:
                step = _distance(prev, state) / (state.version - prev.version)
                if math.isfinite(step):
                    self._steps[p].append(step)
            self._seen[p] = state

    def _check_plausible(self, state: FragmentState) -> None:
        """Raise StateSyncError when ``state`` is not a plausible successor of ours."""
        self._observe()
        p = state.index
        if not all(bool(torch.isfinite(t).all()) for t in (*state.theta, *state.momentum)):
            reason = "it is not finite"
        else:
            mine, steps = self.current()[p], self._steps.get(p, ())
            k, jump = max(1, state.version - mine.version), _distance(mine, state)
            size = math.sqrt(sum(float(torch.linalg.vector_norm(t)) ** 2 for t in mine.theta))
            bounds = [(FOLLOW_RELATIVE * k * size, f"{FOLLOW_RELATIVE:g} x {k} version(s) x |theta| {size:.3g}")]
            if steps and statistics.median(steps) > 0:
                median = statistics.median(steps)
                bounds.append((FOLLOW_FACTOR * k * median,
                               f"{FOLLOW_FACTOR:g} x {k} version(s) x the median recent step {median:.3g}"))
            over = [text for bound, text in bounds if jump > bound]
            if not over:
                return
            reason = f"it moves the parameters by {jump:.3g}, over {over[-1]}"
        self._refused.add((p, state.version, state.digest))
        self.refused_states += 1
        log.warning("not following fragment %d v%d (%s): %s", p, state.version, state.short(), reason)
        raise StateSyncError(f"fragment {p} v{state.version} refused: {reason}")

    async def download(self, fragment: int, head: Head, *, timeout: float, joining: bool = False) -> FragmentState:
        """Fetch ``fragment`` at ``head`` from one of its holders, trying them in turn, starting
        at a holder picked by this node's peer ID and the fragment index (round-robin), so
        newcomers spread over donors and one newcomer spreads its fragments over them.
        ``joining``: this node is joining the swarm; the request says so (``"join"``), which the
        ``kill-in-state-transfer`` fault injection keys on.

        Raises:
            StateSyncError: no holder returned a state whose digest matches ``head``, or the
                state is not a plausible successor of ours (see the module docstring).
        """
        if (fragment, head.version, head.digest) in self._refused:
            raise StateSyncError(f"fragment {fragment} v{head.version} was refused before")
        donors = sorted(p for p in head.holders if p != self.swarm.peer_id)
        if donors:
            start = (int.from_bytes(hashlib.sha256(self.swarm.peer_id.encode()).digest()[:4], "big") + fragment) % len(donors)
            donors = donors[start:] + donors[:start]
        last = "no other holder"
        for donor in donors:
            try:
                state = await self._fetch(donor, fragment, timeout, joining)
            except (NetworkError, StateSyncError) as e:
                self.failed_downloads += 1
                last = str(e)
                log.info("state download of fragment %d from %s failed: %s", fragment, donor[-8:], e)
                continue
            if (state.version, state.digest) == (head.version, head.digest):
                self._check_plausible(state)  # same bytes from every holder: no other donor to try
                self.downloads += 1
                self._failed.pop((fragment, head.version, head.digest), None)
                return state
            last = f"{donor[-8:]} now holds v{state.version}, not v{head.version}"
        key = (fragment, head.version, head.digest)
        self._failed = {k: n for k, n in self._failed.items() if k[0] != fragment or k[1] >= head.version}
        self._failed[key] = self._failed.get(key, 0) + 1
        if donors and self._failed[key] >= UNREACHABLE_AFTER:  # look past this state for a while
            del self._failed[key]
            self._unreachable[key] = time.monotonic() + UNREACHABLE_S
        raise StateSyncError(f"fragment {fragment} v{head.version}: {last}")

    async def _fetch(self, donor: str, fragment: int, timeout: float, joining: bool) -> FragmentState:
        request = {"f": fragment, "join": True} if joining else {"f": fragment}  # "join": a node joining the swarm
        reply, body = await self.swarm.call(donor, "state.get", request, timeout=timeout)
        try:
            version, digest = int(reply["v"]), str(reply["d"])
        except (KeyError, TypeError, ValueError):
            raise StateSyncError("malformed state reply") from None
        shapes = [s.shape for s in self.fragments[fragment].slots]
        try:
            tensors = wire.decode(body, shapes + shapes, "fp32")
        except ProtocolError as e:
            raise StateSyncError(f"partial or malformed state from {donor[-8:]}: {e}") from None
        n = len(shapes)
        theta, momentum = tensors[:n], tensors[n:]
        if fragment_digest(fragment, version, theta, momentum) != digest:
            raise StateSyncError(f"state from {donor[-8:]} does not match its digest")
        return FragmentState.create(fragment, version, theta, momentum)

    async def _on_get(self, _: str, header: Header, __: bytes) -> tuple[Header, bytes]:
        try:
            fragment = int(header["f"])
            state = self.current()[fragment]
        except (KeyError, TypeError, ValueError, IndexError):
            raise ProtocolError("malformed state request") from None
        body = wire.encode(list(state.theta) + list(state.momentum), "fp32")
        return {"v": state.version, "d": state.digest}, body


def _distance(a: FragmentState, b: FragmentState) -> float:
    """L2 distance between two states' Θ (over all tensors of the fragment)."""
    return math.sqrt(sum(float(torch.linalg.vector_norm(x - y)) ** 2 for x, y in zip(a.theta, b.theta)))
