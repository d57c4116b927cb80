"""How long a leader waits before closing its group: the grace window, and the longer wait of a
leader still alone while other learners are expected (``Matchmaker.form_group``).

Real swarms (one p2pd each) on 127.0.0.1 are shut down in ``finally`` (``conftest.swarms``).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import swarms, until
from test_trust_net import KEY

from p2pdiloco.net.rounds.matchmaking import Matchmaker

pytestmark = pytest.mark.usefixtures("no_daemon_left")


def test_close_time_by_hand():
    closes_at = Matchmaker._closes_at
    # nobody expected (lone_grace == grace): quorum + grace, joiners or not
    assert closes_at(10.0, None, 1.0, 1.0) == 11.0
    assert closes_at(10.0, 10.4, 1.0, 1.0) == 11.0
    # alone while others are expected: up to lone_grace (5 s) ...
    assert closes_at(10.0, None, 1.0, 5.0) == 15.0
    # ... then grace after the first joiner, never past lone_grace
    assert closes_at(10.0, 12.0, 1.0, 5.0) == 13.0
    assert closes_at(10.0, 14.5, 1.0, 5.0) == 15.0
    # a joiner at once (or a quorum of 2, reached with it): the grace window as before
    assert closes_at(10.0, 10.0, 1.0, 5.0) == 11.0


async def _stagger(expected: int) -> tuple[tuple, tuple]:
    """Learner a declares first; b only once a's gathering has been open for 1.5 s, three times
    the grace window of 0.5 s (``max_grace`` 8 s). Returns both outcomes."""
    async with swarms(2) as (a, b):
        mm_a, mm_b = Matchmaker(a, "run", 1), Matchmaker(b, "run", 1)
        await mm_a.start()
        await mm_b.start()
        first = asyncio.create_task(mm_a.form_group(KEY, grace=0.5, quorum_timeout=10.0, expected=expected,
                                                    max_grace=8.0))
        opened = time.monotonic()
        await until(lambda: time.monotonic() - opened >= 1.5, 10, "1.5 s of a's gathering", every=0.05)
        second = await mm_b.form_group(KEY, grace=0.5, quorum_timeout=10.0, expected=expected, max_grace=8.0)
        return await first, second


@pytest.mark.timeout(120)
@pytest.mark.asyncio
async def test_a_lone_leader_waits_for_an_expected_learner():
    """Two learners at the same version, the second ready 1.5 s after the first: with each
    knowing of the other (expected 2) they merge in one group; knowing of nobody (expected 1),
    the first closes alone after its grace window and the second, finding a closed group at
    that version, is late instead of forking it."""
    (oa, ga), (ob, gb) = await _stagger(expected=2)
    assert oa == ob == "group" and ga.members == gb.members and len(ga.members) == 2 and ga.round_id == gb.round_id
    (oa, ga), (ob, gb) = await _stagger(expected=1)
    assert (oa, len(ga.members)) == ("group", 1) and (ob, gb) == ("late", None)
