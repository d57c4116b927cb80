"""Starting one peer's libp2p daemon (p2pd) and its in-process DHT node, through hivemind's
public API, with our errors (p2pd in a process group of its own: ``net.transport.process_group``;
the check that an identity is not already running: ``net.transport.identity_check``).

Lifecycle (measured with hivemind 1.1.12): hivemind's ``DHT`` class runs its node in a child
process that keeps the daemon alive after its parent is SIGKILLed. We run ``DHTNode`` inside
the caller's event loop instead, so the only child is p2pd, which exits as soon as its owner's
control connection closes, including on SIGKILL. :class:`~p2pdiloco.net.transport.swarm.Swarm`
owns both once started.

Local sockets (docs/trust.md, "local users"): hivemind talks to p2pd over two unix sockets,
p2pd's control socket and the client's socket for incoming streams; whoever can connect to
the first drives the node's libp2p identity, to the second feeds it streams as any peer.
hivemind 1.1.12 puts both at ``/tmp/hivemind-p2pd-RANDOM.sock`` and
``/tmp/hivemind-p2pclient-RANDOM.sock`` (the prefix is the private ``P2P._UNIX_SOCKET_PREFIX``;
``P2P.create`` takes no socket path), created with the process umask: 0777 under umask 000.
:func:`private_sockets` holds the umask at 077 while they are created, so each is created
owner-only (``bind`` applies the umask, no window where another user can connect); hivemind's
``shutdown`` removes both.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import logging
import os
import secrets
import shutil
import stat
import subprocess
import tempfile
import threading
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from pathlib import Path

import psutil
from hivemind.dht import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from p2pdiloco.errors import NetworkError
from p2pdiloco.net.transport.framing import short_error
from p2pdiloco.net.transport.process_group import _create_shielded, _new_daemons
from p2pdiloco.net.records.signed import SignedRecords
from p2pdiloco.trust.identity import Identity

log = logging.getLogger(__name__)


async def start_daemon(identity: Identity, initial_peers: Sequence[str], host_maddrs: Sequence[str],
                       announce_maddrs: Sequence[str], startup_timeout: float,
                       options: Mapping[str, Any] | None = None) -> tuple[P2P, int | None]:
    """Start p2pd with ``identity``'s key (a key held only in memory is written to a temporary
    file for p2pd to read, then removed); returns the daemon's handle and its PID (None if it
    could not be found among our children). ``options``: more keyword arguments of
    ``P2P.create`` (reachability and relays: ``net.transport.reachability.daemon_options``). p2pd's
    control socket is owner-only (:func:`private_sockets`); hold that block also over the first
    ``add_binary_stream_handler``, which binds hivemind's client socket (``Swarm.start`` does).

    Raises:
        NetworkError: the daemon did not start (port in use...), its bootstrap through
            ``initial_peers`` failed, or its socket is open to other users (:func:`check_owner_only`).
    """
    key_file = identity.path if identity.path is not None else identity.write_temporary()
    known = {c.pid for c in psutil.Process().children()}
    options = dict(options or {})
    static_relays = options.pop("static_relays", None)
    spawned: list[int] = []
    try:
        with private_sockets():
            if static_relays:
                p2p = await _spawn_with_static_relays(spawned, static_relays, initial_peers, host_maddrs,
                                                      announce_maddrs, str(key_file), startup_timeout, **options)
            else:
                p2p = await _create_shielded(
                    known,
                    initial_peers=list(initial_peers) or None,
                    host_maddrs=list(host_maddrs),
                    announce_maddrs=list(announce_maddrs) or None,
                    identity_path=str(key_file),
                    check_if_identity_free=False,  # identity_in_use instead: hivemind's check reads RSA keys only
                    startup_timeout=startup_timeout,
                    idle_timeout=IDLE_TIMEOUT_S,
                    **options,
                )
    except Exception as e:
        if initial_peers and "bootstrap" in str(e):
            raise NetworkError(_no_peers_message(initial_peers)) from None
        raise NetworkError(f"the libp2p daemon did not start: {short_error(e)}") from None
    finally:
        if identity.path is None:  # p2pd has read the temporary key file
            shutil.rmtree(Path(key_file).parent, ignore_errors=True)
    try:
        check_owner_only(p2p)
    except BaseException:
        await p2p.shutdown()
        raise
    daemon = spawned or _new_daemons(known)
    return p2p, daemon[0] if daemon else None


_watching: set[asyncio.Future] = set()  # tasks that drain our p2pd's stderr and wait for its exit
IDLE_TIMEOUT_S = 365 * 24 * 3600  # p2pd's idle timeout: quiet inner phases must not kill the daemon


def one_addr_per_peer(maddrs: Sequence[str]) -> list[str]:
    """The first multiaddr (with /p2p/ID) of each peer in ``maddrs``, in order: p2pd takes
    each static relay string as one relay, and autorelay waits for as many distinct relays as
    strings given before it reserves (go-libp2p v0.32 ``autorelay.WithStaticRelays``)."""
    out: dict[str, str] = {}
    for m in maddrs:
        if "/p2p/" in m:
            out.setdefault(m.rsplit("/p2p/", 1)[1], m)
    return list(out.values())


async def _spawn_with_static_relays(spawned: list[int], static_relays: Sequence[str], initial_peers: Sequence[str],
                                    host_maddrs: Sequence[str], announce_maddrs: Sequence[str], identity_path: str,
                                    startup_timeout: float, use_relay: bool = True,
                                    force_reachability: str | None = None) -> P2P:
    """Start hivemind's p2pd binary with autorelay on ``static_relays`` only, and connect to it
    with hivemind's public ``P2P.replicate``; appends the daemon's PID to ``spawned``.

    Why not ``P2P.create`` (measured in tests/internet, docs/operating.md "Running a node at
    home"): it starts p2pd with relay discovery on (``-relayDiscovery`` defaults to true and
    ``P2P.create`` ignores ``use_relay_discovery``), so autorelay takes its candidates from a
    peer source and, knowing fewer than 4 (go-libp2p v0.32 ``autorelay`` ``minCandidates``),
    reserves its first slot only after its 3-minute boot delay. With ``-relayDiscovery=0`` and
    ``-trustedRelays`` p2pd uses ``autorelay.WithStaticRelays``, which waits only for the
    static relays themselves: the slot comes seconds after the start. The other flags are
    those ``P2P.create`` passes with its defaults (p2pd ``-help``), hole punching (DCUtR)
    included: ``-autonat`` turns on both AutoNAT service and hole punching in p2pd.

    p2pd runs in a session (so a process group) of its own: a signal to the node's group
    reaches only the node, as with :func:`_create_shielded` (uvloop's subprocess takes
    ``start_new_session`` but no ``process_group``), and p2pd exits when the node's control
    connection closes. Raises what ``P2P.replicate`` raises, or RuntimeError naming p2pd's last error
    line when it exits or does not answer within ``startup_timeout`` seconds."""
    binary = importlib.resources.files("hivemind.hivemind_cli") / "p2pd"
    sock = Path(tempfile.gettempdir()) / f"p2pdiloco-p2pd-{secrets.token_urlsafe(8)}.sock"
    flags = _static_relay_flags(sock, identity_path, host_maddrs, static_relays, initial_peers, announce_maddrs,
                                use_relay, force_reachability)
    env = {**os.environ, "GOLOG_LOG_LEVEL": "error"}
    proc = await asyncio.create_subprocess_exec(str(binary), *(f"-{k}={v}" for k, v in flags.items()),
                                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                stderr=subprocess.PIPE, env=env, start_new_session=True)
    spawned.append(proc.pid)
    errors: deque[str] = deque(maxlen=5)  # p2pd's last error lines, drained so that it never blocks on stderr

    async def drain() -> None:
        async for line in proc.stderr:
            errors.append(line.decode(errors="replace").strip()[:500])

    drainer, proc_done = asyncio.ensure_future(drain()), asyncio.ensure_future(proc.wait())
    for task in (drainer, proc_done):  # held until p2pd exits (the loop keeps only weak references)
        _watching.add(task)
        task.add_done_callback(_watching.discard)
    try:
        async with asyncio.timeout(startup_timeout):
            p2p = await _replicate(proc, sock, errors, drainer, proc_done)
    except BaseException as e:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        if isinstance(e, TimeoutError):
            raise RuntimeError(f"p2pd did not answer within {startup_timeout:g} s: "
                               f"{' | '.join(errors) or 'no message'}") from None
        raise
    return p2p


def _static_relay_flags(sock: Path, identity_path: str, host_maddrs: Sequence[str], static_relays: Sequence[str],
                        initial_peers: Sequence[str], announce_maddrs: Sequence[str], use_relay: bool,
                        force_reachability: str | None) -> dict[str, Any]:
    """p2pd's command-line flags (name -> value, passed as ``-name=value``) for
    :func:`_spawn_with_static_relays`: its control socket at ``sock``, autorelay on
    ``static_relays`` only, otherwise the flags ``P2P.create`` passes with its defaults."""
    flags = {"listen": f"/unix{sock}", "id": identity_path, "hostAddrs": ",".join(host_maddrs), "dhtServer": 1,
             "autonat": 1, "natPortMap": 1, "connManager": 1, "tls": 1, "relay": int(use_relay), "autoRelay": 1,
             "relayDiscovery": 0, "trustedRelays": ",".join(one_addr_per_peer(static_relays)),
             "idleTimeout": f"{IDLE_TIMEOUT_S}s", "q": 1}
    if initial_peers:
        flags.update(bootstrapPeers=",".join(initial_peers), b=1)
    if announce_maddrs:
        flags["announceAddrs"] = ",".join(announce_maddrs)
    if force_reachability in ("public", "private"):
        flags[f"forceReachability{force_reachability.capitalize()}"] = 1
    return flags


async def _replicate(proc: asyncio.subprocess.Process, sock: Path, errors: deque[str], drainer: asyncio.Future,
                     proc_done: asyncio.Future) -> P2P:
    """Once p2pd (``proc``) listens on ``sock``, connect to it (``P2P.replicate``). Raises
    RuntimeError naming p2pd's last ``errors`` lines (all in once ``drainer`` ends) when it
    exits first (``proc_done``); the caller bounds the wait."""
    while not sock.exists():
        if proc.returncode is not None:
            raise RuntimeError(f"p2pd exited ({proc.returncode}): {' | '.join(errors) or 'no message'}")
        await asyncio.sleep(0.02)
    replica = asyncio.ensure_future(P2P.replicate(Multiaddr(f"/unix{sock}")))
    await asyncio.wait([replica, proc_done], return_when=asyncio.FIRST_COMPLETED)
    if not replica.done():
        replica.cancel()
        await drainer  # p2pd exited: its last words are in
        raise RuntimeError(f"p2pd exited ({proc.returncode}): {' | '.join(errors) or 'no message'}")
    return replica.result()


# hivemind's ControlClient keeps its persistent connection to p2pd in two tasks that nothing
# awaits (hivemind 1.1.12, p2p_daemon_bindings/control.py): when p2pd dies they end with the
# connection's error, which asyncio logs with a traceback once the tasks are collected
_CONTROL_CONN_TASKS = ("ControlClient._read_from_persistent_conn", "ControlClient._write_to_persistent_conn")


def quiet_dead_daemon_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Have ``loop`` drop the "Task exception was never retrieved" report of a dead daemon's
    control-connection tasks (``_CONTROL_CONN_TASKS``, a ConnectionError or a closed transport's
    RuntimeError: the death is already handled and said in one line by the node); every other
    report goes to the handler set before (or asyncio's default). Call once the daemon died;
    calling it again does nothing."""
    previous = loop.get_exception_handler()
    if getattr(previous, "quiets_dead_daemons", False):
        return

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        task = context.get("future")
        name = getattr(task.get_coro(), "__qualname__", "") if isinstance(task, asyncio.Task) else ""
        if name in _CONTROL_CONN_TASKS and isinstance(context.get("exception"), (ConnectionError, RuntimeError)):
            log.debug("the dead daemon's %s ended: %s", name, context.get("exception"))
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    handler.quiets_dead_daemons = True  # type: ignore[attr-defined]
    loop.set_exception_handler(handler)


