"""Deliver or be ignored: the strikes of holders that did not deliver the states they claim
(docs/trust.md, "Earned claims"; ``net.state.statesync``'s module docstring). A hard failure (no
answer in time) strikes at once, a soft one (truncated, refused, an older state) from the
second in a row; a holder with n strikes has its records ignored for ``IGNORE_S`` ×
2^(n − 1) seconds, at most ``IGNORE_MAX_S``; a successful delivery clears its strikes."""

from __future__ import annotations

import logging

from p2pdiloco.net.transport import clock as swarm_clock

__all__ = ["IGNORE_MAX_S", "IGNORE_S", "Strikes"]

log = logging.getLogger(__name__)

IGNORE_S = 15.0  # seconds a holder that did not deliver is ignored after its first strike (doubling)
IGNORE_MAX_S = 600.0
MAX_STRUCK = 4096  # holders whose strikes are kept (the ones with the fewest are forgotten first)


class Strikes:
    """One node's strikes and the peers it ignores (module docstring). Owned by its ``StateSync``.

    Attributes:
        ignored: peer ID -> (monotonic s until which its records are ignored, reason).
    """

    def __init__(self) -> None:
        self._strikes: dict[str, int] = {}  # holder -> failed deliveries not yet cleared by a success
        self._soft: dict[str, int] = {}  # holder -> failures that strike only from the second in a row
        self.ignored: dict[str, tuple[float, str]] = {}

    def ignore(self, peer: str, seconds: float, reason: str) -> None:
        """Ignore ``peer``'s records for ``seconds`` (a claim it did not earn), no strike."""
        self.ignored[peer] = (swarm_clock.monotonic() + seconds, reason)
        log.info("ignoring the records of %s for %.0f s: %s", peer[-8:], seconds, reason)

    def strike(self, peer: str, reason: str, *, hard: bool) -> None:
        """A failed delivery by ``peer``: ``hard`` (no answer in time) strikes at once, others
        from the second in a row. Struck peers are ignored for a doubling while."""
        if not hard:
            self._soft[peer] = self._soft.get(peer, 0) + 1
            if self._soft[peer] < 2:
                return
        self._soft.pop(peer, None)
        n = self._strikes[peer] = min(self._strikes.get(peer, 0) + 1, 16)
        self.ignore(peer, min(IGNORE_MAX_S, IGNORE_S * 2 ** (n - 1)), reason)
        if len(self._strikes) > MAX_STRUCK:  # bounded: forget the peers with the fewest strikes
            for p in sorted(self._strikes, key=self._strikes.get)[:MAX_STRUCK // 4]:
                del self._strikes[p]

    def delivered(self, peer: str) -> None:
        """``peer`` delivered a state: its strikes are cleared."""
        self._strikes.pop(peer, None)
        self._soft.pop(peer, None)

    def ignoring(self) -> dict[str, str]:
        """Peers whose claims are ignored now, {peer ID: reason}."""
        now = swarm_clock.monotonic()
        self.ignored = {p: v for p, v in self.ignored.items() if v[0] > now}
        return {p: why for p, (_, why) in self.ignored.items()}
