"""Atomic local checkpoints: resume exactly, never load a torn or corrupt file."""

from __future__ import annotations

import logging

import pytest
import torch

from p2pdiloco.config import TOPK2_RECIPE, load_config, topk2_note
from p2pdiloco.errors import ConfigError
from node.checkpoint import checkpoint_path, kept_progress, load_checkpoint, save_checkpoint
from node.setup import Setup
from node.training import Delivery

from tests.conftest import TINY


def _setup(name: str) -> Setup:
    return Setup.build(load_config(overrides={**TINY, "data.max_bytes": "50000"}), name, "QmPeer")


def test_resume_restores_learner_exactly(tmp_path):
    a = _setup("a")
    for _ in range(3):
        a.learner.inner_step(*a.sampler.next())
    save_checkpoint(tmp_path, a.learner, {"name": "a"})
    b = _setup("b")
    assert load_checkpoint(tmp_path, b.learner) == {"name": "a"}
    assert b.learner.step == 3
    assert [s.digest for s in b.learner.global_states] == [s.digest for s in a.learner.global_states]
    for (n, x), (_, y) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(x, y), n
    batch = a.sampler.next()  # the same next step on both gives the same weights (AdamW state too)
    a.learner.inner_step(*batch)
    b.learner.inner_step(*batch)
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))


def test_kill_during_write_leaves_previous_checkpoint(tmp_path):
    a = _setup("a")
    save_checkpoint(tmp_path, a.learner, {"n": 1})
    (tmp_path / ".checkpoint.abc.tmp").write_bytes(b"half a checkpoint")  # what a kill mid-write leaves
    b = _setup("b")
    assert load_checkpoint(tmp_path, b.learner) == {"n": 1}
    assert not list(tmp_path.glob(".checkpoint.*.tmp"))