OWNER_ONLY = 0o077  # umask while the sockets are created: no permission for group and others


@contextlib.contextmanager
def private_sockets() -> Iterator[None]:
    """Hold the process umask at (its value | 077) for the block: p2pd, forked meanwhile,
    inherits it and creates its control socket owner-only (srwx------), and so does hivemind's
    client socket, bound when the first stream handler is added (``P2P.add_binary_stream_handler``
    starts its listener): connect(2) to a unix socket needs write permission on it (unix(7)),
    so no other local user can open either. The umask is per process: nested and concurrent
    blocks (several swarms in one process) share one hold, restored when the last one ends;
    files this process creates meanwhile get no group or other permission either, never more."""
    global _umask_holds, _umask_saved
    with _umask_lock:
        if _umask_holds == 0:
            _umask_saved = os.umask(OWNER_ONLY)
            os.umask(_umask_saved | OWNER_ONLY)
        _umask_holds += 1
    try:
        yield
    finally:
        with _umask_lock:
            _umask_holds -= 1
            if _umask_holds == 0:
                os.umask(_umask_saved)


_umask_lock = threading.Lock()
_umask_holds, _umask_saved = 0, 0o022  # blocks inside private_sockets; the umask they replaced


def check_owner_only(p2p: P2P) -> None:
    """Check that ``p2p``'s control socket (``P2P.daemon_listen_maddr``) gives group and others
    no permission.

    Raises:
        NetworkError: it does (p2pd was not started inside :func:`private_sockets`)."""
    path = str(p2p.daemon_listen_maddr).removeprefix("/unix")
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & OWNER_ONLY:
        raise NetworkError(f"the libp2p daemon's socket {path} is open to other local users (mode {mode:o})")



