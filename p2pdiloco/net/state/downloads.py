"""Downloads of a fragment's global state from its holders (``state.get``), for :class:`StateSync`:
a holder picked round-robin by this node's peer ID and the fragment, then the others in turn;
deadlines from the state's size and the slowest recent download; every answer parsed at the
records boundary, its digest recomputed and its move checked as plausible before it is returned
(docs/architecture.md, "Late nodes and split brain"; docs/trust.md, "Earned claims").
"""

from __future__ import annotations

import asyncio
import hashlib
import logging

from p2pdiloco.net.transport import clock as swarm_clock
from p2pdiloco.core.outer import FragmentState, fragment_digest
from p2pdiloco.errors import NetworkError, PeerSilent, PeerTimeout, ProtocolError, ReplyTooLarge, StateSyncError
from p2pdiloco.net.records import parse as rec
from p2pdiloco.net.codecs import wire
from p2pdiloco.net.state.heads import Head


log = logging.getLogger(__name__)

STATE_TIMEOUT_S = 3.0  # seconds of a state download's deadline, plus its size over MIN_RATE
MIN_RATE = 256 * 1024  # bytes/s: the donor rate a download's first deadline assumes; ...
SLOW_DONOR_RATE = 16 * 1024  # ... a donor measured slower, but at least this fast, gets the time its rate needs
FIRST_REPLY_S = 1.0  # seconds a holder has to begin its answer once the stream is open, before any download...
FIRST_REPLY_FACTOR = 4.0  # ... then this many times the slowest recent download,
FIRST_REPLY_MIN_S = 0.5  # ... but never less than this (seconds), nor more than STATE_TIMEOUT_S


