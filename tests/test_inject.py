"""Faults and attacks injected from outside the node's code (``p2pdiloco.chaos.inject``).

The poisons by hand; the fault spec's parsing; and the injection installed in this process
around a real two-member all-reduce on the in-memory network: both members send the flipped
pseudo-gradient (the merge is the flipped merge, bit for bit), and the first all-reduce with
other members is the one that fails after completing, recorded with its fragment and version.
The real-process uses are test_churn's faults and test_trust_integration's poisoner.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from test_trust_net import FRAGMENT, KEY, delta, expected_merge

from p2pdiloco.chaos import inject
from p2pdiloco.errors import RoundFailed
from p2pdiloco.net.rounds.allreduce import AllReducer, Contribution
from p2pdiloco.net.rounds.matchmaking import Group
from p2pdiloco.net.transport.memory import MemoryNet
from p2pdiloco.net.transport import serving, sessions
from p2pdiloco.net.transport.swarm import Swarm

pytestmark = pytest.mark.looptime(end=600)


def test_each_poison_by_hand():
    c = Contribution((torch.tensor([1.0, -2.0]), torch.tensor([[0.5]]), torch.empty(0)), 640, 10)
    assert [t.tolist() for t in inject.poisoned(c, "scale", 0).delta] == [[1000.0, -2000.0], [[500.0]], []]
    assert [t.tolist() for t in inject.poisoned(c, "flip", 0).delta] == [[-1.0, 2.0], [[-0.5]], []]
    nan = inject.poisoned(c, "nan", 0).delta
    assert torch.isnan(nan[0][0]) and nan[0][1] == -2.0 and torch.isnan(nan[1][0, 0]) and nan[2].numel() == 0
    assert [inject.poisoned(c, "mix", k).delta[0][1].item() for k in (0, 1, 3, 4)] == [-2000.0, 2.0, -2000.0, 2.0]
    assert torch.isnan(inject.poisoned(c, "mix", 5).delta[0][0])
    assert (inject.poisoned(c, "scale", 0).tokens, inject.poisoned(c, "scale", 0).steps) == (640, 10)
    assert c.delta[0].tolist() == [1.0, -2.0]  # the honest contribution is left as it was
    with pytest.raises(ValueError, match="unknown poison"):
        inject.poisoned(c, "zero", 0)


@pytest.mark.parametrize("text", ["kill-in-allreduce", "kill-in-allreduce@0", "kill@3", "fail-last-stage@x", ""])
def test_a_bad_fault_spec_is_refused(text):
    with pytest.raises(ValueError, match="KIND@N"):
        inject.parse_fault(text)
    assert inject.parse_fault("fail-last-stage@3") == ("fail-last-stage", 3)


def test_bad_arguments_exit_2(capsys):
    for argv in (["--fault", "kill@1", "--", "node", "run"], ["--poison", "zero", "--", "node", "run"], ["--poison", "flip"]):
        with pytest.raises(SystemExit) as e:
            inject.main(argv)
        assert e.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith("python -m p2pdiloco.chaos.inject: error:")


@pytest.mark.asyncio
async def test_installed_poison_and_fail_last_stage_act_on_a_real_all_reduce(monkeypatch, tmp_path):
    monkeypatch.setattr(AllReducer, "run", AllReducer.run)  # restored after the test: install wraps it
    monkeypatch.setattr(Swarm, "add_handler", Swarm.add_handler)  # kill_midway's, were it installed
    monkeypatch.setattr(serving, "write_message", serving.write_message)
    monkeypatch.setattr(sessions, "write_reply", sessions.write_reply)
    record = tmp_path / "faults.jsonl"
    inj = inject.Injection("fail-last-stage", 1, "flip", record)
    inject.install(inj)
    net = MemoryNet()
    try:
        sw = [await net.swarm() for _ in range(2)]
        members = tuple(sorted(s.peer_id for s in sw))
        group = Group("r1", KEY, members, 0.1, members[0])
        reducers = {s.peer_id: AllReducer(s, [FRAGMENT], "fp32", 10.0, sync_every=10, run_id="run",
                                          outlier_factor=4.0) for s in sw}
        for r in reducers.values():
            await r.start()
        # honest-like Δ (cosine about 0.5 between members): both members poison (one process), and
        # each member's own flipped Δ still agrees with the flipped merge (core.audit passes it)
        contribs = {p: Contribution(delta(i), 640, 10) for i, p in enumerate(members)}
        results = await asyncio.gather(*(reducers[p].run(group, contribs[p]) for p in members),
                                       return_exceptions=True)
    finally:
        await net.close()
    failed = [r for r in results if isinstance(r, RoundFailed)]
    merged = [r for r in results if not isinstance(r, BaseException)]
    assert len(failed) == 1 and "fail-last-stage@1" in str(failed[0]) and len(merged) == 1, results
    flipped = expected_merge([inject.poisoned(contribs[p], "flip", 0) for p in members], policy="clip")
    assert all(torch.equal(x, y) for x, y in zip(merged[0].delta, flipped))
    assert (inj.group_rounds, inj.poisoned) == (2, 2)
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [(e["fault"], e["fragment"], e["version"]) for e in lines] == [("fail-last-stage@1", KEY.fragment,
                                                                           KEY.version + 1)]