async def start_dht(p2p: P2P, initial_peers: Sequence[str], bootstrap_timeout: float,
                    records: SignedRecords, strict: bool = True) -> DHTNode:
    """Start the DHT node on ``p2p``, joining through ``initial_peers``, every record checked by
    ``records``. The daemon is shut down if this fails. ``strict``: hivemind's bootstrap
    validation (the initial peer dials us back, and its clock is within 3 s of ours); False
    when ``p2pdiloco.net.transport.clock`` measured an initial peer's clock more than 2 s off ours, so
    that a skew it corrects for does not fail the join (hivemind then only logs both checks).

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
            strict=strict,
            cache_refresh_before_expiry=0,  # no hidden re-reads: the node reads the DHT when it needs to
            # lookups are validated per entry by SignedRecords.lookup (docs/trust.md, "Signed records"),
            # which lets hivemind merge unchecked entries: its merged answer must neither be cached
            # (and served to others) nor handed to a concurrent lookup of the same key
            cache_locally=False,
            cache_nearest=0,
            reuse_get_requests=False,
        )
    except Exception as e:
        await p2p.shutdown()
        if initial_peers:
            raise NetworkError(_no_peers_message(initial_peers)) from None
        raise NetworkError(f"the DHT did not start: {short_error(e)}") from None
    return dht


async def rejoin_dht(dht: DHTNode, initial_peers: Sequence[str]) -> int:
    """Ping the peers of ``initial_peers`` (multiaddrs with /p2p/) from ``dht`` with hivemind's
    ``DHTProtocol.call_ping``, as ``DHTNode.create`` does to join: p2pd dials each again from
    its peerstore, and each that answers is back in the routing table. For a node that lost
    every connection (a router that reset them, a link down a while): in tests/internet neither
    the DHT nor p2pd reconnected within 5 minutes. Returns how many answered; never raises."""
    peers = {m.rsplit("/p2p/", 1)[1] for m in initial_peers if "/p2p/" in m}
    try:
        answers = await asyncio.gather(*(dht.protocol.call_ping(PeerID.from_base58(p)) for p in peers),
                                       return_exceptions=True)
    except Exception as e:  # a malformed peer ID: the node's own settings, checked at start
        log.debug("rejoining the DHT: %s", e)
        return 0
    return sum(1 for a in answers if a is not None and not isinstance(a, BaseException))



def _no_peers_message(initial_peers: Sequence[str]) -> str:
    return (f"none of the initial peers answered ({', '.join(initial_peers)}); check the addresses, "
            "or start a new swarm with `p2pdiloco bootstrap` and join its printed multiaddr")

def listening_maddrs(host_maddrs: Sequence[str], daemon_pid: int | None) -> list[str]:
    """``host_maddrs`` with a TCP port 0 (any) replaced by the port p2pd listens on, read from
    the process's sockets (the first listening TCP port; unchanged when it cannot be read)."""
    ports: list[int] = []
    with contextlib.suppress(psutil.Error):
        if daemon_pid is not None:
            ports = sorted({c.laddr.port for c in psutil.Process(daemon_pid).net_connections("tcp")
                            if c.status == psutil.CONN_LISTEN})
    if not ports:
        return list(host_maddrs)
    return [m.replace("/tcp/0", f"/tcp/{ports[0]}") if m.endswith("/tcp/0") else m for m in host_maddrs]

