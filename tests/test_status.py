"""Operating a node (docs/operating.md): `node status` over the control socket, `swarm status` from the
DHT, the Prometheus endpoint, against a real bootstrap peer and a real node process.

One node serves the whole module (started once, about 15 s); the last test SIGKILLs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from node.control import TEMP_PREFIX, ControlServer, ControlUnreachable, find_socket, query, temp_sockets
from node.status_view import progress, render_node, summarize_swarm, swarm_rate
from p2pdiloco.cli import main
from p2pdiloco.config import load_config
from p2pdiloco.errors import ConfigError, NetworkError
from p2pdiloco.net.transport.reachability import Reachability
from p2pdiloco.net.records.parse import parse_heads
from p2pdiloco.status import Status, conforms, keys, parse_status
from p2pdiloco.trust.identity import Identity

from tests.conftest import TINY, Harness, wait_for
from tests.conftest import running as running_pids

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    """Run `p2pdiloco ARGS` in its own session; fail if any process of that session outlives it."""
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "p2pdiloco.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True,
                            env={**os.environ, "COLUMNS": "160", "PYTHONUNBUFFERED": "1"})
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        _kill_session(proc)
    elapsed = time.monotonic() - t0
    with contextlib.suppress(AssertionError):  # killed processes take a moment to be reaped
        wait_for(lambda: not _session_members(proc.pid), 2.0, "the session to end", every=0.05)
    left = _session_members(proc.pid)
    assert not left, f"`p2pdiloco {' '.join(args)}` left processes behind: {left}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), elapsed


def _session_members(sid: int) -> list[str]:
    found = []
    for p in psutil.process_iter(["pid", "name", "status"]):
        try:
            if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(f"{p.pid} {p.info['name']}")
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


def _kill_session(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Running:
    harness: Harness
    maddr: str
    proc: subprocess.Popen
    dir: Path
    metrics_port: int

    @property
    def log(self) -> str:
        return (self.dir / "node.log").read_text()[-3000:]


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    h = Harness(tmp_path_factory.mktemp("status"))
    try:
        maddr = h.bootstrap()
        port = free_port()
        proc, d = h.node(maddr, "n0", TINY, "--duration", "600", "--set", f"metrics_port={port}")
        snap: dict = {}

        def trained() -> bool:
            nonlocal snap
            assert proc.poll() is None, (d / "node.log").read_text()[-3000:]
            try:
                snap = query(str(d / "control.sock"), timeout=2)
            except ControlUnreachable:
                snap = {}
            # the only node of its run: "alone" from the first seconds (node.alone, reason no_peers)
            return snap.get("state") == "alone" and snap.get("rounds_committed", 0) >= 2 \
                and bool(snap.get("swarm")) and snap.get("tokens_per_s", 0) > 0

        try:  # about 10 s on an idle 2-core machine
            wait_for(trained, 120, "training with 2 rounds", every=0.5, tick=h.track_daemons)
        except AssertionError:
            raise AssertionError(f"node not training with 2 rounds in 120 s: {snap}\n"
                                 f"{(d / 'node.log').read_text()[-3000:]}") from None
        yield Running(h, maddr, proc, d, port)
    finally:
        h.close()
        try:
            wait_for(lambda: not running_pids(h.daemons), 5, "the p2pd daemons to exit")
        except AssertionError:
            raise AssertionError(f"p2pd daemons outlived the test: {running_pids(h.daemons)}") from None


# ---- against the running node ---------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.timeout(90)
def test_status_json_has_every_field_and_sane_values(running):
    result, elapsed = cli("node", "status", "--json", "--data-dir", str(running.dir))
    assert result.returncode == 0, result.stderr
    assert elapsed < 20
    s = json.loads(result.stdout)
    schema = keys(Status)  # the documented JSON form (p2pdiloco.status): every key, no other, each of its type
    assert set(s) == set(schema), (set(schema) - set(s), set(s) - set(schema))
    assert all(conforms(s[k], t) for k, (t, _) in schema.items()), {k: s[k] for k, (t, _) in schema.items()
                                                                     if not conforms(s[k], t)}
    assert s["name"] == "n0" and s["run_id"] == "test" and s["state"] == "alone"
    assert s["alone"]["reason"] == "no_peers" and s["progress"]["share"] == 1.0
    assert s["pid"] == running.proc.pid
    daemon = psutil.Process(s["p2pd_pid"])
    assert daemon.name() == "p2pd" and daemon.ppid() == running.proc.pid
    assert s["maddrs"] and all(m.startswith("/ip4/127.0.0.1/tcp/") and m.endswith(f"/p2p/{s['peer_id']}")
                               for m in s["maddrs"])
    assert s["reachability"] == "loopback only"
    assert 0 < s["uptime_s"] < 600
    assert s["step"] > 0 and s["tokens"] > 0 and s["tokens_per_s"] > 0
    assert 0 < s["loss"] < 10 and 0 < s["heldout_loss"] < 10 and math.isfinite(s["loss"])
    assert s["rounds_committed"] >= 2 and s["rounds_alone"] == s["rounds_committed"] and s["rounds_failed"] == 0
    assert s["recent_rounds"] and all(r["committed"] and r["members"] == 1 and r["seconds"] >= 0
                                      for r in s["recent_rounds"])
    assert not any(s["rejected"].values()) and s["rejected_total"] == 0
    assert "rounds" in s["allreduce"] and all(isinstance(n, int) and n >= 0 for n in s["allreduce"].values())
    assert s["bytes_in"] >= 0 and s["bytes_out"] >= 0
    assert len(s["fragments"]) == 2 == len(s["fragment_status"])
    for f, (version, digest) in zip(s["fragment_status"], s["fragments"]):
        assert (f["version"], f["digest"]) == (version, digest) and version >= 1
        assert f["status"] == "newest" and f["swarm_version"] == version and f["holders"] == 1
    assert s["swarm"]["peers"] == 1 and s["swarm"]["learners"] == 1 and s["swarm"]["behind"] == []
    assert s["control_socket"] == str(running.dir / "control.sock")
    assert s["metrics"] == f"http://127.0.0.1:{running.metrics_port}/metrics"
    mode = os.stat(running.dir / "control.sock").st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_status_human_output_and_watch(running):
    result, _ = cli("node", "status", "--data-dir", str(running.dir))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    snap = query(str(running.dir / "control.sock"))
    for needle in ("state", "training", "peer ID", snap["peer_id"], "addresses", "reachability", "loopback only",
                   "warning", "--host 0.0.0.0", "swarm", "1 node with a live record", "merging with no other node", "tokens/s",
                   "held-out", "rounds", "committed", "rejected", "traffic", "p2pd pid", "uptime", "fragments",
                   "swarm newest", "recent rounds"):
        assert needle in out, f"{needle!r} missing from:\n{out}"
    with subprocess.Popen([sys.executable, "-m", "p2pdiloco.cli", "node", "status", "--socket",
                           str(running.dir / "control.sock"), "--json", "--watch", "0.5"],
                          stdout=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True) as watch:
        try:
            steps = [json.loads(watch.stdout.readline())["step"] for _ in range(3)]
        finally:
            _kill_session(watch)
    assert steps == sorted(steps) and steps[-1] > steps[0]


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_metrics_endpoint_serves_the_figures(running):
    with urllib.request.urlopen(f"http://127.0.0.1:{running.metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines() if line and not line.startswith("#")}
    for name in ("p2pdiloco_inner_step", "p2pdiloco_tokens_total", "p2pdiloco_tokens_per_second",
                 "p2pdiloco_loss", "p2pdiloco_heldout_loss", "p2pdiloco_bytes_sent_total",
                 "p2pdiloco_bytes_received_total", 'p2pdiloco_rounds_total{outcome="committed"}',
                 'p2pdiloco_rounds_total{outcome="failed"}', 'p2pdiloco_fragment_version{fragment="0"}',
                 'p2pdiloco_swarm_fragment_version{fragment="1"}', "p2pdiloco_swarm_peers",
                 'p2pdiloco_state{state="alone"}', "p2pdiloco_uptime_seconds"):
        assert name in values, f"{name} missing:\n{text}"
    assert values["p2pdiloco_inner_step"] > 0 and values['p2pdiloco_rounds_total{outcome="committed"}'] >= 2
    assert values["p2pdiloco_swarm_peers"] == 1
    assert any(k.startswith("p2pdiloco_node_info{") and 'name="n0"' in k for k in values)


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_swarm_status_lists_the_node_and_leaves(running):
    before = query(str(running.dir / "control.sock"))
    peer = before["peer_id"]
    result, elapsed = cli("swarm", "status", "--initial-peers", running.maddr, "--run-id", "test", "--json")
    assert result.returncode == 0, result.stderr
    view = json.loads(result.stdout)
    (rec,) = [p for p in view["peers"] if p["peer_id"] == peer]
    assert rec["name"] == "n0" and rec["state"] == "alone" and not rec["done"]
    assert rec["share"] == 1.0 and rec["status"] == ["newest", "newest"]  # as its node status counts them
    # the node's record as it stands (st.record), not the DHT's copy, stored every 300 s
    assert all(v >= b for v, (b, _) in zip(rec["versions"], before["fragments"])), (rec, before["fragments"])
    assert rec["step"] >= before["step"] and elapsed < 30
    assert rec["step"] > 0 and rec["tokens_per_s"] > 0 and 0 < rec["loss"] < 10
    assert len(rec["versions"]) == 2 and all(v >= 1 for v in rec["versions"])
    assert 0 <= rec["last_seen_s"] < 60
    assert len(view["newest"]) == 2
    human, _ = cli("swarm", "status", "--initial-peers", running.maddr, "--run-id", "test")
    assert human.returncode == 0, human.stderr
    assert "swarm test: 1 node with a live record, 1 training" in human.stdout and "n0" in human.stdout
    assert peer[-8:] in human.stdout
    empty, _ = cli("swarm", "status", "--initial-peers", running.maddr, "--run-id", "other-run", "--wait", "2")
    assert empty.returncode == 1 and "no node of run 'other-run'" in empty.stderr


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_second_node_on_the_same_data_dir_is_refused(running):
    result, _ = cli("node", "run", "--initial-peers", running.maddr, "--host", "127.0.0.1", "--port", "0",
                          "--run-id", "test", "--data-dir", str(running.dir), "--no-progress")
    assert result.returncode == 1
    assert f"another node (pid {running.proc.pid}) is already running with data dir {running.dir}" in result.stderr
    assert (running.dir / "control.sock").is_socket() and running.proc.poll() is None


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_hung_then_killed_node_is_reported_unreachable_fast(running):
    """Runs last: it stops the module's node."""
    sock = str(running.dir / "control.sock")
    p2pd = query(sock)["p2pd_pid"]
    os.kill(running.proc.pid, signal.SIGSTOP)  # hung: connects, never answers
    try:
        t0 = time.monotonic()
        with pytest.raises(ControlUnreachable, match="did not answer within 1 s"):
            query(sock, timeout=1)
        assert time.monotonic() - t0 < 2
        result, elapsed = cli("node", "status", "--data-dir", str(running.dir), "--timeout", "1")
    finally:
        os.kill(running.proc.pid, signal.SIGKILL)
        running.proc.wait(10)
    # the command's own wait is bounded (above); the bound here also covers a loaded machine's start-up
    assert result.returncode == 1 and elapsed < 20
    assert result.stderr.count("\n") == 1 and "did not answer within 1 s" in result.stderr
    assert result.stdout == ""
    t0 = time.monotonic()
    with pytest.raises(ControlUnreachable, match="the node is not running"):
        query(sock)
    assert time.monotonic() - t0 < 0.5  # refused at once, no timeout involved
    for args in (["--data-dir", str(running.dir)], ["--socket", sock, "--json"]):
        dead, elapsed = cli("node", "status", *args)
        assert dead.returncode == 1 and elapsed < 20, dead
        assert dead.stdout == "" and dead.stderr.count("\n") == 1
        assert dead.stderr.startswith("p2pdiloco: the node is not running") and sock in dead.stderr
    def daemon_gone() -> bool:
        try:
            return psutil.Process(p2pd).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_for(daemon_gone, 10, "its p2pd to exit with it")


