"""One node: the swarm services, the outer rounds and the training thread, in one task group.

Outer round of fragment p (Decoupled DiLoCo, arXiv 2604.21428, on a swarm: docs/architecture.md):
the training thread hands over Δ_p, its counts and its anchor; the node forms a group at the same
(version, digest) (net.rounds.matchmaking), all-reduces with the token-weighted merge, applies the
Nesterov outer step, commits version + 1 and delivers it to the training thread (``node.rounds``).
A failed round commits nothing (I2). A node that finds the swarm ahead downloads the newer state,
verifies it and rebases its unsent progress on it (I3): θ_p ← Θ_p(new) − (Θ_p(old) − θ_p)
(``node.catchup``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from p2pdiloco.core.grace import GraceWindow
from p2pdiloco.core.outer import run_tokens
from p2pdiloco.errors import NetworkError
from p2pdiloco.net.rounds.allreduce import AllReducer
from p2pdiloco.net.rounds.matchmaking import GroupKey, Matchmaker
from p2pdiloco.net.state.heads_records import READ_EVERY_S
from p2pdiloco.net.state.revocation import RevocationWatch
from p2pdiloco.net.state.statesync import StateSync
from p2pdiloco.net.transport.swarm import Swarm
from p2pdiloco.trust.reputation import Reputation
from p2pdiloco.data import evaluate

from node.alone import AloneWatch
from node.checkpoint import Resumed, checkpoint_path, resume, save_checkpoint, sent_path
from node.committed import CommittedStates
from node.expected import ExpectedPeers
from node.journal import FILE as JOURNAL_FILE, Journal
from node.setup import Setup, protocol_tag
from node.rounds import Rounds
from node.stats import NodeStats
from node.swarm_view import SwarmView
from node.training import TrainingLoop
from node.catchup import CATCHUP_SECONDS, CatchUp
from node.vetting import Vetting

log = logging.getLogger(__name__)

# how often a node catches up with the swarm, republishes, and its alone watch looks (seconds)
PUBLISH_SECONDS, ALONE_POLL_SECONDS = 5.0, 2.0
LEAVE_S = 2.5  # seconds from a stop request (SIGINT/SIGTERM) for rounds in flight to finish; then abandoned
SETTLE_CONFIRM_S = 2.0  # seconds the swarm must stay done and agreed before a settling node leaves


class Node(Rounds, CatchUp):
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
            # the follows of the settle were delivered to the training loop, which has stopped:
            # install them in the learner, whose global states the checkpoint holds
            await asyncio.to_thread(self.training.finish, 0.0)
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
