"""A running node's local-only control endpoint and its Prometheus metrics.

Control endpoint: a Unix socket ``control.sock`` in the node's data dir (or in a private
temporary folder when the node has none), mode 0600, so only the user who runs the node can
read it and nothing is exposed to the network. Protocol: the client sends one line
(``status``), the node answers its JSON snapshot on one line and closes. A node that died
leaves its socket file behind; connecting to it fails at once (connection refused), so
``p2pdiloco node status`` reports it unreachable instead of hanging.

Metrics: :func:`start_metrics` serves the same snapshot as Prometheus gauges and counters
over HTTP (prometheus-client), bound to 127.0.0.1 unless told otherwise.

The client half (:func:`query`, :func:`find_socket`) uses only the standard library, so
``p2pdiloco node status`` answers in a fraction of a second (no torch, no hivemind).
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from p2pdiloco.errors import NetworkError
from p2pdiloco.status import Connecting, Snapshot, Status

log = logging.getLogger(__name__)

SOCKET_NAME = "control.sock"
TEMP_PREFIX = "p2pdiloco-node-"  # temporary control folders of nodes without a data dir
MAX_SOCKET_PATH = 100  # bytes; sun_path holds 108 on Linux, 104 on macOS
QUERY_TIMEOUT = 3.0  # seconds a client waits for a node's answer

Provider = Callable[[], dict[str, Any]]  # the status JSON the control socket answers
SnapshotProvider = Callable[[], Snapshot]  # the snapshot the metrics endpoint reads


class ControlUnreachable(NetworkError):
    """No node answered on a control socket (none there, dead, hung, or not ours)."""


def _connectable(path: str) -> str:
    """The path to pass to connect/bind: a path too long for sun_path is resolved through its
    symlink (the server links ``data_dir/control.sock`` to a short one when needed)."""
    return os.path.realpath(path) if len(os.fsencode(path)) > MAX_SOCKET_PATH else path


class ControlServer:
    """Serves ``provider()`` as JSON on a Unix socket. Create with :meth:`start`; ``close``.

    Attributes:
        path: the socket path clients use (``data_dir/control.sock`` or a temporary one).
    """

    def __init__(self, path: Path, cleanup: list[Path]):
        self.path, self._cleanup = path, cleanup
        self._server: asyncio.AbstractServer | None = None
        self.provider: Provider = lambda: {"state": "starting", "pid": os.getpid()}

    @classmethod
    async def start(cls, data_dir: Path | None) -> ControlServer:
        """Bind ``data_dir/control.sock`` (a private temporary folder when ``data_dir`` is None).

        Raises:
            NetworkError: another node answers on that socket (same data dir), or it cannot be bound.
        """
        cleanup: list[Path] = []
        if data_dir is None:
            folder = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))  # mode 0700
            cleanup.append(folder)
            path = folder / SOCKET_NAME
        else:
            path = data_dir / SOCKET_NAME
        await asyncio.to_thread(_refuse_if_running, path)
        bind_path = path
        if len(os.fsencode(str(path))) > MAX_SOCKET_PATH:  # too long for sun_path: bind a short one, link it
            folder = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))
            cleanup.append(folder)
            bind_path = folder / SOCKET_NAME
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(bind_path))
            os.chmod(bind_path, 0o600)  # before listen(): nobody can connect in between
            if bind_path != path:
                path.symlink_to(bind_path)
            sock.listen(16)
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            for p in (path, bind_path):
                if p.is_symlink() or p.is_socket():
                    p.unlink(missing_ok=True)
            _remove(cleanup)
            raise NetworkError(f"cannot open the control socket {path}: {e.strerror or e}") from None
        cleanup[:0] = [path] + ([bind_path] if bind_path != path else [])
        self = cls(path, cleanup)
        self._server = await asyncio.start_unix_server(self._serve, sock=sock)
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(2.0):
                line = await reader.readline()
            command = line.decode("utf-8", "replace").strip() or "status"
            if command == "status":
                try:
                    body = self.provider()
                except Exception as e:  # a bug in a figure must not take the node down
                    log.exception("status snapshot failed")
                    body = {"error": f"snapshot failed: {type(e).__name__}: {e}"}
            else:
                body = {"error": f"unknown command {command[:40]!r}; known: status"}
            writer.write(json.dumps(body, default=str).encode() + b"\n")
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        """Stop serving and remove the socket (and its temporary folder)."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
        _remove(self._cleanup)


def _remove(paths: list[Path]) -> None:
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _refuse_if_running(path: Path) -> None:
    """Remove a stale socket left by a dead node; refuse when a node accepts connections on it."""
    if not (path.is_socket() or path.is_symlink()):
        if path.exists():
            raise NetworkError(f"{path} exists and is not a control socket; remove it or choose another --data-dir")
        return
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            s.connect(_connectable(str(path)))
    except (ConnectionRefusedError, FileNotFoundError):  # nobody listens: a node died there
        target = Path(os.path.realpath(path))
        path.unlink(missing_ok=True)
        if target != path and target.is_socket():
            target.unlink(missing_ok=True)
        return
    except OSError as e:
        raise NetworkError(f"cannot check the control socket {path}: {e.strerror or e}") from None
    try:
        pid = query(str(path), timeout=2.0).get("pid", "?")
    except ControlUnreachable:
        pid = "?"
    raise NetworkError(f"another node (pid {pid}) is already running with data dir {path.parent}; "
                       "stop it first or choose another --data-dir")