# ---- without a node ---------------------------------------------------------------------------
def test_no_node_and_bad_arguments_give_one_line(tmp_path, capsys):
    def run(*args: str) -> tuple[int, str]:
        code = main(list(args))
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, (out, err)
        return code, err

    code, err = run("node", "status", "--data-dir", str(tmp_path))
    assert code == 1 and "does not exist" in err
    code, err = run("node", "status", "--data-dir", str(tmp_path / "nope"))
    assert code == 1 and "is not a folder" in err
    code, err = run("swarm", "status", "--run-id", "x")
    assert code == 2 and "--initial-peers" in err
    code, err = run("swarm", "status", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--run-id", "x")
    assert code == 2 and "missing the /p2p/PEER_ID part" in err
    with pytest.raises(ConfigError, match="metrics_port: must be in 1..65535"):
        load_config(overrides={"metrics_port": "70000"}, env={})
    with pytest.raises(ConfigError, match="metrics_host"):
        load_config(overrides={"metrics_host": "localhost"}, env={})


def test_metrics_port_in_use_is_refused_before_any_daemon(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result, _ = cli("node", "run", "--host", "127.0.0.1", "--port", "0", "--data-dir", str(tmp_path / "n"),
                              "--set", f"metrics_port={port}", "--no-progress")
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert f"metrics_port {port} on 127.0.0.1" in result.stderr and "choose another metrics_port" in result.stderr


def test_control_server_serves_refuses_twins_and_cleans_up(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)  # longer than a Unix socket path may be
    deep.mkdir(parents=True)

    async def go() -> None:
        server = await ControlServer.start(deep)
        server.provider = lambda: {"state": "training", "pid": 42}
        assert server.path == deep / "control.sock" and server.path.is_symlink()
        assert await asyncio.to_thread(query, str(server.path)) == {"state": "training", "pid": 42}
        assert (await asyncio.to_thread(query, find_socket(str(deep), None)))["pid"] == 42
        with pytest.raises(NetworkError, match="another node .pid 42. is already running"):
            await ControlServer.start(deep)
        server.provider = lambda: 1 / 0
        with pytest.raises(ControlUnreachable, match="snapshot failed: ZeroDivisionError"):
            await asyncio.to_thread(query, str(server.path))
        target = server.path.resolve()
        await server.close()
        assert not server.path.exists() and not server.path.is_symlink() and not target.exists()

    asyncio.run(go())
    stale = tmp_path / "stale"  # a socket file nobody listens on: what a killed node leaves
    stale.mkdir()
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale / "control.sock"))
    with pytest.raises(ControlUnreachable, match="the node is not running"):
        query(str(stale / "control.sock"))

    async def restart() -> None:  # a new node removes the stale socket and serves
        server = await ControlServer.start(stale)
        assert await asyncio.to_thread(query, str(stale / "control.sock")) == {"state": "starting", "pid": os.getpid()}
        await server.close()

    asyncio.run(restart())


