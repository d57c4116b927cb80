"""Who a leader waits for: the learners expected in a round, less those that keep not showing up."""

from __future__ import annotations

from p2pdiloco.net.records.parse import HeadsRecord

NO_SHOWS_MAX = 3  # groups in a row a peer was expected in and missed before it is no longer waited for


class ExpectedPeers:
    """The other learners a round of a fragment should wait for (its grace window's ``expected``).

    A peer that publishes a record but never joins (a free rider, or an attacker inflating the
    count) would otherwise make every leader wait its whole grace window: after ``NO_SHOWS_MAX``
    groups in a row it was expected in and missed, it is no longer waited for, until it is in
    one of our groups again. Event-loop only."""

    def __init__(self, me: str):
        self.me = me
        self._no_shows: dict[str, int] = {}  # peer -> our groups in a row it was expected in but missed

    def expected(self, p: int, version: int, records: dict[str, HeadsRecord]) -> set[str]:
        """The other learners expected in a round of fragment p at anchor ``version``: not done,
        at that version or one behind (about to catch up), and not absent too often."""
        return {peer for peer, r in records.items()
                if peer != self.me and not r.done and r.fragments[p] is not None
                and version - 1 <= r.fragments[p][0] <= version and self._no_shows.get(peer, 0) < NO_SHOWS_MAX}

    def formed(self, expected: set[str], members) -> None:
        """A group formed with ``members``: count the expected peers it lacks, forget those in it."""
        for peer in expected - set(members):
            self._no_shows[peer] = self._no_shows.get(peer, 0) + 1
        for peer in members:
            self._no_shows.pop(peer, None)
        if len(self._no_shows) > 4096:  # bounded: keep the most frequent absentees
            self._no_shows = dict(sorted(self._no_shows.items(), key=lambda kv: -kv[1])[:1024])
