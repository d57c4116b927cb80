"""Starting one peer's libp2p daemon (p2pd) and its in-process DHT node, through hivemind's
public API, with our errors; and the check that an identity is not already running.

Lifecycle (measured with hivemind 1.1.12): hivemind's ``DHT`` class runs its node in a child
process that keeps the daemon alive after its parent is SIGKILLed. We run ``DHTNode`` inside
the caller's event loop instead, so the only child is p2pd, which exits as soon as its owner's
control connection closes, including on SIGKILL. :class:`~p2pdiloco.net.transport.Swarm`
owns both once started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import threading
from collections.abc import Sequence
from pathlib import Path

import psutil
from hivemind.dht import DHTNode
from hivemind.p2p import P2P, PeerID

from p2pdiloco.errors import NetworkError
from p2pdiloco.net.framing import close_stream, short_error
from p2pdiloco.net.signed_records import SignedRecords
from p2pdiloco.trust.identity import Identity

log = logging.getLogger(__name__)


async def start_daemon(identity: Identity, initial_peers: Sequence[str], host_maddrs: Sequence[str],
                       announce_maddrs: Sequence[str], startup_timeout: float) -> tuple[P2P, int | None]:
    """Start p2pd with ``identity``'s key (a key held only in memory is written to a temporary
    file for p2pd to read, then removed); returns the daemon's handle and its PID (None if it
    could not be found among our children).

    Raises:
        NetworkError: the daemon did not start (port in use...), or its bootstrap through
            ``initial_peers`` failed.
    """
    key_file = identity.path if identity.path is not None else identity.write_temporary()
    known = {c.pid for c in psutil.Process().children()}
    try:
        p2p = await _create_shielded(
            known,
            initial_peers=list(initial_peers) or None,
            host_maddrs=list(host_maddrs),
            announce_maddrs=list(announce_maddrs) or None,
            identity_path=str(key_file),
            check_if_identity_free=False,  # identity_in_use instead: hivemind's check reads RSA keys only
            startup_timeout=startup_timeout,
            idle_timeout=365 * 24 * 3600,  # quiet inner phases must not kill the daemon
        )
    except Exception as e:
        if initial_peers and "bootstrap" in str(e):
            raise NetworkError(_no_peers_message(initial_peers)) from None
        raise NetworkError(f"the libp2p daemon did not start: {short_error(e)}") from None
    finally:
        if identity.path is None:  # p2pd has read the temporary key file
            shutil.rmtree(Path(key_file).parent, ignore_errors=True)
    daemon = _new_daemons(known)
    return p2p, daemon[0] if daemon else None


SHIELDED = (signal.SIGINT, signal.SIGHUP)  # what a terminal sends its whole foreground process group


async def _create_shielded(known: set[int], **kwargs) -> P2P:
    """``P2P.create(**kwargs)`` with SIGINT and SIGHUP ignored until the new p2pd process
    exists, so that p2pd inherits SIG_IGN for them: an ignored disposition survives exec, and
    the Go runtime keeps an inherited SIG_IGN for exactly these two (runtime/signal_unix.go,
    ``sigInstallGoHandler``). Ctrl+C in a terminal signals the whole foreground process
    group; it then reaches only the node, which finishes its rounds, tells the swarm it is
    done and ends p2pd itself, instead of losing its daemon at once with the round in flight.
    Our handlers are back as soon as the daemon's process appears (polled every 10 ms), so a
    Ctrl+C is lost only within that moment. SIGTERM cannot be shielded this way (Go always
    installs its own handler for it); p2pd also exits when its owner's control connection
    closes, so it never outlives the node. Off the main thread (where signal dispositions
    cannot be changed) this is plain ``P2P.create``."""
    if threading.current_thread() is not threading.main_thread():
        return await P2P.create(**kwargs)
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in SHIELDED}
    task = asyncio.ensure_future(P2P.create(**kwargs))
    try:
        while not task.done() and not _new_daemons(known):
            await asyncio.sleep(0.01)
    except BaseException:  # cancelled while the daemon starts: it must not start on its own
        task.cancel()
        raise
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    return await task


def _new_daemons(known: set[int]) -> list[int]:
    """PIDs of our p2pd children that are not in ``known``."""
    out = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if child.pid not in known and child.name() == "p2pd":
                out.append(child.pid)
    return out


async def start_dht(p2p: P2P, initial_peers: Sequence[str], bootstrap_timeout: float,
                    records: SignedRecords) -> DHTNode:
    """Start the DHT node on ``p2p``, joining through ``initial_peers``, every record checked by
    ``records``. The daemon is shut down if this fails.

    Raises:
        NetworkError: none of the initial peers answered within ``bootstrap_timeout`` seconds,
            or the node did not start.
    """
    try:
        dht = await DHTNode.create(
            p2p=p2p,
            initial_peers=list(initial_peers) or None,
            bootstrap_timeout=bootstrap_timeout,
            wait_timeout=3,
            record_validator=records,
        )
    except Exception as e:
        await p2p.shutdown()
        if initial_peers:
            raise NetworkError(_no_peers_message(initial_peers)) from None
        raise NetworkError(f"the DHT did not start: {short_error(e)}") from None
    return dht


async def identity_in_use(peer_id: str, initial_peers: Sequence[str], timeout: float = 8.0) -> bool:
    """Whether a running peer reachable through ``initial_peers`` already has ``peer_id``.

    Starts a throwaway daemon with a random identity and asks libp2p's routing for the peer:
    a connection that fails only at protocol negotiation means the peer is up ("routing:
    not found" or a dial failure means it is not). The throwaway daemon is always shut down.
    Any failure of the check itself counts as "not in use" (logged).
    """
    probe = None
    try:
        probe = await P2P.create(initial_peers=list(initial_peers), dht_mode="client", startup_timeout=15,
                                 check_if_identity_free=False)
        try:
            async with asyncio.timeout(timeout):
                _, _, writer = await probe.call_binary_stream_handler(PeerID.from_base58(peer_id),
                                                                      "p2pdiloco.identity-probe")
                close_stream(writer)
            return True  # nobody serves this name, but an answer means someone is there
        except Exception as e:
            text = str(e).lower()
            return "protocol" in text and "not supported" in text
    except Exception as e:
        log.info("could not check whether identity %s is in use: %s", peer_id[-8:], short_error(e))
        return False
    finally:
        if probe is not None:
            try:
                await asyncio.wait_for(probe.shutdown(), 10)
            except Exception as e:
                log.debug("probe shutdown: %s", e)


def _no_peers_message(initial_peers: Sequence[str]) -> str:
    return (f"none of the initial peers answered ({', '.join(initial_peers)}); check the addresses, "
            "or start a new swarm with `p2pdiloco bootstrap` and join its printed multiaddr")