def test_reachability_and_views_of_crafted_records():
    reachability = Reachability().state  # not checked: from the announced addresses alone
    assert reachability(["/ip4/127.0.0.1/tcp/1/p2p/Qm"]) == "loopback only"
    assert reachability(["/ip4/127.0.0.1/tcp/1", "/ip4/192.168.1.5/tcp/1"]) == "direct, private network only"
    assert reachability(["/ip4/8.8.8.8/tcp/1"]) == "direct"
    assert reachability(["/ip4/8.8.8.8/tcp/1/p2p/Qm/p2p-circuit"]) == "relayed"
    a, b = bytes.fromhex("a" * 64), bytes.fromhex("b" * 64)  # digests as sent
    now = 1000.0
    peer_a, peer_b = Identity.generate().peer_id, Identity.generate().peer_id
    records = {
        peer_a: {"f": [[3, a], [2, a]], "t": now - 2, "name": "n0", "state": "training", "done": False, "step": 9,
                  "tps": 5.0, "loss": 2.5, "m": 10000, "k": 6000},
        peer_b: {"f": [[3, a], [1, b]], "t": now - 30, "name": "n1", "state": "leaving", "done": True, "step": 4,
                  "tps": 3.0, "loss": None, "m": 8000, "k": 4000},
        "junk": "not a record",
        "not-a-peer-id": {"f": [[9, a], [9, a]], "t": now, "name": "forged"},  # unsigned: ignored
    }
    view = summarize_swarm("r", records, now)
    assert view["newest"] == [3, 2] and view["malformed"] == 2
    by_name = {p["name"]: p for p in view["peers"]}
    assert by_name["n0"]["behind"] == [] and by_name["n1"]["behind"] == [1]
    assert by_name["n1"]["last_seen_s"] == 30.0 and by_name["n0"]["versions"] == [3, 2]
    # the run's progress: the median-high of the records' counts, the live nodes' rate; each
    # node's share of the tokens merged into its own states (what its `node status` shows)
    assert view["progress"] == {"tokens": 10000, "tokens_per_s": 5.0, "shares": {peer_a: 0.6, peer_b: 0.5}}
    assert by_name["n1"]["share"] == 0.5 and by_name["n0"]["status"] == ["newest", "newest"]
    # a node's own figures: 5000 of a 20000-token target at 50 tokens/s: 25 %, 300 s left
    live = {peer_a: parse_heads(records[peer_a] | {"tps": 50.0})}
    assert progress(5000, 1000.0, 20000, swarm_rate(live)).to_json() == {"tokens": 5000, "target_tokens": 20000, "done": 0.25,
                                                   "tokens_per_s": 50.0, "eta_s": 300, "share": 0.2}
    assert progress(0, 0, 0, None).to_json() == {"tokens": 0, "target_tokens": None, "done": None, "tokens_per_s": None,
                                       "eta_s": None, "share": None}
    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(render_node(parse_status({"name": "x", "run_id": "r", "state": "starting", "pid": 1, "uptime_s": 3})))
    assert "starting" in console.export_text()


