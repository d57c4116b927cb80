"""Atomic local checkpoints: resume exactly, never load a torn or corrupt file."""

from __future__ import annotations

import torch

from p2pdiloco.config import load_config
from node.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from node.setup import Setup

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
