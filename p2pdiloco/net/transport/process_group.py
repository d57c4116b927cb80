"""p2pd in a process group of its own (measured with hivemind 1.1.12, uvloop 0.23, p2pd built
with Go 1.20): a signal to the node's whole process group (Ctrl+C in a terminal,
``kill -- -PGID``, coreutils ``timeout``) reaches only the node, which finishes or abandons its
round, tells the swarm it is done and ends p2pd itself (:func:`_create_shielded`, through
:func:`_spawn_group`); :func:`_new_daemons` finds the p2pd a start spawned among this
process's children. ``net.transport.daemon`` starts p2pd with these.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import psutil
from hivemind.p2p import P2P

log = logging.getLogger(__name__)


async def _create_shielded(known: set[int], **kwargs) -> P2P:
    """``P2P.create(**kwargs)`` with p2pd started in a process group of its own, so that a
    signal to the node's whole process group (Ctrl+C in a terminal, ``kill -- -PGID``,
    coreutils ``timeout``, which signals its child and then its group) reaches only the node:
    it finishes or abandons its round, tells the swarm it is done and ends p2pd itself,
    instead of losing its daemon at once with the round in flight.

    Why a process group (measured with hivemind 1.1.12, uvloop 0.23, p2pd built with Go
    1.20): hivemind gives no hook to start p2pd differently (``P2P.create`` spawns it with
    ``asyncio.create_subprocess_exec``), and signal dispositions cannot shield it. p2pd's
    ``trapSignals`` (go-libp2p-daemon ``daemon.go``, started by ``NewDaemon``) calls
    ``signal.Notify`` for SIGINT and SIGTERM and exits on either; ``Notify`` replaces an
    inherited SIG_IGN (Go ``os/signal`` docs), uvloop's libuv resets every disposition to
    SIG_DFL in the child before exec anyway (a child's ``SigIgn`` in /proc is 0), and a
    blocked SIGTERM is unblocked by the Go runtime on every thread (``blockableSig`` in
    runtime/signal_unix.go: signals marked ``_SigKill`` are never blocked in a Go program;
    measured: SigBlk 0, killed by SIGTERM). p2pd's ``main`` ignores SIGINT itself
    (``signal.Ignore(os.Interrupt)`` in p2pd/main.go), but only after it bootstrapped and
    racing with ``trapSignals``; SIGTERM it always obeys.

    A process group is inherited through fork and exec, so the node moves into another
    group while p2pd is forked, and back as soon as p2pd's process appears (polled every
    5 ms): a signal to the node's group within that moment is lost. See
    :func:`_spawn_group` for who can move. p2pd still exits when its owner's control
    connection closes, so it never outlives the node, even on SIGKILL. Off the main thread
    (other threads may write to a terminal while we are out of its foreground group) this is
    plain ``P2P.create``."""
    if threading.current_thread() is not threading.main_thread():
        return await P2P.create(**kwargs)
    with _spawn_group():
        task = asyncio.ensure_future(P2P.create(**kwargs))
        try:
            while not task.done() and not _new_daemons(known):
                await asyncio.sleep(0.005)
        except BaseException:  # cancelled while the daemon starts: it must not start on its own
            task.cancel()
            _kill(_new_daemons(known))
            raise
    try:
        return await task
    except BaseException:  # failed or cancelled (Ctrl+C) before hivemind's control connection
        # exists: p2pd would not notice its owner's exit, and in a group of its own no signal
        # to ours reaches it
        task.cancel()
        _kill(_new_daemons(known))
        raise


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()


@contextlib.contextmanager
def _spawn_group() -> Iterator[bool]:
    """Move this process into another process group for the duration of the block (children
    forked meanwhile stay there), then back into its own; yields whether it moved.

    setpgid(2) rules (Linux man page): a session leader cannot change its group; a process can
    make a new group led by itself, or join a group of its own session. So: a process in
    someone else's group (under ``timeout``, a shell script, a pipeline it does not lead)
    makes a group of its own and then rejoins the old one; a group leader (a shell's job,
    ``setpgid``/``process_group=0``) joins the group of a helper it starts for the purpose
    and then makes its own group again, with the same ID (its PID), which is still the
    terminal's foreground group if it was. A session leader (``setsid``, systemd's main
    process) stays: its p2pd shares its group; send SIGTERM to its PID only (systemd:
    ``KillMode=mixed``). SIGTTOU is ignored meanwhile: outside the terminal's foreground
    group, a write to it would otherwise stop the process when ``stty tostop`` is set."""
    global _moving
    pid, home = os.getpid(), os.getpgrp()
    if os.getsid(0) == pid or _moving:  # (two daemons starting at once: the first one moves)
        yield False
        return
    _moving, moved, helper = True, False, None
    ttou = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        try:
            if home == pid:
                helper = subprocess.Popen([sys.executable, "-I", "-S", "-c", "import time; time.sleep(60)"],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, process_group=0)
                os.setpgid(0, helper.pid)  # its group lives on while we (then p2pd) are in it
            else:
                os.setpgid(0, 0)
            moved = True
        except OSError as e:
            log.debug("p2pd shares the node's process group: %s", e)
        yield moved
    finally:
        if moved:
            try:
                os.setpgid(0, home)
            except OSError as e:  # every other member of our old group has gone
                log.warning("could not return to process group %d: %s", home, e)
        if helper is not None:  # reaped only now: until then its group exists, even if it died
            helper.kill()
            helper.wait()
        signal.signal(signal.SIGTTOU, ttou)
        _moving = False


_moving = False  # whether _spawn_group has moved this process (it does not nest)


def _new_daemons(known: set[int]) -> list[int]:
    """PIDs of our p2pd children that are not in ``known``."""
    out = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if child.pid not in known and child.name() == "p2pd":
                out.append(child.pid)
    return out