def test_the_view_names_the_codec_and_its_error_feedback():
    from rich.console import Console

    outer = {"fragments": 4, "sync_every": 100, "lr": 2.5, "momentum": 0.0, "wire_precision": "topk2",
             "error_feedback_decay": 0.65, "min_quorum": 1}
    console = Console(width=200, record=True)
    console.print(render_node(parse_status({"name": "x", "run_id": "r", "state": "training", "pid": 1, "uptime_s": 3,
                                            "outer": outer})))
    text = console.export_text()
    assert "topk2 on the wire (error feedback decay 0.65)" in text and "lr 2.5" in text


def test_node_without_data_dir_gets_a_private_socket_and_stale_ones_are_swept():
    async def go() -> None:
        server = await ControlServer.start(None)
        stale = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))  # what a killed node without data dir leaves
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(stale / "control.sock"))
        try:
            assert stat.S_IMODE(os.stat(server.path.parent).st_mode) == 0o700
            assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
            found = await asyncio.to_thread(temp_sockets)
            assert str(server.path) in found and not stale.exists()
        finally:
            await server.close()
        assert not server.path.parent.exists()

    asyncio.run(go())


def test_the_demo_result_fits_80_columns_with_whole_digests_and_the_clock(monkeypatch):
    """The demo's result at 80 columns: every line fits, and each node's whole 16-hex global
    digest is printed (the README has the reader compare them); where they differ, the
    fragments' 12-hex digests follow. The live title's clock: no estimate before a node trains,
    then at most --duration."""
    from rich.console import Console

    from node import demo_view

    def report(name: str, digest: str, frag: str, v: int = 163) -> dict:
        return {"name": name, "state": "stopped", "start_loss": 5.388, "end_loss": 1.296, "end_bits_per_byte": 1.87, "tokens": 1234567,
                "rounds_committed": 164, "catchups": 12, "rounds_with_peers": 160, "global_digest": digest,
                "fragments": [[v, frag * 64], [164, frag * 64], [v, frag * 64], [164, frag * 64]]}

    reports = [parse_status(report("node0", "9934eb4392eaaf9b", "a")), parse_status(report("node1", "9934eb4392eaaf9b", "a")),
               parse_status(report("node2", "0123456789abcdef", "b", 165))]
    console = Console(width=80, record=True, color_system=None)
    monkeypatch.setattr(demo_view, "console", console)
    assert demo_view.final_table(reports, [0, 0, 0]) is False  # node2 holds other fragments: I1 broken
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert text.count("9934eb4392eaaf9b") == 2 and "0123456789abcdef" in text
    assert "165:" + "b" * 12 in demo_view.digest_lines(reports)
    assert "163:" not in demo_view.digest_lines(reports[:2])  # equal digests: no fragment lines
    clock = demo_view.Clock(100.0)
    assert clock.left([parse_status({"name": "n", "state": "joining", "step": 0})]) is None
    left = clock.left([parse_status({"name": "n", "state": "training", "step": 3})])
    assert left is not None and 99.0 < left <= 100.0
