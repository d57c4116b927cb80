"""One node: the swarm services, the outer rounds and the training thread, in one task group.

Outer round of fragment p (Decoupled DiLoCo, arXiv 2604.21428, on a swarm: docs/architecture.md):
the training thread hands over Δ_p, its counts and its anchor; the node forms a group at the same
(version, digest) (net.rounds.matchmaking), all-reduces with the token-weighted merge, applies the
Nesterov outer step, commits version + 1 and delivers it to the training thread. A failed round
commits nothing (I2). A node that finds the swarm ahead downloads the newer state, verifies it
and rebases its unsent progress on it (I3): θ_p ← Θ_p(new) − (Θ_p(old) − θ_p).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from p2pdiloco.core.grace import GraceWindow
from p2pdiloco.core.outer import FragmentState, apply_round, run_tokens, with_error_feedback
from p2pdiloco.errors import NetworkError, RoundFailed
from p2pdiloco.net.rounds.allreduce import AllReducer, Contribution, ContributionExcluded, RoundResult
from p2pdiloco.net.rounds.results import ResultRefused
from p2pdiloco.net.state.bounded_moves import own_step
from p2pdiloco.net.state.deltas import logged
from p2pdiloco.net.rounds.matchmaking import Group, GroupKey, Matchmaker
from p2pdiloco.net.records.parse import HeadsRecord
from p2pdiloco.net.state.heads_records import READ_EVERY_S
from p2pdiloco.net.state.revocation import RevocationWatch
from p2pdiloco.net.state.statesync import StateSync
from p2pdiloco.net.transport.swarm import Swarm
from p2pdiloco.trust.reputation import Reputation
from p2pdiloco.data import evaluate

from node.alone import AloneWatch
from node.checkpoint import Resumed, checkpoint_path, resume, save_checkpoint, sent_path, set_aside_progress
from node.committed import CommittedStates
from node.expected import ExpectedPeers
from node.journal import FILE as JOURNAL_FILE, Journal, save_round_trace
from node.setup import Setup, protocol_tag
from node.stats import NodeStats, RoundRecord
from node.swarm_view import SwarmView
from node.training import Delivery, TrainingLoop
from node.catchup import CATCHUP_SECONDS, CatchUp
from node.vetting import Vetting

log = logging.getLogger(__name__)

# how often a node catches up with the swarm, republishes, and its alone watch looks (seconds)
PUBLISH_SECONDS, ALONE_POLL_SECONDS = 5.0, 2.0
EXCLUDED_HOLD_S = 60.0  # seconds after our contribution was left out that a fragment merges with peers only
LEAVE_S = 2.5  # seconds from a stop request (SIGINT/SIGTERM) for rounds in flight to finish; then abandoned
SETTLE_CONFIRM_S = 2.0  # seconds the swarm must stay done and agreed before a settling node leaves


class Node(CatchUp):
    """A running node. Create with a :class:`node.setup.Setup`, then ``await run()``."""

    def __init__(self, setup: Setup, swarm: Swarm):
        self.setup, self.cfg, self.swarm = setup, setup.cfg, swarm
        self.committed = CommittedStates(setup.learner.global_states)  # the one owner of the committed states
        self.stats = NodeStats()
        self.journal = Journal(Path(self.cfg.data_dir) / JOURNAL_FILE if self.cfg.data_dir else None)
        out = self.cfg.outer
        self.outer_rule = (out.sync_every, out.lr, out.momentum)  # core.outer.apply_round's run settings
        self.grace = GraceWindow(tau=out.overlap, gamma=out.grace_gamma, minimum=out.grace_min, maximum=out.grace_max)
        # learners meet only under the tag of everything that shapes their bytes (protocol_tag):
        # a mismatched peer is never matched, instead of crashing deep in a transfer
        tag = protocol_tag(self.cfg, setup.fragments)
        self.matchmaker = Matchmaker(swarm, f"{self.cfg.swarm.run_id}/{tag}", out.min_quorum, len(setup.fragments))
        trust = self.cfg.trust  # signed contributions (run and tag in every signature), robust merge
        self.allreducer = AllReducer(swarm, setup.fragments, out.wire_precision, out.liveness_timeout,
                                     sync_every=out.sync_every, run_id=f"{self.cfg.swarm.run_id}/{tag}",
                                     outliers=trust.outliers, outlier_factor=trust.outlier_factor)
        self.sync = StateSync(swarm, self.cfg.swarm.run_id, setup.fragments, self.committed.states,
                              on_event=self.journal.record, tag=tag, outer=(out.lr, out.momentum),
                              rounds=(out.sync_every, out.wire_precision))
        self.reputation = Reputation()  # trust earned by work this node verified (trust.reputation)
        self.sync.reputation = self.reputation  # whose records move the state
        self.allreducer.trust = self.reputation.merge_weight  # and how much each member weighs in our merges
        self.vetting = Vetting(self.sync, self.reputation,
                               lambda states: evaluate(setup.global_model(states), setup.heldout), swarm.peer_id)
        self.matchmaker.listed_in = self.allreducer.expect  # our reducer part serves each group we are listed in
        self.view = SwarmView(self.sync, swarm.peer_id)  # the swarm's records, as last read
        pushers = (self.matchmaker.gatherings.pusher, self.sync.pusher)  # announcements, records: to the learners
        self.matchmaker.gatherings.audience = self.sync.pusher.audience = lambda: self.view.others  # we know
        self.matchmaker.gatherings.on_heard = self.sync.on_heard = lambda peer, hello=False: [p.heard_from(peer, hello) for p in pushers]
        self.matchmaker.undeliverable = lambda: self.sync.strikes.ignoring().keys() if self.swarm.reach.state() == "behind NAT" else ()
        # the swarm's membership object itself: lists adopted here are what the transport checks
        self.revocations = RevocationWatch(swarm, swarm.membership)
        self.training: TrainingLoop | None = None
        self._round_tasks: set[asyncio.Task] = set()  # abandoned (cancelled) when a stopped node leaves
        self._rounds: asyncio.TaskGroup | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._publish_now = asyncio.Event()
        self._excluded_until: dict[int, float] = {}  # fragment -> no lone round until (monotonic s): EXCLUDED_HOLD_S
        self.expected = ExpectedPeers(swarm.peer_id)  # whom a round waits for
        self._interrupted = False
        self._stopped_at = 0.0  # time.monotonic() of the stop request
        self._resumed: Resumed | None = None  # from a local checkpoint
        self.checkpoint_error: dict[str, Any] | None = None  # the last checkpoint write failed: why (_checkpoint)
        self.started_from: str | None = None  # where training began: "checkpoint", "swarm" or "initial" (run)
        self._joined = False  # took the swarm's inner step (on its first download, or resumed)
        self._stepped: set[int] = set()  # fragments with an own outer step from a round of ours (StateSync.own_step)
        self.solo = AloneWatch(self.cfg.alone_after, self.cfg.swarm.run_id, tag, out.min_quorum, bool(self.cfg.swarm.initial_peers))
        self.done = False

    # ---- lifecycle ------------------------------------------------------------------------
    async def run(self) -> None:
        """Resume from the local checkpoint if any, join (catch up with the swarm), train until
        the budget is spent or :meth:`stop` is called, then leave: finish in-flight rounds,
        checkpoint, and, when the budget ended the run, keep serving up to ``settle`` seconds
        until the peers that are also done hold the same state."""
        self._loop = asyncio.get_running_loop()
        for service in (self.matchmaker, self.allreducer, self.sync):
            await service.start()
        self.stats.state = "joining"
        data_dir = Path(self.cfg.data_dir) if self.cfg.data_dir else None
        await self._resume_and_join(data_dir)
        self._start_training(data_dir)
        self.stats.state = "training"
        await self._alone_step()  # training began: the alone clock starts, with its first verdict
        async with asyncio.TaskGroup() as tg:
            self._rounds = tg
            background = [tg.create_task(self._publisher()),
                          tg.create_task(self._forever("catch-up", self._catch_up_often, CATCHUP_SECONDS)),
                          tg.create_task(self._forever("gathering watch", self._gathering_step, 0.0)),
                          tg.create_task(self._forever("pushes", self.matchmaker.gatherings.push_forever, 0.0)),
                          tg.create_task(self._forever("record pushes", self.sync.pusher.push_forever, 0.0)),
                          tg.create_task(self._revocation_watch()),
                          tg.create_task(self._forever("alone watch", self._alone_step, ALONE_POLL_SECONDS))]
            try:
                await asyncio.to_thread(self.training.run)
                await self._wind_down(data_dir)
            finally:
                self.training.stop.set()
                for task in background:
                    task.cancel()

    async def _resume_and_join(self, data_dir: Path | None) -> None:
        """Resume from the checkpoint in ``data_dir`` if any, greet the learners found in the DHT
        and catch up with the swarm; ``started_from`` says where training begins."""
        if data_dir is not None and (resumed := await asyncio.to_thread(resume, data_dir, self.setup.learner)):
            self.committed.resume(self.setup.learner.global_states)
            self._resumed, self._joined = resumed, True
            self.journal.record("resumed", step=self.setup.learner.step, kept=sorted(resumed.kept))
        await self.sync.greet(self.record())  # the records of the learners found in the DHT, fresh from them
        await self._catch_up(initial=True)
        self.started_from = "checkpoint" if self._resumed else "swarm" if self.stats.catchups else "initial"
        if self.started_from == "initial" and self.cfg.swarm.initial_peers:
            log.warning("no node of run '%s' served a state and %s: this node starts the run afresh from the "
                        "initial model", self.cfg.swarm.run_id,
                        "it has no data dir" if data_dir is None else f"{data_dir} holds no checkpoint")

    def _start_training(self, data_dir: Path | None) -> None:
        """Make the training loop (``training``): until ``duration`` seconds from now, if set; its
        sends resumed or aligned on the swarm's grid; checkpointing into ``data_dir``; stopped at
        once if a stop came while joining."""
        deadline = time.monotonic() + self.cfg.duration if self.cfg.duration else None
        self.training = self.setup.training_loop(self._dispatch, deadline)
        if self._resumed:
            self.training.sends = list(self._resumed.sends)
        if self._joined and not self._resumed:  # joined in the initial catch-up: first sends on the swarm's grid
            self.training.align()
        if data_dir is not None and self.cfg.checkpoint_every:
            self.training.checkpoint = lambda: self._checkpoint(data_dir)
            self.training.checkpoint_every = self.cfg.checkpoint_every
        if self._interrupted:  # stopped while joining
            self.training.stop.set()

    async def _wind_down(self, data_dir: Path | None) -> None:
        """Training ended: finish the rounds in flight (their full time when the budget was spent;
        ``LEAVE_S`` from a stop request, then abandoned), checkpoint into ``data_dir``, settle
        (budget spent only; checkpoint again when a catch-up while settling changed the global
        state, so that ``model export`` from the data dir gives the state the node ended on) and
        publish our last record, stored in the DHT too."""
        out = self.cfg.outer
        self.stats.state = "leaving"
        if not self._interrupted:  # budget spent: rounds in flight get their full time, or until a stop
            await asyncio.to_thread(self.training.finish, out.quorum_timeout + out.liveness_timeout + 5,
                                    self.training.stop)
        if self._interrupted:  # a supervisor waits a few seconds only (docker 10, timeout -k ...)
            await asyncio.to_thread(self.training.finish, self._stopped_at + LEAVE_S - time.monotonic())
            for task in self._round_tasks:  # abandoned: members see us leave, as on a dropped connection
                task.cancel()
            if self._round_tasks:
                await asyncio.wait(self._round_tasks, timeout=1.0)
        self.done = True
        if data_dir is not None:
            await asyncio.to_thread(self._checkpoint, data_dir)
        if not self._interrupted:
            held = [st.digest for st in self.committed]
            await self._settle(self.cfg.settle)
            if data_dir is not None and [st.digest for st in self.committed] != held:  # caught up while settling:
                await asyncio.to_thread(self._checkpoint, data_dir)  # the checkpoint holds the state we end on
        await self._publish(store=True)  # done: nodes that read only the DHT see it too

    def _checkpoint(self, data_dir: Path) -> None:  # in the training thread, or once it ended
        """Write the local checkpoint. A write that fails (a full disk, a file-size limit, a disk
        error) costs the checkpoint, not the run: training goes on, the previous checkpoint stays,
        ``checkpoint_error`` says why (status), and one line is logged per streak of failures;
        the next write that succeeds clears it (docs/operating.md, "Faults of the machine")."""
        try:
            save_checkpoint(data_dir, self.setup.learner, {"name": self.setup.name, "peer_id": self.swarm.peer_id,
                                                           "sends": list(self.training.sends),
                                                           "unsent": self.training.unsent()})
        except OSError as e:
            kept = checkpoint_path(data_dir).exists() or sent_path(data_dir).exists()
            error = {"errno": errno.errorcode.get(e.errno or 0, "EIO"), "detail": e.strerror or str(e),
                     "since": self.checkpoint_error["since"] if self.checkpoint_error else round(time.time(), 3),
                     "failures": (self.checkpoint_error or {}).get("failures", 0) + 1, "kept": kept}
            if self.checkpoint_error is None or self.checkpoint_error["errno"] != error["errno"]:
                log.warning("checkpoint not saved in %s (%s): training goes on; %s", data_dir, error["detail"],
                            "the previous checkpoint is kept" if kept else
                            "nothing is saved, a restart starts from the swarm's state")
            self.checkpoint_error = error
            return
        if self.checkpoint_error is not None:
            log.info("checkpoint saved again after %d failed writes", self.checkpoint_error["failures"])
            self.checkpoint_error = None

    def stop(self) -> None:
        """Ask the node to leave gracefully (thread-safe); a second call ends the process (p2pd with it)."""
        if self._interrupted:
            log.warning("second stop request: exiting now")
            os._exit(130)
        self._interrupted, self._stopped_at = True, time.monotonic()
        log.warning("stopping: finishing in-flight rounds for up to %g s (stop again to exit at once)", LEAVE_S)
        if self.training is not None:
            self.training.stop.set()

    async def _settle(self, timeout: float) -> None:
        """Serve and catch up until every node we see is done and holds our state for ``SETTLE_CONFIRM_S``
        (or ``timeout``) seconds, so a node that still needs to download finds a donor. Records come
        by push (``done`` and versions go at once); the DHT is read every ``READ_EVERY_S`` for a lost
        push (a read and a store every second cost as much as the minute before:
        docs/benchmarks/control_plane.md)."""
        end, agreed_at, read_at = time.monotonic() + timeout, math.inf, -math.inf
        while time.monotonic() < end:
            await self._publish(store=read_at == -math.inf)  # our record says done: stored once
            fresh, now = time.monotonic() - read_at >= READ_EVERY_S, time.monotonic()
            records, read_at = await self.view.read(fresh=fresh), now if fresh else read_at
            await self._catch_up_often()
            mine = tuple((st.version, st.digest) for st in self.committed)
            if all(r.done and r.fragments == mine for r in records.values()) and not self.committed.in_flight():
                agreed_at = min(agreed_at, time.monotonic())  # a last round elsewhere shows within the wait
                if time.monotonic() - agreed_at >= SETTLE_CONFIRM_S:
                    break
            else:
                agreed_at = math.inf
            await asyncio.sleep(1.0)
        await self._catch_up()

    # ---- rounds ---------------------------------------------------------------------------
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

    async def _alone_step(self) -> None:
        if self.training is not None and not self.done:
            # peers ignored for not delivering their state are nodes of the run too (behind NAT, say)
            seen = len(self.view.others | self.sync.strikes.ignoring().keys())
            self.solo.check(seen, self.sync.other_settings(), self.swarm.reach.advice(), read=self.view.read_ok,
                            relay_lost_at=self.swarm.reach.lost_at)

    def state_name(self) -> str:
        """The life-cycle state shown in status and published in the record: ``stats.state``,
        or "alone" while training without merging with anyone (``solo``: node.alone)."""
        if self.solo.alone is not None and self.stats.state in ("training", "catching up"):
            return "alone"
        return self.stats.state

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

    # ---- catch-up and records ------------------------------------------------------------
    def _keep_schedule(self) -> None:
        """Keep this learner's place in the learning-rate schedule at least at the swarm's:
        the newest period start in the ledgers of the states it holds (corroborated swarm
        state, the lower median of each round's members' positions). A slower learner would
        otherwise keep a higher rate than the swarm it merges with; a faster one keeps its own.
        Nodes holding the same versions are then at least at the same place
        (docs/architecture.md, "Partial rounds"). Never beyond H past the step two other
        peers' records reach (one if it is the only other): a ledger is checked only for its
        range, and a peer that republished our own Θ under a ledger claiming step 2^53 would
        otherwise end our schedule."""
        newest = max(st.ledger.period_start for st in self.committed)
        swarm = min(newest, self.view.swarm_step + self.cfg.outer.sync_every)
        if self.training is not None and swarm > self.training.stats.step:
            self.training.advance_to(swarm)

    async def _forever(self, name: str, step, period: float) -> None:
        """Run ``step()`` every ``period`` seconds for the node's life. An exception in one step is logged and
        counted (``NodeStats.internal_errors``), never fatal: whatever a peer sends, no background task dies of it."""
        while True:
            await asyncio.sleep(period)
            try:
                await step()
            except NetworkError as e:
                log.debug("%s: %s", name, e)
            except Exception:
                self.stats.internal_errors += 1
                log.exception("%s failed; going on", name)

    async def _gathering_step(self) -> None:
        """Join groups others are gathering at our version before our own schedule says so,
        each time a peer pushes its announcement (``net.rounds.gatherings``)."""
        await self.matchmaker.gatherings.watch()
        open_now = self.matchmaker.open_gatherings()
        for p, keys in open_now.items():
            if not 0 <= p < len(self.committed) or self.committed.is_in_flight(p):
                continue
            if max(k.version for k in keys) > self.committed[p].version:
                # peers gather at a newer version: follow it now, or this learner would trail one
                # version behind every round and only ever download (pushes come often, a peer may
                # push any version: the records are read once a second at most)
                await self._catch_up(only=p, max_age=CATCHUP_SECONDS / 2)
            mine = self.committed[p]
            if not self.committed.is_in_flight(p) and GroupKey(p, mine.version, mine.digest) in keys:
                self.training.request(p)

    async def _revocation_watch(self) -> None:
        """Adopt newer revocation lists of a private swarm from the DHT (``net.state.revocation``);
        leave when this node's own membership was revoked."""
        async def step() -> None:
            await self.revocations.poll_once()
            if self.revocations.revoked_self and not self._interrupted:
                log.error("this node's membership was revoked by the swarm owner: leaving")
                self.stop()

        if self.swarm.membership.private:
            await self._forever("revocation watch", step, self.revocations.poll_s)

    def record(self) -> dict[str, Any]:
        """This node's heartbeat figures, published in its record and shown by status."""
        st = self.training.stats if self.training else None
        return {
            "name": self.setup.name, "state": self.state_name(), "done": self.done, "step": st.step if st else 0,
            "tps": round(st.tokens_per_s, 1) if st and math.isfinite(st.tokens_per_s) else 0.0,
            "loss": round(st.loss, 4) if st and math.isfinite(st.loss) else None,
            "rounds": self.committed.round_ids(),  # the round that made each fragment's state
            "merged": run_tokens(self.committed), "mine": int(self.stats.tokens_merged),
            "reach": self.swarm.reach.state(),
        }

    async def _publish(self, *, store: bool = False) -> None:
        try:
            await self.sync.publish(self.record(), store=store)
        except NetworkError as e:
            log.debug("publish failed: %s", e)

    async def republish(self) -> None:
        """Store this node's record in the DHT now (after its daemon was started again: the DHT
        node is new, its peers dropped their connections to it)."""
        await self._publish(store=True)

    async def _publisher(self) -> None:
        while True:
            await self._publish()
            self._publish_now.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(PUBLISH_SECONDS):
                    await self._publish_now.wait()
