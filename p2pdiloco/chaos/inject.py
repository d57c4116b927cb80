"""Faults and attacks inside one node process: for tests, the chaos harness and benchmarks only.

    python -m p2pdiloco.chaos.inject [--fault KIND@N] [--poison KIND] [--record FILE] -- node run ARGS...

runs the ordinary ``p2pdiloco node run ARGS...`` with these wrapped around public methods of the
project's own classes, in this process only. The node's code and configuration have no fault or
poison setting (torchft injects failures from its tests with ``EventInjector``, hivemind's tests
use a ``FaultyAverager``; the same split here):

* ``kill-in-allreduce@N``: SIGKILL 20 ms into this node's N-th all-reduce with other members
  (its contributions are on their way).
* ``fail-last-stage@N``: its N-th all-reduce with other members completes, then raises
  ``RoundFailed``: the node treats a round the others committed as lost (invariant I2).
* ``kill-in-state-transfer@N``: SIGKILL while it serves its N-th state to a joining node, after
  the reply's header and half of its payload went out (:func:`kill_midway`).
* ``--poison scale|flip|nan|mix``: every pseudo-gradient it sends to other members is x1000,
  x-1, has a NaN, or the three in turn (one per round), signed like an honest one
  (bench/trust_poison.py; the robust merge, docs/trust.md); with ``--poison-after S``, only
  from S seconds after start (an identity that works honestly first, and earns trust).

A fault that fires at an all-reduce is first written to ``--record`` as one JSON line:
{"t": Unix seconds, "fault": "KIND@N", "fragment": int, "version": the version the round makes}.
Bad arguments: argparse's usage and error on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from p2pdiloco.errors import RoundFailed
from p2pdiloco.net.rounds.allreduce import AllReducer, Contribution
from p2pdiloco.net.transport import serving, sessions
from p2pdiloco.net.transport.swarm import Swarm

FAULTS = ("kill-in-allreduce", "fail-last-stage", "kill-in-state-transfer")
POISONS = ("scale", "flip", "nan", "mix")
KILL_DELAY_S = 0.02  # kill-in-allreduce: seconds into the all-reduce
KILL_LINGER_S = 0.5  # kill midway: seconds the bytes written before the kill get to reach the caller
# set, in the task serving one request, by the handler of the answer that kill_midway cuts
_cut_this_answer: contextvars.ContextVar[bool] = contextvars.ContextVar("p2pdiloco_inject_cut", default=False)


@dataclasses.dataclass
class Injection:
    """What to inject, and the counters that decide when (one per process)."""

    fault: str = ""  # one of FAULTS, or "" for none
    nth: int = 0  # the fault hits the nth event of its kind (1-based)
    poison: str = ""  # one of POISONS, or "" for none
    record: Path | None = None
    poison_after: float = 0.0  # seconds after install before the first poisoned round (honest until then)
    started: float = dataclasses.field(default_factory=time.monotonic)
    group_rounds: int = 0  # all-reduces with other members so far
    poisoned: int = 0  # contributions poisoned so far

    @property
    def spec(self) -> str:
        return f"{self.fault}@{self.nth}"


def parse_fault(text: str) -> tuple[str, int]:
    """``KIND@N`` -> (KIND, N). Raises ValueError unless KIND is one of FAULTS and N >= 1."""
    kind, _, n = text.partition("@")
    if kind not in FAULTS or not n.isdigit() or int(n) < 1:
        raise ValueError(f"fault {text!r} must look like KIND@N with KIND one of {', '.join(FAULTS)} and N >= 1")
    return kind, int(n)


def poisoned(contrib: Contribution, kind: str, k: int) -> Contribution:
    """``contrib`` with its pseudo-gradient Δ (tensors of the fragment's slot shapes, any float
    dtype) poisoned: ``scale`` Δ·1000, ``flip`` −Δ, ``nan`` the first entry of each non-empty
    tensor NaN, ``mix`` the three in turn by ``k`` (the k-th poisoned round, 0-based). The
    counters (tokens, steps) are left as they are. Raises ValueError for another kind."""
    if kind == "mix":
        kind = ("scale", "flip", "nan")[k % 3]
    if kind == "nan":
        delta = tuple(d.clone().view(-1).index_fill_(0, torch.tensor([0]), float("nan")).view(d.shape)
                      if d.numel() else d for d in contrib.delta)
    elif kind in ("scale", "flip"):
        delta = tuple(d * (1000.0 if kind == "scale" else -1.0) for d in contrib.delta)
    else:
        raise ValueError(f"unknown poison {kind!r}; choose one of {POISONS}")
    return dataclasses.replace(contrib, delta=delta)


def install(inj: Injection) -> None:
    """Wrap ``AllReducer.run`` (faults at all-reduces, poison; lone rounds are left alone:
    nothing is sent in them) and, for ``kill-in-state-transfer``, the serving of ``state.get``
    (:func:`kill_midway`) in this process, as ``inj`` says."""
    run = AllReducer.run

    async def faulty_run(self: AllReducer, group, contrib: Contribution):
        if len(group.members) == 1:
            return await run(self, group, contrib)
        inj.group_rounds += 1
        fires = inj.fault in ("kill-in-allreduce", "fail-last-stage") and inj.group_rounds == inj.nth
        if fires and inj.record is not None:
            line = {"t": round(time.time(), 3), "fault": inj.spec, "fragment": group.key.fragment,
                    "version": group.key.version + 1}
            with open(inj.record, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
        if inj.poison and time.monotonic() - inj.started >= inj.poison_after:
            contrib = poisoned(contrib, inj.poison, inj.poisoned)
            inj.poisoned += 1
        if fires and inj.fault == "kill-in-allreduce":
            asyncio.get_running_loop().call_later(KILL_DELAY_S, os.kill, os.getpid(), signal.SIGKILL)
        merged = await run(self, group, contrib)
        if fires and inj.fault == "fail-last-stage":
            raise RoundFailed(f"injected fault {inj.spec}: merge received, treated as lost")
        return merged

    AllReducer.run = faulty_run
    if inj.fault == "kill-in-state-transfer":
        kill_midway("state.get", inj.nth, lambda header: header.get("join") is True)


def kill_midway(rpc: str, nth: int, when: Callable[[dict[str, Any]], bool] = lambda header: True) -> None:
    """SIGKILL this process while it streams its ``nth`` answer to an ``rpc`` request whose
    header satisfies ``when``, after the reply's header and half of its payload bytes went out
    (then ``KILL_LINGER_S`` for them to reach the caller). Wraps ``Swarm.add_handler`` (the
    handler, run in the task that serves the request, marks that answer) and the transport's
    ``write_message`` (it cuts the marked answer): install before the handler is added."""
    left = [nth]
    add_handler, write_message, write_reply = Swarm.add_handler, serving.write_message, sessions.write_reply

    async def marking_add_handler(self: Swarm, name: str, handler, **kwargs) -> None:
        if name == rpc:
            serve = handler

            async def handler(peer: str, header: dict[str, Any], payload: bytes):
                answer = await serve(peer, header, payload)
                if when(header):
                    left[0] -= 1
                    _cut_this_answer.set(left[0] == 0)
                return answer
        await add_handler(self, name, handler, **kwargs)

    async def cutting_write_message(writer, header, payload, *, stop_after: int | None = None) -> None:
        if not _cut_this_answer.get():
            return await write_message(writer, header, payload, stop_after=stop_after)
        await write_message(writer, header, payload, stop_after=len(payload) // 2)
        await _killed(len(payload))

    async def cutting_write_reply(writer, lock, rid, reply, body, *, stop_after: int | None = None) -> bool:
        if not _cut_this_answer.get():
            return await write_reply(writer, lock, rid, reply, body, stop_after=stop_after)
        async with lock:  # held until the kill: no other reply of the session follows the cut one's half
            try:
                await write_reply(writer, asyncio.Lock(), rid, reply, body, stop_after=len(body) // 2)
            finally:
                await _killed(len(body))
        return False

    async def _killed(n: int) -> None:
        await asyncio.sleep(KILL_LINGER_S)
        logging.getLogger(__name__).warning("injected fault: killed while answering %s (%d of %d payload bytes "
                                            "sent)", rpc, n // 2, n)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)

    Swarm.add_handler, serving.write_message, sessions.write_reply = (marking_add_handler, cutting_write_message,
                                                                      cutting_write_reply)


def main(argv: list[str] | None = None) -> int:
    """Parse the injection, install it, then run the CLI with the arguments after ``--``."""
    argv = sys.argv[1:] if argv is None else argv
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m p2pdiloco.chaos.inject",
                                     usage="%(prog)s [--fault KIND@N] [--poison KIND [--poison-after S]] [--record FILE] "
                                           "-- COMMAND ...",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--fault", default="", metavar="KIND@N", help=f"one of {', '.join(FAULTS)}")
    parser.add_argument("--poison", default="", choices=POISONS)
    parser.add_argument("--poison-after", type=float, default=0.0, metavar="S",
                        help="seconds of honest rounds before the first poisoned one (default 0)")
    parser.add_argument("--record", type=Path, default=None, help="JSON lines of the faults that fired")
    args = parser.parse_args(ours)
    if not rest:
        parser.error("the command to run comes after --, for example: -- node run --initial-peers ...")
    try:
        kind, nth = parse_fault(args.fault) if args.fault else ("", 0)
    except ValueError as e:
        parser.error(str(e))
    if args.poison_after < 0:
        parser.error("--poison-after must be >= 0 seconds")
    install(Injection(kind, nth, args.poison, args.record, args.poison_after))
    from p2pdiloco.cli import main as cli_main  # noqa: PLC0415

    return cli_main(rest)


if __name__ == "__main__":
    sys.exit(main())
