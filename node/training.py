"""The inner loop, run in one worker thread: the only code that mutates the learner.

It never waits for the network (no lock-step): at each inner-step boundary it installs
merged fragments that arrived, hands due fragments' pseudo-gradients to the event loop, and
goes on training (Decoupled DiLoCo, arXiv 2604.21428, sec. 2: learners never block).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from p2pdiloco.core.learner import Learner
from p2pdiloco.core.fragments import StaggeredSchedule
from p2pdiloco.core.grace import Ema
from p2pdiloco.core.outer import FragmentState
from p2pdiloco.data import BatchSampler, evaluate
from p2pdiloco.net.rounds.allreduce import Contribution

log = logging.getLogger(__name__)

RISING = 0.05  # held-out loss this far above its best so far is warned about (once)
CHECKPOINT_COST = 20  # a checkpoint waits at least this many times the last one's duration (<= 5% of the time)


class Delivery(NamedTuple):
    """A round's or a follow's answer for one fragment (``TrainingLoop.deliver``)."""

    fragment: int
    state: FragmentState | None  # the new global state; None: the round produced nothing
    rebase: bool  # keep the local progress on top (a state made without it); False: holds our contribution
    left: bool = False  # state None: our contribution left this node, so another state may hold it
    round: int = 0  # the send it ends (``TrainingLoop.sends``: the n-th round of the fragment); 0: none (a follow)


Dispatch = Callable[[int, Contribution, FragmentState], None]


@dataclass
class TrainingStats:
    """Snapshot figures of the inner loop (read by status; written by the thread)."""

    step: int = 0
    tokens: int = 0  # tokens trained by this node
    loss: float = float("nan")  # EMA of the training loss (nats per token: per byte without a tokenizer)
    heldout_loss: float = float("nan")  # last evaluation of the local model (nats per token)
    heldout_history: list[tuple[int, float]] = field(default_factory=list)
    heldout_rising: bool = False  # the held-out loss went RISING above its best (warned once)
    tokens_per_s: float = 0.0
    t_step: Ema = field(default_factory=lambda: Ema(alpha=0.1))
    installs: int = 0
    rebases: int = 0
    started: float = field(default_factory=time.time)


class TrainingLoop:
    """Runs inner steps until ``stop`` is set or a step/time budget is spent.

    Args:
        learner: the learner (owned by this thread from now on).
        schedule: when each fragment is due.
        sampler: training batches.
        heldout: evaluation batches (identical on every node).
        dispatch: called (from this thread) with (fragment, contribution, anchor) when a
            fragment is due; the event loop answers through :meth:`deliver`.
        max_steps / deadline: budget (0 / None: unbounded); deadline is time.monotonic().
        eval_every: inner steps between held-out evaluations.
    """

    def __init__(self, learner: Learner, schedule: StaggeredSchedule, sampler: BatchSampler,
                 heldout: list, dispatch: Dispatch, *, max_steps: int, deadline: float | None,
                 eval_every: int, synchronous: bool = False, keep_flight: bool = True):
        self.learner, self.schedule, self.sampler, self.heldout = learner, schedule, sampler, heldout
        self.dispatch, self.max_steps, self.deadline, self.eval_every = dispatch, max_steps, deadline, eval_every
        self.synchronous = synchronous
        self.keep_flight = keep_flight  # outer.on_arrival == "keep"
        self._sent: dict[int, Contribution] = {}  # what each pending fragment's round carries
        self.checkpoint: Callable[[], None] | None = None  # called from this thread
        self.checkpoint_every = 0.0  # seconds
        self.checkpoint_s = 0.0  # how long the last checkpoint took (seconds): training waited that long
        self.checkpoint_max_s = 0.0  # the longest one (seconds)
        self.checkpoints = 0  # written by this process
        self.sends = [0] * schedule.P  # rounds started per fragment, over the data dir's life (node.checkpoint)
        self._maybe_merged: set[int] = set()  # progress holds a contribution that left and may be merged
        self.blocked_s = 0.0  # seconds the inner loop waited for rounds (synchronous mode only)
        self.stop = threading.Event()
        self.stats = TrainingStats()
        self._inbox: queue.SimpleQueue[Delivery] = queue.SimpleQueue()
        self.pending: set[int] = set()  # fragments handed out and not answered yet
        self._requested: set[int] = set()
        self._advance = 0  # inner step to move to at the next boundary (advance_to)
        self._join = False  # ... as a joining learner
        self._aligning: set[int] = set()  # a joiner's fragments not sent since it joined: each on its grid point
        self._lock = threading.Lock()

    def request(self, p: int) -> None:
        """Thread-safe: peers are gathering for fragment p now; send it early if this learner
        has at least H/2 steps of progress on it, so that learners whose clocks drifted
        apart still meet in one group instead of merging one by one."""
        with self._lock:
            self._requested.add(p)

    def _due(self) -> list[int]:
        """Fragments to send now: the schedule's rule (``StaggeredSchedule.due``) on this
        learner's step, its per-fragment progress since the last install, the fragments
        peers asked for (:meth:`request`) and, after joining, those not sent since (aligned
        to their grid points)."""
        with self._lock:
            requested, self._requested = self._requested, set()
        since = [self.learner.counters(p)[1] for p in range(self.schedule.P)]
        return self.schedule.due(self.learner.step, since, requested, self._aligning)

    def advance_to(self, step: int, *, joining: bool = False) -> None:
        """Thread-safe: move this learner's inner step (its place in the learning-rate
        schedule) forward to ``step`` at the next step boundary; never backwards. joining:
        the learner joins the swarm there (``Learner.join_at``: its rate warms up again)."""
        with self._lock:
            self._advance = max(self._advance, step)
            self._join = self._join or joining

    def align(self) -> None:
        """Before :meth:`run`: this learner has just joined the swarm (its fragments were all
        downloaded at once), so send each fragment first at its own grid point
        (``StaggeredSchedule.due``'s ``aligning``), spread over a period as the swarm's."""
        self._aligning = set(range(self.schedule.P))

    def deliver(self, item: Delivery) -> None:
        """Thread-safe: a round or catch-up result for a fragment."""
        self._inbox.put(item)

    def _drain(self) -> None:
        with self._lock:
            (advance, self._advance), (join, self._join) = (self._advance, 0), (self._join, False)
        if join:
            self.learner.join_at(advance)
            self._aligning = set(range(self.schedule.P))  # first sends on the swarm's grid, spread over a period
        elif advance > self.learner.step:
            self.learner.step = advance
        while True:
            try:
                p, state, rebase, left, n = self._inbox.get_nowait()
            except queue.Empty:
                return
            if state is not None and not rebase:
                self._maybe_merged.discard(p)  # overwritten: what is left was made after sending
            elif state is None and left:
                self._maybe_merged.add(p)
            sent = None if rebase else self._sent.pop(p, None)
            if state is not None and sent is not None and self.keep_flight:
                self.learner.install_keeping_flight(state, sent.delta, sent.tokens, sent.steps)
            elif state is not None:
                self.learner.install(state, rebase=rebase)
            if state is not None:
                self.stats.installs += 1
                self.stats.rebases += int(rebase)
            if n and n == self.sends[p]:  # the round in flight ended (not an earlier one's late word)
                self.pending.discard(p)

    def unsent(self) -> list[int]:
        """Fragments whose local progress never left this node: no round of them in flight,
        none that failed after sending since the last overwrite (``Delivery.left``). Their
        progress in a checkpoint written now can be kept by a resumed node
        (``node.checkpoint.kept_progress``). Call from the training thread."""
        return [p for p in range(self.schedule.P) if p not in self.pending and p not in self._maybe_merged]

    def evaluate(self) -> float:
        """Held-out loss of the local model (nats per token), recorded in ``stats``. Warns once when
        it rises ``RISING`` above its best so far: training that makes the model worse (too
        little text, repeated over and over; a learning rate too high) should not go unseen."""
        loss = evaluate(self.learner.model, self.heldout)
        self.stats.heldout_loss = loss
        history = self.stats.heldout_history
        history.append((self.learner.step, loss))
        best = min(x for _, x in history)
        if not self.stats.heldout_rising and len(history) >= 3 and loss > (1 + RISING) * best:
            self.stats.heldout_rising = True
            log.warning("held-out loss rose to %.3f nats/token, %.0f%% above its best (%.3f): the training text may be "
                        "too small (each node repeats its share) or a learning rate too high", loss,
                        100 * (loss / best - 1), best)
        return loss

    @property
    def spent(self) -> bool:
        """Whether the training budget is spent: the end-of-budget flush is under way or done."""
        return self._budget_spent()

    def _budget_spent(self) -> bool:
        if self.max_steps and self.learner.step >= self.max_steps:
            return True
        return self.deadline is not None and time.monotonic() >= self.deadline

    def run(self) -> None:
        """The thread body. Exceptions propagate to the awaiting task."""
        if not self.stats.heldout_history:
            self.evaluate()
        window_t, window_tokens = time.monotonic(), 0
        last_checkpoint = time.monotonic()
        while not self.stop.is_set() and not self._budget_spent():
            self._drain()
            inputs, targets = self.sampler.next()
            t0 = time.monotonic()
            loss = self.learner.inner_step(inputs, targets)
            self.stats.t_step.update(time.monotonic() - t0)
            st = self.stats
            st.step = self.learner.step
            st.tokens += inputs.numel()
            window_tokens += inputs.numel()
            st.loss = loss if st.loss != st.loss else 0.9 * st.loss + 0.1 * loss
            now = time.monotonic()
            if now - window_t >= 2.0:
                st.tokens_per_s, window_t, window_tokens = window_tokens / (now - window_t), now, 0
            for p in self._due():
                self._send(p)
            if self.synchronous and self.pending:
                t0 = time.monotonic()
                self.finish(timeout=float("inf"), stop=self.stop)  # lock-step: wait for the merge
                self.blocked_s += time.monotonic() - t0
            if self.learner.step % self.eval_every == 0:
                self.evaluate()
            if self.checkpoint and self.checkpoint_every and \
                    now - last_checkpoint >= max(self.checkpoint_every, CHECKPOINT_COST * self.checkpoint_s):
                t0 = time.monotonic()
                self.checkpoint()
                last_checkpoint = time.monotonic()
                self.checkpoint_s = last_checkpoint - t0
                self.checkpoint_max_s, self.checkpoints = max(self.checkpoint_max_s, self.checkpoint_s), self.checkpoints + 1
        self._drain()
        if not self.stop.is_set():
            # budget spent: send every fragment's unsent progress once more, so the end of a
            # run does not leave up to H steps per fragment unmerged (peers whose budget ends
            # at the same time meet in these rounds); finish() then waits for them
            for p in range(self.schedule.P):
                if self.learner.counters(p)[1] > 0:
                    self._send(p)

    def _send(self, p: int) -> None:
        """Hand fragment p's pseudo-gradient to the event loop, unless its round is in flight."""
        if p in self.pending:
            return  # its previous round is still in flight: keep accumulating
        self._aligning.discard(p)
        tokens, steps = self.learner.counters(p)
        contrib = Contribution(tuple(self.learner.pseudo_gradient(p)), tokens, steps, self.learner.span(p),
                               self.learner.step)
        self.pending.add(p)
        self.sends[p] += 1
        self._sent[p] = contrib
        self.dispatch(p, contrib, self.learner.global_states[p])

    def finish(self, timeout: float, stop: threading.Event | None = None) -> None:
        """Install what arrives for ``timeout`` seconds or until no round is pending (or
        ``stop`` is set), so a node does not stop with merges it took part in left unapplied."""
        end = time.monotonic() + timeout
        while self.pending and time.monotonic() < end and not (stop is not None and stop.is_set()):
            try:
                item = self._inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            self._inbox.put(item)
            self._drain()
        self._drain()
