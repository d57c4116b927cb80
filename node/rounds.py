"""A node's outer rounds (:class:`Rounds`, a base of :class:`~node.runtime.Node`).

Outer round of fragment p (Decoupled DiLoCo, arXiv 2604.21428, on a swarm: docs/architecture.md):
the training thread hands over Δ_p, its counts and its anchor (:meth:`Rounds._dispatch`); the
node rebases on a newer state first if the swarm is ahead, forms a group at the same (version,
digest) (net.rounds.matchmaking), all-reduces with the token-weighted merge, applies the
Nesterov outer step, commits version + 1 and delivers it to the training thread
(:meth:`Rounds._round`). A failed round commits nothing (I2); a round that merged without our
contribution is taken as its included members took it (:meth:`Rounds._take_excluded`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path

from p2pdiloco.core.outer import FragmentState, apply_round, with_error_feedback
from p2pdiloco.errors import NetworkError, RoundFailed
from p2pdiloco.net.records.parse import HeadsRecord
from p2pdiloco.net.rounds.allreduce import Contribution, ContributionExcluded, RoundResult
from p2pdiloco.net.rounds.groups import Group, GroupKey
from p2pdiloco.net.rounds.results import ResultRefused
from p2pdiloco.net.state.bounded_moves import own_step
from p2pdiloco.net.state.deltas import logged

from node.checkpoint import set_aside_progress
from node.journal import save_round_trace
from node.stats import RoundRecord
from node.training import Delivery

log = logging.getLogger("node.runtime")

EXCLUDED_HOLD_S = 60.0  # seconds after our contribution was left out that a fragment merges with peers only


class Rounds:
    """The rounds side of :class:`~node.runtime.Node` (which holds the state these methods
    read: settings, committed states, matchmaker, all-reducer, sync, vetting, reputation,
    training loop, journal, stats, the task group of rounds)."""

    def _dispatch(self, p: int, contrib: Contribution, anchor: FragmentState) -> None:
        """Called from the training thread when fragment p is due (its ``sends[p]``-th round)."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._start_round, p, contrib, anchor, self.training.sends[p])

    def _start_round(self, p: int, contrib: Contribution, anchor: FragmentState, n: int) -> None:
        if not self.journal.record("send", sync=True, fragment=p, n=n) and self.cfg.data_dir:  # before anything leaves
            # the checkpoint may say this progress never left: without the journal's word, none of it is kept
            set_aside_progress(Path(self.cfg.data_dir))
        if self._rounds is None or self.done:
            self.training.deliver(Delivery(p, None, False, round=n))
            return
        self.committed.begin_round(p)
        task = self._rounds.create_task(self._round(p, contrib, anchor, n))
        self._round_tasks.add(task)
        task.add_done_callback(self._round_tasks.discard)

    async def _round(self, p: int, contrib: Contribution, anchor: FragmentState, n: int) -> None:
        """Fragment ``p``'s ``n``-th round for our progress ``contrib`` (made against ``anchor``):
        rebased if we are behind, a group formed, merged and committed; or recorded as not merged
        (late, no quorum, excluded, failed). Its outcome goes to the training loop; a round
        without a result follows a group that may have merged without us."""
        t0 = time.monotonic()
        self.grace.t_step.value = self.training.stats.t_step.value
        out = self.cfg.outer
        result: FragmentState | None = None
        left = False  # our contribution went to peers: their state may hold it (Delivery.left)
        # the step our own progress would make: a reference for the states we may follow
        self.sync.own_step(p, own_step(out, contrib.delta, contrib.steps, self.training.stats.t_step.value))
        self._stepped.add(p)
        try:
            anchor, records, ours = await self._rebase_if_behind(p)  # Δ is the same progress against it
            if ours:  # the state followed holds this progress already (made by a round of ours we lost): not twice
                self._record(RoundRecord(p, anchor.version, 0, time.monotonic() - t0, False, "merged already"))
                return
            expected, outcome, group = await self._form_group(p, anchor, records)
            if outcome == "group" and len(group.members) == 1 and time.monotonic() < self._excluded_until.get(p, 0.0):
                # our last Δ was left out by the swarm's merge: alone, we would commit what it refused; kept
                self._record(RoundRecord(p, anchor.version, 0, time.monotonic() - t0, False, "alone after excluded"))
            elif outcome == "group":
                self.expected.formed(expected, group.members)
                self.grace.t_quorum.update(group.formed_in)
                t1 = time.monotonic()
                contrib = self._with_feedback(p, anchor, group, contrib)
                left = len(group.members) > 1
                merged = await self.allreducer.run(group, contrib)
                self.grace.t_sync.update(time.monotonic() - t1)
                result = await self._commit(p, anchor, group, merged, contrib, t0)
                if result is not None and len(group.members) > 1:  # merged with peers: lone rounds again
                    self._excluded_until.pop(p, None)
            else:
                if outcome == "late":
                    self.stats.rounds_late += 1
                self._record(RoundRecord(p, anchor.version, 0, time.monotonic() - t0, False, outcome))
        except ContributionExcluded as e:
            left = False  # merged without it
            await self._on_excluded(p, anchor, group, e, t0)
        except RoundFailed as e:
            self._on_failed(p, anchor, group, e, t0)
        except NetworkError as e:
            self.stats.rounds_failed += 1
            log.warning("round f%d: network error: %s", p, e)
        except Exception:  # a bug in one round must not take the node down: record, discard
            self.stats.rounds_failed += 1
            log.exception("round f%d failed unexpectedly; discarded", p)
        except asyncio.CancelledError:  # abandoned: the node is stopping
            self._record(RoundRecord(p, anchor.version, 0, time.monotonic() - t0, False, "abandoned: stopping"))
            raise
        finally:
            self.committed.end_round(p)
            self.training.deliver(Delivery(p, result, False, left and result is None, round=n))
        if result is None:
            await self._catch_up(only=p)  # a group may have merged without us: follow it

    async def _form_group(self, p: int, anchor: FragmentState,
                          records: dict[str, HeadsRecord]) -> tuple[set[str], str, Group | None]:
        """Gather a group for fragment ``p`` at ``anchor`` (``Matchmaker.form_group``), waiting
        for the peers ``records`` say we may expect. Returns (the peers expected, the outcome:
        "group", "late" or "no_quorum", the group or None). Raises NetworkError."""
        out = self.cfg.outer
        expected = self.expected.expected(p, anchor.version, records)
        key = GroupKey(p, anchor.version, anchor.digest)
        # synchronous: the "grace" is the whole quorum timeout (close once all joined); no lone wait in the
        # end-of-budget flush (peers are leaving); a closed group's result is due within round_time (ar's wait)
        grace = out.quorum_timeout if out.synchronous else self.grace.seconds()
        outcome, group = await self.matchmaker.form_group(
            key, grace=grace, quorum_timeout=out.quorum_timeout, expected=1 + len(expected),
            max_grace=out.quorum_timeout if out.synchronous else out.grace_max,
            lone_wait=not self.training.spent, round_time=4 * out.liveness_timeout + out.grace_max)
        return expected, outcome, group

    def _with_feedback(self, p: int, anchor: FragmentState, group: Group, contrib: Contribution) -> Contribution:
        """Our contribution to ``group``'s merge: ``contrib`` with error feedback (what wire
        coding left out of our last one, ``committed.residual``) added; with peers, ``anchor``
        is noted as a common ancestor (every member held it)."""
        if len(group.members) > 1:  # every member held the anchor: a common ancestor
            self.sync.shared(p, anchor.version)
        if (residual := self.committed.residual(p)) is not None:  # error feedback: what wire coding left out
            contrib = dataclasses.replace(contrib, delta=tuple(with_error_feedback(
                contrib.delta, residual, self.cfg.outer.error_feedback_decay)))
        return contrib

    async def _on_excluded(self, p: int, anchor: FragmentState, group: Group, e: ContributionExcluded,
                           t0: float) -> None:
        """The others merged ``group``'s round without our progress: kept, rebased on their state
        (not ours: _follow); no lone round for ``EXCLUDED_HOLD_S`` seconds."""
        self.stats.rounds_excluded += 1
        self._excluded_until[p] = time.monotonic() + EXCLUDED_HOLD_S
        self._record(RoundRecord(p, anchor.version, 0, time.monotonic() - t0, False, "excluded"))
        log.warning("round f%d v%d: our contribution was left out (%s); kept for the next round",
                    p, anchor.version + 1, e)
        if e.result is not None:
            await self._take_excluded(p, anchor, e.result, group)

    def _on_failed(self, p: int, anchor: FragmentState, group: Group, e: RoundFailed, t0: float) -> None:
        """``group``'s round failed: the reducers whose merged parts we refused are refuted and
        avoided, the failure reported to matchmaking, the round lost (others may have committed it)."""
        self.stats.rounds_failed += 1
        for peer, why in (e.reducers if isinstance(e, ResultRefused) else {}).items():  # parts we refused
            self.reputation.refuted(peer, f"its merged part of round {group.round_id}: {why}")
            self.matchmaker.avoid(peer, why)
        self.matchmaker.group_failed(group)
        self.committed.lose(p, group.round_id)  # others may have committed it: see _follow
        self._record(RoundRecord(p, anchor.version, 0, time.monotonic() - t0, False, str(e)))
        log.warning("round f%d v%d discarded: %s", p, anchor.version + 1, e)

    async def _commit(self, p: int, anchor: FragmentState, group: Group, merged: RoundResult,
                      contrib: Contribution, t0: float) -> FragmentState | None:
        """Apply a merged round to fragment ``p`` (outer step on ``anchor``) and commit it, under the
        fragment's lock, unless another state was installed meanwhile (``CommittedStates.commit``: by
        digest, not identity; tests/test_commit.py); a superseded result is recorded, counted and logged."""
        new, fraction = apply_round(anchor, merged.delta, merged.tokens, merged.position, merged.first, *self.outer_rule)
        if merged.suspects:  # parts against our own Δ (core.audit): taken only if they do not raise our loss
            slots = {i for part in merged.suspects.values() for i in part}
            without, _ = apply_round(anchor, [t.new_zeros(t.shape) if i in slots else t for i, t in enumerate(merged.delta)],
                                     merged.tokens, merged.position, merged.first, *self.outer_rule)
            await self.vetting.weigh_round([anchor if s.index == p else s for s in self.committed], new, without,
                                           merged.suspects, group.round_id)
        self.matchmaker.group_succeeded(group)
        async with self.committed.lock(p):
            # residual: error feedback for the next round (None: nothing left out)
            committed = self.committed.commit(p, anchor, new, group.round_id, merged.residual)
        if not committed:  # another state was installed meanwhile; its round is remembered as lost: see _follow
            self.stats.rounds_failed += 1
            self._record(RoundRecord(p, new.version, len(group.members), time.monotonic() - t0, False, "superseded"))
            log.warning("round f%d v%d merged, but fragment %d moved to v%d meanwhile: result dropped",
                        p, new.version, p, self.committed[p].version)
            return None
        self._log_round(p, anchor, new, merged, len(group.members))
        self.stats.rounds_committed += 1
        self.stats.rounds_alone += int(len(group.members) == 1)
        if len(group.members) > 1:
            self.solo.merged()
        self.stats.tokens_merged += contrib.tokens / len(self.committed)  # per fragment: 1/P of every token
        self._record(RoundRecord(p, new.version, len(group.members), time.monotonic() - t0, True, digest=new.short(),
                                 fraction=fraction, share=group.share_of(self.swarm.peer_id)))
        log.info("round f%d v%d: %d members, %.2f s, digest %s", p, new.version, len(group.members),
                 time.monotonic() - t0, new.short())
        self._credit(merged, group.round_id)
        self.sync.known_by(group.members)  # they committed it too: pushed to them with our next change
        self._publish_now.set()
        self._keep_schedule()
        if self.cfg.trace_dir:
            await asyncio.to_thread(save_round_trace, Path(self.cfg.trace_dir), self.swarm.peer_id,
                                    group.round_id, group.members, contrib, merged, fraction, anchor,
                                    new, [s.is_embedding for s in self.setup.fragments[p].slots], group.shares,
                                    self.allreducer.trust_used.get(group.round_id, ()))
        return new

    async def _take_excluded(self, p: int, anchor: FragmentState, merged: RoundResult, group: Group) -> None:
        """Commit the result of a round that merged without our contribution, as its included
        members do (same merged Δ and counters, so the same state, bit for bit), with our
        progress rebased on it (``TrainingLoop.deliver`` with rebase): a member left out (an
        outlier, or late) is then at the swarm's version for the next round instead of a
        download behind, where the others would look past it (invariant I3)."""
        new, _ = apply_round(anchor, merged.delta, merged.tokens, merged.position, merged.first, *self.outer_rule)
        async with self.committed.lock(p):
            if not self.committed.holds(p, anchor):
                return  # another state was installed meanwhile: the records decide
            self.committed.install(p, new, group.round_id)  # our residual stays: what it corrects was not merged
        self._log_round(p, anchor, new, merged, len(group.members))
        self._credit(merged, group.round_id)
        self.journal.record("follow", fragment=p, from_version=anchor.version, version=new.version,
                            digest=new.short(), ours=False, excluded=True)
        log.info("fragment %d: took v%d (%s), merged without us", p, new.version, new.short())
        self.training.deliver(Delivery(p, new, True))
        self._publish_now.set()
        self._keep_schedule()

    def _credit(self, merged: RoundResult, round_id: str) -> None:
        """Every other contributor of a round this node committed earns a point (trust.reputation),
        but one whose Δ our own reduction left out as pointing against ours (muted, not merged)."""
        muted = self.allreducer.muted.get(round_id, frozenset())
        for peer in merged.contributors:
            if peer != self.swarm.peer_id and peer not in muted:
                self.reputation.merged(peer)

    def _log_round(self, p: int, anchor: FragmentState, new: FragmentState, merged: RoundResult, members: int) -> None:
        """Keep a committed round to serve nodes behind (net.state.deltas); never fails the commit it follows."""
        try:
            self.sync.deltas.log.add(p, logged(anchor, new, merged, members, self.cfg.outer.wire_precision))
        except Exception:  # MemoryError, say: the round is committed all the same
            log.exception("round f%d v%d not kept for catch-ups", p, new.version)

    async def _rebase_if_behind(self, p: int) -> tuple[FragmentState, dict[str, HeadsRecord], bool]:
        """Before matchmaking: the state fragment p's round goes on at. Δ is this learner's
        progress since the round's anchor, and every install the training thread gets rebases that
        progress (θ_p = Θ_new − Δ), so Δ is the same progress against whatever fragment p holds
        now (invariant I3: contributions only at the swarm's version). If the swarm holds a newer
        (or winning) state than that, follow it first. The head is chosen against the state held
        now, not against the anchor, which may be older (a delivery the training thread has not
        drained yet): chosen against that, it could be older than what is held. A follow
        skipped because another one moved the fragment meanwhile chooses once more. Also returns
        whether the state followed holds our contribution already (``_follow``): then the round
        must not send Δ, which holds that progress too (invariant I2)."""
        records = await self.view.read()
        for _ in range(2):
            chosen_on = self.committed[p]
            head = self._targets(records)[p]
            if head is None:
                return chosen_on, records, False
            followed = await self._follow(p, head, records, chosen_on)
            if followed is not None:
                state, ours = followed
                return state, records, ours
            if self.committed.holds(p, chosen_on):  # the download failed: go on at what we hold
                return chosen_on, records, False
        return self.committed[p], records, False

    def _record(self, rec: RoundRecord) -> None:
        self.stats.recent = [*self.stats.recent[-19:], rec]
        self.journal.record("round", **{**vars(rec), "seconds": round(rec.seconds, 3)})
