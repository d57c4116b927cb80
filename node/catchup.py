"""A node's catch-up: which states it should move to and the downloads that move it there
(docs/architecture.md, "Late nodes and split brain"). On joining, every 2 s, after a round
without result and while settling, :meth:`CatchUp._catch_up` reads the records, keeps those of
this node and of the peers it trusts (``node.vetting.trusted_records``; a node that trusts no
live peer vets donors first), picks per fragment the head the heads rule gives
(``net.state.heads``), and follows it (:meth:`CatchUp._follow`): downloaded, digest and move
checked, weighed by the held-out loss when newer (``Vetting.weigh_follow``), installed under the
fragment's lock, local progress rebased on top.
"""

from __future__ import annotations

import asyncio
import logging

from p2pdiloco.core.learner import lr_at
from p2pdiloco.core.outer import FragmentState, lone_step_size
from p2pdiloco.errors import StateSyncError
from p2pdiloco.net.records.parse import HeadsRecord
from p2pdiloco.net.state.heads import is_behind, newest_heads, runaway_heads

from node.training import Delivery
from node.vetting import trusted_records


log = logging.getLogger("node.runtime")

CATCHUP_SECONDS = 2.0  # seconds between two catch-ups of a running node


class CatchUp:
    """The catch-up side of :class:`~node.runtime.Node` (which holds the state these methods
    read: committed states, sync, vetting, reputation, training loop, journal, stats)."""

    def _targets(self, records: dict[str, HeadsRecord], states: list[FragmentState] | None = None) -> list:
        """Per fragment, the head this node should move to, or None where it holds what it
        should. Only the records of this node and of peers it trusts count
        (``node.vetting.trusted_records``; none while it trusts no live peer: it vets first,
        :meth:`_catch_up`). Among them the heads rule (``heads.newest_heads``) picks a newer state
        or a split brain's winner; a node ahead alone of the trusted peers falls back
        (``heads.runaway_heads``)."""
        states = self.committed.states() if states is None else states
        n, me = len(states), self.swarm.peer_id
        trusted = trusted_records(records, me, self.reputation)
        if trusted is None:
            return [None] * n
        heads = newest_heads(trusted, n, me=me, mine=[st.version for st in states])
        fallback = runaway_heads(trusted, states, me)
        return [fall if fall is not None and (fall.version, fall.digest) != (st.version, st.digest)
                else head if is_behind(st, head) else None
                for st, head, fall in zip(states, heads, fallback)]

    async def _catch_up(self, *, initial: bool = False, only: int | None = None, max_age: float = 0.0) -> None:
        """Follow every fragment the swarm holds newer (or, at equal version, the winning
        digest of a split brain, invariant I7), by the swarm's records as read at most ``max_age``
        seconds ago (``SwarmView``). On joining, also take the swarm's inner step, so that the
        learning-rate schedule continues where the swarm is."""
        await self._estimate_own_steps()
        records = await self.view.read(max_age)
        chosen_on = self.committed.states()
        if trusted_records(records, self.swarm.peer_id, self.reputation) is None:  # trusting nobody: vet first
            await self.vetting.vet(records, chosen_on)
        targets = self._targets(records, chosen_on)
        followed = []
        for p, head in enumerate(targets):
            if (only is None or p == only) and not self.committed.is_in_flight(p) and head is not None:
                self.stats.state = "joining" if initial else "catching up"
                if await self._follow(p, head, records, chosen_on[p], initial=initial):
                    followed.append(head)
        if followed and not self._joined:
            # the first state this node adopts also gives it the swarm's place in the learning-rate
            # schedule, whether that download came on joining or later (no holder was known at
            # start, or the first donor failed): the smallest step among the holders, so that one
            # holder cannot push a joiner's schedule ahead; never backwards
            steps = [min(records[peer].step for peer in h.holders if peer in records) for h in followed
                     if any(peer in records for peer in h.holders)]
            if steps:
                self._joined = True
                step = max(max(steps), self.setup.learner.step)
                if self.training is None:
                    self.setup.learner.join_at(step)
                else:
                    self.training.advance_to(step, joining=True)
                lr = lr_at(step, self.setup.learner.inner)
                log.info("joined at the swarm's inner step %d (inner lr %.6g, warming up to it again)", step, lr)
                self.journal.record("joined", step=step, lr=lr)
        if initial and not followed and not self._joined and self.view.read_ok and not any(
                r.fragments[p] is not None and r.fragments[p][0] > st.version
                for peer, r in records.items() if peer != self.swarm.peer_id for p, st in enumerate(self.committed)):
            # nobody holds a newer state: this node starts the run (alone, or with others that
            # start with it), and its own step is the swarm's
            self._joined = True
        if self.stats.state in ("catching up", "joining") and self.training is not None and not self.done:
            self.stats.state = "training"

    async def _catch_up_often(self) -> None:  # the catch-up loop: a read a round made within a second will do
        await self._catch_up(max_age=CATCHUP_SECONDS / 2)

    async def _estimate_own_steps(self) -> None:
        """Before its first round of a fragment, its progress so far gives the node's own outer step
        (``StateSync.own_step``: lr·(1 + μ)·‖Θ_p − θ_p‖), which bounds the states it may follow (without
        it a node at a long H refused its peers' first state and isolated itself). An estimate."""
        out, learner = self.cfg.outer, self.setup.learner
        for p in range(len(self.committed)) if self.training is not None else ():
            if p not in self._stepped and not self.sync.has_seen_steps(p) and learner.counters(p)[1] > 0:
                self.sync.own_step(p, lone_step_size(out.lr, out.momentum, await asyncio.to_thread(learner.progress_norm, p)))

    async def _follow(self, p: int, head, records: dict[str, HeadsRecord], chosen_on: FragmentState, *,
                      initial: bool = False) -> tuple[FragmentState, bool] | None:
        """Download fragment p at ``head``, verify it and install it, under the fragment's lock, if
        fragment p still holds ``chosen_on``, the state the head was chosen against (a round of ours,
        or another follow, may have moved it meanwhile: the head may then be behind, or a fallback
        from a state no longer held). Returns the installed state and whether our own contribution
        was inside it (below), or None.

        Local progress is rebased on top (θ_p ← Θ_new − (Θ_old − θ_p), counters kept), except
        when our own contribution is already inside the new state: we were a member of the
        round that made it but could not tell it completed (invariant I2). Then we overwrite,
        as the members that completed did, instead of contributing the same progress twice.
        On joining after a resume from a local checkpoint, the progress left is what never left
        the node (``node.checkpoint.resume`` dropped the rest), and it is rebased."""
        async with self.committed.lock(p):
            if (self.committed[p].version, self.committed[p].digest) == (head.version, head.digest):
                return self.committed[p], False  # another follow of the same head installed (and delivered) it
            if not self.committed.holds(p, chosen_on):
                log.debug("fragment %d moved to v%d while its catch-up waited: skipped", p, self.committed[p].version)
                return None
            try:
                state = await self.sync.download(p, head, joining=initial)
            except StateSyncError as e:
                log.info("catch-up of fragment %d failed: %s", p, e)
                return None
            if state.version > self.committed[p].version and not initial and not await self.vetting.weigh_follow(
                    list(self.committed), state, head.holders):  # a newer state that raises our held-out loss:
                return None  # refused, its holders struck and distrusted (weigh_follow), still grouped with
            made_by = next((r.rounds[p] for peer, r in records.items() if peer in head.holders), "")
            failed = self.committed.pop_lost(p)
            ours = bool(made_by) and failed == made_by
            old = self.committed.install(p, state, made_by)
        self.stats.catchups += 1
        self.stats.resyncs += state.version == old.version
        nbytes, rounds = self.sync.fetched.get(p, (0, 0))  # this download's, by the state or its rounds (net.state.deltas)
        self.journal.record("follow", fragment=p, from_version=old.version, version=state.version,
                            digest=state.short(), ours=ours, bytes=nbytes, rounds=rounds)
        log.info("followed fragment %d: v%d -> v%d (%s)%s", p, old.version, state.version, state.short(),
                 " with our contribution inside" if ours else "")
        if self.training is None:  # joining: a resumed node's checkpointed progress that never left, rebased
            self.setup.learner.install(state, rebase=bool(self._resumed))  # (the rest is dropped: checkpoint.resume)
        else:
            self.training.deliver(Delivery(p, state, not ours))
            self._keep_schedule()
        return state, ours