def test_corrupt_checkpoint_is_set_aside_and_node_starts_fresh(tmp_path):
    a = _setup("a")
    a.learner.inner_step(*a.sampler.next())
    save_checkpoint(tmp_path, a.learner, {})
    path = checkpoint_path(tmp_path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    b = _setup("b")
    assert load_checkpoint(tmp_path, b.learner) is None
    assert b.learner.step == 0
    assert (tmp_path / "checkpoint.pt.corrupt").exists() and not path.exists()


def test_journal_appends_rotates_and_skips_a_torn_line(tmp_path):
    from node.journal import Journal, read_journal

    path = tmp_path / "events.jsonl"
    j = Journal(path, max_bytes=200)
    j.record("round", fragment=0, version=1, committed=True)
    j.record("follow", fragment=1, from_version=0, version=3)
    events = read_journal(path)
    assert [(e["event"], e.get("version")) for e in events] == [("round", 1), ("follow", 3)]
    assert all(isinstance(e["t"], float) for e in events)
    size = path.stat().st_size
    while path.stat().st_size >= size:  # past 200 bytes the file starts over; the old one is kept once
        j.record("joined", step=7, lr=0.001)
    assert read_journal(path.with_name("events.jsonl.1"))[:2] == events
    assert [e["event"] for e in read_journal(path)] == ["joined"]
    with open(path, "ab") as f:  # a process killed mid-line
        f.write(b'{"t": 1.0, "event": "ro')
    assert [e["event"] for e in read_journal(path)] == ["joined"]
    Journal(path).record("resumed", step=7)  # the next process ends the torn line first
    assert [e["event"] for e in read_journal(path)] == ["joined", "resumed"]
    assert not Journal(None).record("round")  # no data dir: nothing kept, nothing raised
    assert not Journal(tmp_path / "gone" / "events.jsonl").record("send", sync=True, fragment=0, n=1)  # said, not raised
    assert Journal(path).record("send", sync=True, fragment=0, n=1)
    assert read_journal(tmp_path / "missing.jsonl") == []


def _send(p: int, n: int) -> dict:
    return {"t": 1.0, "event": "send", "fragment": p, "n": n}


def test_a_resumed_node_keeps_only_checkpointed_progress_that_never_left_it():
    """4 fragments; a checkpoint written after 2, 1, 0 and 3 rounds of them, with fragments 0, 1
    and 2 unsent (3 in flight). The journal shows rounds of fragment 1 started after it (n = 2):
    its progress may be inside a state the swarm merged, so it is dropped; 0 and 2 are kept, 3
    is not (its round left). The send counters go on from the journal's where it is ahead."""
    extra = {"sends": [2, 1, 0, 3], "unsent": [0, 1, 2]}
    journal = [_send(0, 1), _send(1, 1), _send(0, 2), {"t": 2.0, "event": "round"}, _send(3, 3), _send(1, 2)]
    assert kept_progress(extra, journal, 4) == ({0, 2}, [2, 2, 0, 3])
    # an empty journal (deleted, or another data dir) proves nothing: nothing kept
    assert kept_progress(extra, [], 4) == (set(), [2, 1, 0, 3])
    # a checkpoint from before these fields, or with fields of the wrong shape: nothing kept
    assert kept_progress({}, journal, 4) == (set(), [2, 2, 0, 3])
    assert kept_progress({"sends": [2, 1, 0], "unsent": [0]}, journal, 4) == (set(), [2, 2, 0, 3])
    assert kept_progress({"sends": [2, 1, "0", 3], "unsent": [2]}, journal, 4) == (set(), [2, 2, 0, 3])
    assert kept_progress({"sends": [2, 1, 0, 3], "unsent": "0"}, journal, 4) == (set(), [2, 2, 0, 3])
    # malformed journal lines are skipped; an unsent index out of range is ignored
    odd = [*journal, {"event": "send", "fragment": 9, "n": 5}, {"event": "send", "fragment": 2, "n": "3"}]
    assert kept_progress({"sends": [2, 1, 0, 3], "unsent": [0, 2, 7]}, odd, 4) == ({0, 2}, [2, 2, 0, 3])


def test_the_training_loop_knows_which_progress_never_left_the_node():
    """``TrainingLoop.unsent``: a fragment with a round in flight is not unsent; after a round
    that failed before anything was sent it is again; after one that failed once its
    contribution had gone to peers it is not (their state may hold it), through a rebase too,
    until an overwrite (the merge that holds it, or ours) leaves only progress made since. A
    round's end clears its fragment's round in flight only if it is that round (its send number)."""
    s = Setup.build(load_config(overrides={**TINY, "data.max_bytes": "50000", "max_steps": "3"}), "a", "QmPeer")
    loop = s.training_loop(lambda p, contrib, anchor: None)
    assert loop.unsent() == [0, 1] and loop.sends == [0, 0]
    loop.run()  # 3 steps, then the end-of-budget rounds of both fragments
    assert loop.unsent() == [] and loop.sends == [1, 1]
    loop.deliver(Delivery(0, None, False, round=7))  # not the round in flight: it stays in flight
    loop.finish(timeout=0)
    assert loop.unsent() == [] and loop.pending == {0, 1}
    loop.deliver(Delivery(0, None, False, left=False, round=1))  # late: no group, nothing sent
    loop.deliver(Delivery(1, None, False, left=True, round=1))  # failed during its all-reduce
    loop.finish(timeout=0)
    assert loop.unsent() == [0]
    loop.deliver(Delivery(1, s.learner.global_states[1], True))  # a follow of others' state: rebased, still held
    loop.finish(timeout=0)
    assert loop.unsent() == [0]
    loop.deliver(Delivery(1, s.learner.global_states[1], False))  # overwritten: nothing sent is left
    loop.finish(timeout=0)
    assert loop.unsent() == [0, 1]


def test_a_joiner_takes_the_swarms_inner_step_at_a_boundary_and_never_goes_back():
    """``TrainingLoop.advance_to``: the node moves a running learner to the swarm's place in the
    learning-rate schedule (its first download may come after training started). The move
    happens between two inner steps, only forwards, and is not progress: the pseudo-gradients
    sent afterwards count only the steps really taken."""
    s = Setup.build(load_config(overrides={**TINY, "data.max_bytes": "50000", "max_steps": "53"}), "a", "QmPeer")
    sent: list[tuple[int, int, int]] = []  # (fragment, steps in the contribution, learner step)
    loop = s.training_loop(lambda p, contrib, anchor: sent.append((p, contrib.steps, s.learner.step)))
    loop.advance_to(50)
    loop.advance_to(20)  # behind the first request: ignored
    loop.run()
    assert s.learner.step == 53  # 50 adopted + 3 inner steps taken, then the budget of 53 was spent
    assert loop.stats.step == 53
    assert sorted(sent) == [(0, 3, 53), (1, 3, 53)]  # end-of-budget sends: 3 steps of progress each


def test_a_joiners_training_loop_sends_each_fragment_first_on_its_own_grid_point() -> None:
    """The schedule rule the training loop runs after joining: a learner that joined at the
    swarm's step 1000 with 4 fragments, H = 8 (offsets 0, 2, 4, 6), its downloads all at
    once, sends each first at its own grid point once it has H/2 = 4 steps of progress
    (fragment 2 at 1004, 3 at 1006, 0 at 1008, 1 at 1010), not all four at 1008."""
    s = Setup.build(load_config(overrides={**TINY, "data.max_bytes": "50000", "max_steps": "1011",
                                           "outer.fragments": "4", "outer.sync_every": "8"}), "a", "QmPeer")
    s.learner.join_at(1000)
    sent: list[tuple[int, int]] = []  # (fragment, learner step); no result is delivered, so each is sent once
    loop = s.training_loop(lambda p, contrib, anchor: sent.append((p, s.learner.step)))
    loop.align()
    loop.run()
    assert sent == [(2, 1004), (3, 1006), (0, 1008), (1, 1010)]


def test_a_small_folder_gives_every_node_a_nonempty_share_or_one_clear_refusal(tmp_path) -> None:
    """Three files of 40 KB (three pieces: one held out, two to train) and the default 8 shards
    picked by peer ID: a node whose shard is empty trains on all of the training text (in its
    own order) instead of failing after its daemon started; a shard chosen explicitly that is
    empty is refused with the setting to change."""
    folder = tmp_path / "text"
    folder.mkdir()
    for i in range(3):
        (folder / f"f{i}.txt").write_bytes(bytes(range(32, 127)) * 430)  # 40,850 bytes: one piece each
    common = {**TINY, "data.path": str(folder), "data.num_shards": "8"}
    sizes = {}
    for peer in (f"QmPeer{i}" for i in range(16)):
        s = Setup.build(load_config(overrides=common), peer, peer)
        sizes[peer] = s.sampler.data.numel()
    assert min(sizes.values()) >= 40_850  # every node trains on at least one whole piece
    assert 2 * 40_850 in sizes.values()  # some fell back to both training pieces
    with pytest.raises(ConfigError, match=r"data shard 5 of 8 is empty: .* set data.num_shards to at most 2"):
        Setup.build(load_config(overrides={**common, "data.shard_index": "5"}), "a", "QmPeer")


def test_a_rising_heldout_loss_is_flagged_once_it_is_five_percent_above_its_best(monkeypatch) -> None:
    """Held-out losses 2.0, 1.8, 1.85 (within 5 % of the best 1.8), then 1.9 (5.6 % above):
    ``heldout_rising`` turns on at the fourth evaluation and stays on."""
    import node.training as training

    losses = iter([2.0, 1.8, 1.85, 1.9, 1.7])
    monkeypatch.setattr(training, "evaluate", lambda model, batches: next(losses))
    loop = _setup("a").training_loop(lambda *a: None)
    flags = []
    for _ in range(5):
        loop.evaluate()
        flags.append(loop.stats.heldout_rising)
    assert flags == [False, False, False, True, True]


def test_topk2_off_the_settings_it_is_measured_with_is_a_warning_at_start() -> None:
    """topk2 with DiLoCo's outer momentum (the tiny preset's 0.5) is a warning among the notes a
    node logs once it is up; at TOPK2_RECIPE, or with another precision, it is not."""
    common = {**TINY, "data.max_bytes": "50000", "outer.wire_precision": "topk2"}

    def levels(overrides: dict[str, str]) -> list[int]:
        return [level for level, _ in Setup.build(load_config(overrides={**common, **overrides}), "a", "QmPeer").notes]

    assert logging.WARNING in levels({})
    off = load_config(overrides={**common, "outer.lr": "2.5"}).outer
    assert topk2_note(off) is not None and topk2_note(load_config(overrides=TINY).outer) is None
    assert logging.WARNING not in levels({f"outer.{k}": str(v) for k, v in TOPK2_RECIPE.items()})
    assert logging.WARNING not in levels({"outer.wire_precision": "int4"})


def test_a_write_over_a_file_size_limit_raises_its_oserror_and_keeps_the_previous_checkpoint(tmp_path):
    """RLIMIT_FSIZE (EFBIG: a full disk gives ENOSPC the same way): the OSError, not torch's
    RuntimeError, reaches the caller; the previous checkpoint loads as before and no temporary
    file is left."""
    import errno  # noqa: PLC0415
    import resource  # noqa: PLC0415

    a = _setup("a")
    save_checkpoint(tmp_path, a.learner, {"n": 1})
    a.learner.inner_step(*a.sampler.next())
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (checkpoint_path(tmp_path).stat().st_size // 2, limit[1]))
    try:
        with pytest.raises(OSError) as raised:
            save_checkpoint(tmp_path, a.learner, {"n": 2})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    assert raised.value.errno == errno.EFBIG
    assert not list(tmp_path.glob(".checkpoint.*"))
    b = _setup("b")
    assert load_checkpoint(tmp_path, b.learner) == {"n": 1} and b.learner.step == 0


def test_a_checkpoint_set_aside_resumes_its_states_without_its_progress(tmp_path):
    """``set_aside_progress`` (the journal could not record a send): ``checkpoint-sent.pt``
    resumes the global states and step, drops every fragment's local progress, and goes once a
    new checkpoint is written."""
    from node.checkpoint import resume, sent_path, set_aside_progress  # noqa: PLC0415
    from node.journal import FILE as JOURNAL_FILE, Journal  # noqa: PLC0415

    a = _setup("a")
    for _ in range(3):
        a.learner.inner_step(*a.sampler.next())
    save_checkpoint(tmp_path, a.learner, {"sends": [0, 0], "unsent": [0, 1]})
    Journal(tmp_path / JOURNAL_FILE).record("joined", step=0)  # no send since: checkpoint.pt would keep both
    set_aside_progress(tmp_path)
    assert sent_path(tmp_path).exists() and not checkpoint_path(tmp_path).exists()
    b = _setup("b")
    resumed = resume(tmp_path, b.learner)
    assert resumed is not None and resumed.kept == frozenset() and b.learner.step == 3
    assert all(b.learner.counters(p)[1] == 0 for p in range(len(b.learner.fragments)))
    save_checkpoint(tmp_path, b.learner, {})
    assert checkpoint_path(tmp_path).exists() and not sent_path(tmp_path).exists()