class Downloads:
    """The download side of :class:`~p2pdiloco.net.state.statesync.StateSync` (which holds the
    state these methods read: swarm, fragments, strikes, follow history, transfer counters)."""

    def first_reply_s(self) -> float:
        """Seconds a holder has to begin its answer to ``state.get`` once the stream is open
        (``Swarm.call``'s ``first_reply``): ``FIRST_REPLY_FACTOR`` × the slowest of the last
        ``FOLLOW_HISTORY`` successful downloads (whole transfers, dialing included, so an upper
        bound of their first replies), within [``FIRST_REPLY_MIN_S``, ``STATE_TIMEOUT_S``] (the
        bound x MIN_RATE / ``LinkMeter.held_to`` on a slower own link); ``FIRST_REPLY_S`` before
        any download succeeded. An honest holder answers about one round trip after the request
        (it serves a committed state from memory); a silent one is caught here, not at the end."""
        if not self._took:
            return FIRST_REPLY_S
        cap = STATE_TIMEOUT_S * MIN_RATE / self.swarm.stats.link.held_to(MIN_RATE)
        return min(cap, max(FIRST_REPLY_MIN_S, FIRST_REPLY_FACTOR * max(self._took)))

    async def download(self, fragment: int, head: Head, *, timeout: float | None = None,
                       joining: bool = False, newer: bool = False) -> FragmentState:
        """Fetch ``fragment`` at ``head`` from one of its holders, trying them in turn, starting
        at a holder picked by this node's peer ID and the fragment index (round-robin), so
        newcomers spread over donors and one newcomer spreads its fragments over them.
        ``timeout`` (seconds per holder) defaults to ``STATE_TIMEOUT_S`` + size / ``MIN_RATE``
        (or over this node's measured link rate when slower, at most 16 x: ``LinkMeter.held_to``);
        a holder whose answer arrives slower, at ``SLOW_DONOR_RATE`` or faster (measured over the
        bytes received so far), gets the time its rate needs (``Swarm.call``'s ``min_rate``):
        a donor on a slow link is slow, not a failure.
        ``joining``: this node is joining the swarm; the request says so (``"join"``).
        ``newer``: a holder that moved on since its record (it serves a newer version) gives that
        state, checked like any other (its own digest, the bounded move), instead of a failure
        (``node.vetting``, which evaluates what it downloads).
        Concurrent calls for the same head share one transfer.

        Raises:
            StateSyncError: no holder returned a state whose digest matches ``head``, or the
                state is not a plausible successor of ours (see the module docstring).
        """
        key = (fragment, head.version, head.digest)
        if key in self._refused:
            raise StateSyncError(f"fragment {fragment} v{head.version} was refused before")
        if (vetted := self._vetted.pop(key, None)) is not None:  # downloaded and checked already (vet)
            return vetted
        shared = (*key, newer)  # a download that may give a newer state is not shared with one that may not
        pending = self._pending.get(shared)
        if pending is not None:
            return await asyncio.shield(pending)
        fut = asyncio.get_running_loop().create_future()
        self._pending[shared] = fut
        try:
            state = await self._download(fragment, head, timeout, joining, newer)
        except BaseException as e:
            if not fut.done():
                fut.set_exception(e if isinstance(e, Exception) else StateSyncError("download cancelled"))
            fut.exception()  # retrieved: waiters get it, nobody else needs to
            raise
        else:
            fut.set_result(state)
            return state
        finally:
            del self._pending[shared]

    async def _download(self, fragment: int, head: Head, timeout: float | None, joining: bool,
                        newer: bool = False) -> FragmentState:
        if timeout is None:
            timeout = STATE_TIMEOUT_S + self.state_bytes(fragment) / self.swarm.stats.link.held_to(MIN_RATE)
        donors = sorted(p for p in head.holders if p != self.swarm.peer_id)
        if donors:
            start = (int.from_bytes(hashlib.sha256(self.swarm.peer_id.encode()).digest()[:4], "big") + fragment) % len(donors)
            donors = donors[start:] + donors[:start]
        last = "no other holder"
        donors = [d for d in donors if d not in self.swarm.bans and d not in self.strikes.ignoring()]
        if self.deltas is not None and donors:  # the rounds missed, if a holder has them and they cost less
            t0, mine = swarm_clock.monotonic(), self.committed()[fragment]
            try:
                got = await self.deltas.fetch(donors[0], mine, head, STATE_TIMEOUT_S + self.deltas.most[fragment]
                                              / self.swarm.stats.link.held_to(MIN_RATE), self.first_reply_s())
            except NetworkError as e:  # struck as a failed download; the state from the others first
                self.strikes.strike(donors[0], f"did not deliver the rounds of fragment {fragment}: {e}",
                             hard=isinstance(e, PeerTimeout))
                donors, got = donors[1:] + donors[:1], None
            if got is not None:
                return self._accept(fragment, head, donors[0], got[0], t0, got[1], head.version - mine.version)
        for donor in donors:
            if donor in self.swarm.bans:  # its rounds just did not compute
                continue
            t0 = swarm_clock.monotonic()
            try:
                state = await self._fetch(donor, fragment, timeout, joining)
            except (NetworkError, StateSyncError) as e:
                self.failed_downloads += 1
                # silence past the whole deadline strikes at once; past the first-reply deadline
                # too, unless the holder delivered to us before (that deadline adapts to this
                # machine's recent transfers: one busy moment of a known donor is forgiven)
                self.strikes.strike(donor, f"did not deliver fragment {fragment} v{head.version}: {e}",
                             hard=isinstance(e, PeerTimeout) and not (isinstance(e, PeerSilent) and donor in self._donors))
                last = str(e)
                self._failed(fragment, head.version, donor, e)
                continue
            if (state.version, state.digest) == (head.version, head.digest):
                return self._accept(fragment, head, donor, state, t0, self.state_bytes(fragment), 0)
            if newer and state.version > head.version:
                return self._accept(fragment, Head(state.version, state.digest, (donor,)), donor, state, t0,
                                    self.state_bytes(fragment), 0)
            if state.version <= head.version:  # a holder that moved on since its record is honest
                self.strikes.strike(donor, f"served v{state.version} of fragment {fragment}, not the v{head.version} "
                                    "it claims", hard=False)
            last = f"{donor[-8:]} now holds v{state.version}, not v{head.version}"
        raise StateSyncError(f"fragment {fragment} v{head.version}: {last}")

    def _accept(self, fragment: int, head: Head, donor: str, state: FragmentState, t0: float, nbytes: int,
                rounds: int) -> FragmentState:
        """A download of ``head`` that matches its digest, from ``donor`` (started at ``t0``; ``nbytes``
        of payload, the state's or those of ``rounds`` rounds): checked for plausibility
        (``StateSyncError`` if not), counted (``fetched``), returned."""
        self._delivered(donor)
        if not rounds:  # whole states only: first_reply_s bounds the first reply of a state download
            self._took.append(swarm_clock.monotonic() - t0)
        try:
            self._check_plausible(state)  # same bytes from every holder: no other donor to try
        except StateSyncError as e:
            # a statistical bound, not a proof: every holder is ignored for a while
            # (strikes double), none is banned for the rest of the run
            self.refuse(state, head.holders, str(e))
            raise
        self.downloads += 1
        self.fetched[fragment] = (nbytes, rounds)
        self._shared[fragment] = state.version
        self._followed.append((fragment, state.version, state.digest))
        return state

    def _failed(self, fragment: int, version: int, donor: str, e: Exception) -> None:
        log.info("state download of fragment %d from %s failed: %s", fragment, donor[-8:], e)
        if self.on_event is not None:
            self.on_event("download_failed", fragment=fragment, version=version, donor=donor, reason=str(e))

    async def _fetch(self, donor: str, fragment: int, timeout: float, joining: bool) -> FragmentState:
        request = {"f": fragment, "join": True} if joining else {"f": fragment}  # "join": a node joining the swarm
        try:
            reply, body = await self.swarm.call(donor, "state.get", request, timeout=timeout,
                                                max_reply=self.state_bytes(fragment), first_reply=self.first_reply_s(),
                                                min_rate=SLOW_DONOR_RATE)
        except ReplyTooLarge as e:  # an honest holder answers with exactly the state's bytes
            self.swarm.ban(donor, f"state answer for fragment {fragment} of the wrong size ({e})")
            raise StateSyncError(f"malformed state from {donor[-8:]}: {e}") from None
        try:
            answer = rec.parse_state_answer(reply)
        except ProtocolError as e:
            self.swarm.drop(donor, "state_answer")
            self.swarm.ban(donor, f"malformed state answer: {e}")
            raise StateSyncError(f"malformed state answer from {donor[-8:]}: {e}") from None
        shapes = [s.shape for s in self.fragments[fragment].slots]
        try:  # the tensors are views of the payload, which the transport read into one buffer: held once
            tensors = wire.decode(body, shapes + shapes, "fp32", adopt=True)
        except ProtocolError as e:  # the transport read exactly the size it declared: no honest answer
            self.swarm.ban(donor, f"state answer for fragment {fragment} of the wrong size ({e})")
            raise StateSyncError(f"malformed state from {donor[-8:]}: {e}") from None
        n = len(shapes)
        theta, momentum = tensors[:n], tensors[n:]
        if fragment_digest(fragment, answer.version, theta, momentum, answer.ledger) != answer.digest:
            self.swarm.ban(donor, f"state answer for fragment {fragment} does not match the digest it states")
            raise StateSyncError(f"state from {donor[-8:]} does not match its digest")
        return FragmentState.adopt(fragment, answer.version, theta, momentum, answer.ledger)