# ---- client -------------------------------------------------------------------------------
def query(path: str, timeout: float = QUERY_TIMEOUT, command: str = "status") -> dict[str, Any]:
    """Ask the node at control socket ``path`` for its snapshot.

    Raises:
        ControlUnreachable: one line saying why (no socket, node dead, no answer in ``timeout`` s).
    """
    where = f"control socket {path}"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(_connectable(path))
            s.sendall(command.encode() + b"\n")
            chunks = []
            while True:
                chunk = s.recv(1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
    except FileNotFoundError:
        raise ControlUnreachable(f"no node is running there: {path} does not exist (is it the data dir or "
                                 "socket the node was started with?)") from None
    except ConnectionRefusedError:
        raise ControlUnreachable(f"the node is not running: nothing listens on its {where} "
                                 "(it exited or was killed; check its log)") from None
    except TimeoutError:
        raise ControlUnreachable(f"the node did not answer within {timeout:g} s on its {where} "
                                 "(hung, stopped with SIGSTOP, or overloaded)") from None
    except PermissionError:
        raise ControlUnreachable(f"permission denied on {where}: run as the user that runs the node") from None
    except OSError as e:
        raise ControlUnreachable(f"cannot reach the node on its {where}: {e.strerror or e}") from None
    try:
        reply = json.loads(b"".join(chunks))
    except ValueError:
        raise ControlUnreachable(f"the node closed its {where} without a complete answer "
                                 "(it is probably shutting down)") from None
    if not isinstance(reply, dict):
        raise ControlUnreachable(f"unexpected answer on {where}")
    if "error" in reply:
        raise ControlUnreachable(f"the node answered with an error: {reply['error']}")
    return reply


def temp_sockets() -> list[str]:
    """Live control sockets of this user's nodes that run without a data dir. Sockets left by
    killed nodes (nothing listens) are removed with their temporary folder on the way."""
    pattern = os.path.join(tempfile.gettempdir(), f"{TEMP_PREFIX}*", SOCKET_NAME)
    live = []
    for path in sorted(glob.glob(pattern)):
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(1.0)
                s.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            with contextlib.suppress(OSError):
                os.unlink(path)
                os.rmdir(os.path.dirname(path))
            continue
        except OSError:  # busy or hung: still a node; query() will say what is wrong
            pass
        live.append(path)
    return live


def find_socket(data_dir: str | None, socket_path: str | None) -> str:
    """The control socket to ask: ``--socket``, else ``--data-dir``/control.sock, else the only
    temporary one of a node started without a data dir.

    Raises:
        ControlUnreachable: none found, or several and the caller must choose.
    """
    if socket_path:
        return socket_path
    if data_dir:
        if not os.path.isdir(data_dir):
            raise ControlUnreachable(f"no node is running there: {data_dir} is not a folder (pass the node's "
                                     "--data-dir)")
        return os.path.join(data_dir, SOCKET_NAME)
    found = temp_sockets()
    if len(found) == 1:
        return found[0]
    if not found:
        raise ControlUnreachable("no running node found; pass the node's --data-dir DIR, or --socket PATH "
                                 "(a node without a data dir logs its control socket at start)")
    raise ControlUnreachable(f"{len(found)} nodes run without a data dir; choose one with --socket: "
                             + ", ".join(found))


# ---- Prometheus ---------------------------------------------------------------------------
# (type, metric name, help, snapshot key); counters get "_total" appended by the client library
SCALAR_METRICS = (
    ("gauge", "p2pdiloco_uptime_seconds", "seconds since the node started", "uptime_s"),
    ("gauge", "p2pdiloco_inner_step", "inner (AdamW) steps taken", "step"),
    ("gauge", "p2pdiloco_tokens_per_second", "training throughput (tokens/s)", "tokens_per_s"),
    ("gauge", "p2pdiloco_loss", "training loss, EMA (nats per token: per byte without a tokenizer)", "loss"),
    ("gauge", "p2pdiloco_heldout_loss", "held-out loss of the local model (nats per token: per byte without a tokenizer)", "heldout_loss"),
    ("gauge", "p2pdiloco_connected_peers", "libp2p connections now", "connections"),
    ("gauge", "p2pdiloco_link_bytes_per_second", "measured link rate: median of large replies to its calls (bytes/s)",
     "link_bytes_per_s"),
    ("counter", "p2pdiloco_tokens", "tokens trained by this node", "tokens"),
    ("counter", "p2pdiloco_tokens_merged", "tokens of this node's contributions merged", "tokens_merged"),
    ("counter", "p2pdiloco_catchups", "fragment states downloaded from peers", "catchups"),
    ("counter", "p2pdiloco_resyncs", "downloads of a fragment at the version already held (split brain lost)",
     "resyncs"),
    ("counter", "p2pdiloco_bytes_sent", "RPC bytes sent", "bytes_out"),
    ("counter", "p2pdiloco_bytes_received", "RPC bytes received", "bytes_in"),
    ("counter", "p2pdiloco_bytes_relayed", "RPC bytes exchanged with peers reached only through a relay",
     "bytes_relayed"),
    ("counter", "p2pdiloco_rounds_alone", "committed rounds with no other member", "rounds_alone"),
    ("counter", "p2pdiloco_rounds_excluded", "rounds merged without this node's contribution (kept for the next)",
     "rounds_excluded"),
    ("counter", "p2pdiloco_rounds_superseded", "merged rounds dropped: the fragment moved to another state meanwhile",
     "rounds_superseded"),
)


class SnapshotCollector:
    """A prometheus-client collector that turns the node's snapshot (``p2pdiloco.status``) into
    metric families at every scrape (so the figures are never stale and need no bookkeeping)."""

    def __init__(self, provider: SnapshotProvider):
        self.provider = provider

    def describe(self) -> list:
        return []  # dynamic labels; registering must not call collect() before the node exists

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily  # noqa: PLC0415

        s = self.provider()
        connected = isinstance(s, (Connecting, Status))
        info = {"name": s.name, "peer_id": s.peer_id if connected else "", "run_id": s.run_id}
        yield InfoMetricFamily("p2pdiloco_node", "this node's name, peer ID and run", value=info)
        state = GaugeMetricFamily("p2pdiloco_state", "1 for the node's current state", labels=["state"])
        state.add_metric([s.state], 1)
        yield state
        if connected and s.reachability:
            reach = GaugeMetricFamily("p2pdiloco_reachability", "1 for how peers can dial this node "
                                      "(public, behind NAT, relayed, ...)", labels=["state"])
            reach.add_metric([s.reachability], 1)
            yield reach
        for kind, name, doc, key in SCALAR_METRICS:  # a starting node has only its uptime
            value = getattr(s, key, None)
            if isinstance(value, (int, float)) and value == value:  # unknown yet (None, NaN): left out
                yield (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, value=value)
        if isinstance(s, Status):
            yield from _status_metrics(s)


def _status_metrics(s: Status) -> Iterator[Any]:
    """The metric families of a running node's counters by label (rounds, rejections,
    fragment versions) and of the swarm as it read it."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # noqa: PLC0415
    rounds = CounterMetricFamily("p2pdiloco_rounds", "outer rounds by outcome", labels=["outcome"])
    for outcome, n in (("committed", s.rounds_committed), ("failed", s.rounds_failed), ("late", s.rounds_late)):
        rounds.add_metric([outcome], n)
    yield rounds
    rejected = CounterMetricFamily("p2pdiloco_rejected_contributions", "contributions refused, by reason",
                                   labels=["reason"])
    for reason, n in sorted(s.rejected.items()):
        rejected.add_metric([str(reason)], n)
    yield rejected
    version = GaugeMetricFamily("p2pdiloco_fragment_version", "version of each fragment this node holds",
                                labels=["fragment"])
    newest = GaugeMetricFamily("p2pdiloco_swarm_fragment_version", "newest version of each fragment in the swarm",
                               labels=["fragment"])
    for f in s.fragment_status:
        version.add_metric([str(f.fragment)], f.version)
        if f.swarm_version is not None:
            newest.add_metric([str(f.fragment)], f.swarm_version)
    yield version
    yield newest
    if s.swarm is not None:
        yield GaugeMetricFamily("p2pdiloco_swarm_peers", "nodes of the run with a live record", value=s.swarm.peers)
        yield GaugeMetricFamily("p2pdiloco_swarm_learners", "nodes of the run still training", value=s.swarm.learners)
        yield GaugeMetricFamily("p2pdiloco_fragments_behind", "fragments where the swarm holds a newer state",
                                value=len(s.swarm.behind))


def check_metrics_port(host: str, port: int) -> None:
    """Fail fast, before any daemon starts, when the metrics port cannot be bound.

    Raises:
        NetworkError: one line naming the setting to change.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise NetworkError(f"metrics_port {port} on {host}: {e.strerror or e}; choose another metrics_port "
                               "(--set metrics_port=PORT, 0: no metrics endpoint)") from None


def start_metrics(host: str, port: int, provider: SnapshotProvider) -> Callable[[], None]:
    """Serve Prometheus metrics on http://host:port/metrics; returns the function that stops it.

    Raises:
        NetworkError: the port cannot be bound.
    """
    from prometheus_client import CollectorRegistry, start_http_server  # noqa: PLC0415

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(provider))
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise NetworkError(f"cannot serve metrics on {host}:{port}: {e.strerror or e}; choose another "
                           "metrics_port (0: off)") from None

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)

    return stop
