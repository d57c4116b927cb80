"""Run manifests: made once by the run's owner, verified by every node, refused when altered;
nodes that join with one train together; a node whose own setting differs is refused with one
line naming it, before any daemon starts (real nodes over loopback for the last two)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import os
import random
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

import msgpack
import psutil
import pytest

from conftest import TINY, read_report, wait_for
from p2pdiloco import manifest
from p2pdiloco.config import load_config
from p2pdiloco.errors import ConfigError
from p2pdiloco.trust.identity import Identity

PEER = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWLjcrBiAfYefCLrWvn1dxAg8fTnBN4ZUhWEUbnRXgD4Av"


def _made(**overrides: str) -> tuple[manifest.RunManifest, Identity]:
    owner = Identity.generate()
    cfg = load_config(env={}, overrides={"swarm.run_id": "r1", "swarm.initial_peers": PEER, **overrides})
    return manifest.RunManifest.create(owner, cfg, target_tokens=10**6, now=1_800_000_000), owner


def test_a_manifest_round_trips_as_a_file_and_as_a_string(tmp_path):
    m, owner = _made(**{"outer.sync_every": "50", "model.n_embd": "64"})
    assert m.settings["outer.sync_every"] == 50 and m.settings["model.n_embd"] == 64 and m.settings["seed"] == 0
    assert m.owner_id == owner.peer_id and m.initial_peers == (PEER,) and m.target_tokens == 10**6
    path = tmp_path / "r1.manifest"
    m.save(path)
    for handle in (str(path), m.to_string()):
        got = manifest.load(handle)
        assert got == m and got.digest == m.digest
    # only the settings that differ from the defaults travel: the string stays short
    changed = msgpack.unpackb(m.encode())[2]
    assert changed == [["model.n_embd", 64], ["outer.sync_every", 50]]
    assert len(m.to_string()) < 400


def test_an_altered_or_foreign_manifest_is_refused_with_one_line():
    m, _ = _made()
    fields = msgpack.unpackb(m.encode())

    def string(f: list) -> str:
        return manifest.PREFIX + base64.urlsafe_b64encode(zlib.compress(msgpack.packb(f))).decode()

    altered = [*fields[:2], [["outer.sync_every", 50]], manifest.settings_digest(
        {**m.settings, "outer.sync_every": 50}), *fields[4:]]
    other_defaults = [*fields[:3], b"\0" * 16, *fields[4:]]
    cases = {
        "signature": string(altered),  # a setting changed after signing (digest made to match)
        "version": string(other_defaults),  # made where the defaults differ
        "unknown setting": string([*fields[:2], [["outer.nope", 1]], *fields[3:]]),
        "wrong type": string([*fields[:2], [["outer.sync_every", "50"]], *fields[3:]]),
        "format": string([2, *fields[1:]]),
        "damaged": m.to_string()[:-1] + ("A" if m.to_string()[-1] != "A" else "B"),
        "cut short": m.to_string()[:-10],  # zlib gives a cut stream's start without an error
        "cut in half": m.to_string()[:len(m.to_string()) // 2],
        "a character lost": m.to_string()[:40] + m.to_string()[41:],
        "prefix only": manifest.PREFIX,
        "not a file": "/nonexistent/r1.manifest",
        "oversized": manifest.PREFIX + base64.urlsafe_b64encode(zlib.compress(bytes(10**6))).decode(),
    }
    for name, handle in cases.items():
        with pytest.raises(ConfigError) as e:
            manifest.load(handle)
        assert "\n" not in str(e.value), name
    rng = random.Random(0)
    for _ in range(2000):  # hostile bytes: a ConfigError, never anything else
        data = bytearray(m.encode())
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            assert manifest.decode(bytes(data)) == m
        except ConfigError:
            pass


def test_a_factory_outside_p2pdiloco_needs_the_nodes_consent():
    ours, _ = _made(**{"model.factory": "p2pdiloco.models.torch_lm:decoder_lm"})
    manifest.check_factory(ours, None)
    theirs = dataclasses.replace(ours, settings={**ours.settings, "model.factory": "somepkg.lm:build"})
    with pytest.raises(ConfigError, match=r"confirm with --set model.factory=somepkg.lm:build"):
        manifest.check_factory(theirs, None)
    manifest.check_factory(theirs, "somepkg.lm:build")


def test_a_setting_that_differs_from_the_run_is_refused_naming_it(tmp_path):
    m, _ = _made(**{"outer.sync_every": "50"})
    run = manifest.pinned(m)
    cfg = load_config(env={}, overrides={"data_dir": str(tmp_path), "outer.sync_every": "50"}, run=run)
    assert cfg.outer.sync_every == 50 and cfg.swarm.run_id == "r1" and cfg.data_dir == str(tmp_path)
    toml = tmp_path / "node.toml"
    toml.write_text("[model]\nn_embd = 64\n")
    for kwargs, name in [({"overrides": {"outer.sync_every": "24"}}, "outer.sync_every"),
                         ({"overrides": {"swarm.run_id": "r2"}}, "swarm.run_id"),
                         ({"env": {"P2PDILOCO_INNER_LR": "0.01"}}, "inner.lr"),
                         ({"path": toml}, "model.n_embd")]:
        with pytest.raises(ConfigError) as e:
            load_config(**{"env": {}, **kwargs}, run=run, run_source="the manifest of run 'r1'")
        assert str(e.value).startswith(f"{name} = ") and "the manifest of run 'r1'" in str(e.value)


@pytest.mark.timeout(240)
def test_two_nodes_join_with_the_manifest_only_and_a_differing_one_is_refused(harness):
    maddr = harness.bootstrap()
    run_settings = {k: v for k, v in TINY.items() if k not in ("eval_every", "data.eval_batches")}
    owner = harness.tmp / "owner"
    owner.mkdir()
    made = subprocess.run([sys.executable, "-m", "p2pdiloco.cli", "run", "init", "--run-id", "joined", "--initial-peers",
                           maddr, "--identity", str(owner / "owner.key"), "--out", str(owner / "joined.manifest"),
                           "--target-tokens", "10000000",
                           *(a for k, v in run_settings.items() for a in ("--set", f"{k}={v}"))],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    path = owner / "joined.manifest"
    m = manifest.load(str(path))

    def join(name: str, *extra: str):
        d = harness.tmp / name
        d.mkdir()
        return harness.spawn(["-m", "node", "run", "--join", str(path), "--host", "127.0.0.1", "--port", "0",
                              "--name", name, "--data-dir", str(d), "--report-file", str(d / "report.json"),
                              # started apart, the nodes end apart: each waits for the other's last rounds
                              # (settle, which ends once both are done and agree) so that both end on one
                              # state; 15 s ran out on a loaded CI machine (one fragment at v67 and v68)
                              "--duration", "14", "--set", "settle=60", *extra], d / "node.log"), d

    refused, rd = join("n2", "--set", "model.n_embd=32")
    assert harness.wait(refused, 60, rd / "node.log") == 2
    lines = (rd / "node.log").read_text().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("p2pdiloco: model.n_embd = 32 "), lines
    assert not (rd / "p2p.key").exists()  # refused before the node made its identity, let alone a daemon
    nodes = [join(f"n{i}") for i in range(2)]

    def published() -> list:  # the nodes keep the manifest in the run's DHT: `swarm status` lists it
        out = subprocess.run([sys.executable, "-m", "p2pdiloco.cli", "swarm", "status", "--initial-peers", maddr,
                              "--run-id", "joined", "--json", "--wait", "5"], capture_output=True, text=True, timeout=60)
        return json.loads(out.stdout or "{}").get("manifests") if out.returncode == 0 else None

    assert wait_for(published, 60, "the manifest in the DHT", every=1.0) == [
        {"digest": m.digest, "owner": m.owner_id, "target_tokens": 10**7}]
    for proc, d in nodes:
        assert harness.wait(proc, 180, d / "node.log") == 0, (d / "node.log").read_text()[-3000:]
    reports = [read_report(d) for _, d in nodes]
    assert all(r["run_id"] == "joined" and r["manifest"]["digest"] == m.digest for r in reports)
    assert all(r["rounds_with_peers"] > 0 for r in reports), [r["recent_rounds"] for r in reports]
    assert len({r["global_digest"] for r in reports}) == 1, [r["fragments"] for r in reports]
    # the run's progress, from the equal states' ledgers: the same on both; the target from the manifest
    progress = [r["progress"] for r in reports]
    tokens = progress[0]["tokens"]
    assert tokens > 0 and all(p["tokens"] == tokens and p["target_tokens"] == 10**7 for p in progress)
    assert all(p["done"] == round(tokens / 10**7, 4) and 0 < p["share"] <= 1 for p in progress), progress
    assert dataclasses.asdict(load_config(env={}, overrides=run_settings).model) == {
        k.split(".")[1]: v for k, v in m.settings.items() if k.startswith("model.")}


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "p2pdiloco.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=None if env is None else {**os.environ, **env})


def _init(tmp_path: Path, owner: str, run_id: str, *sets: str, target: int = 10**7) -> Path:
    out = tmp_path / f"{owner}.manifest"
    made = _cli("run", "init", "--run-id", run_id, "--identity", str(tmp_path / f"{owner}.key"), "--out", str(out),
                "--target-tokens", str(target), *(a for s in sets for a in ("--set", s)))
    assert made.returncode == 0, made.stderr
    return out


README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_toml(first_line: str) -> str:
    """The README's ```toml block whose first line starts with ``first_line``."""
    blocks = README.read_text().split("```toml\n")[1:]
    found = [b.split("```")[0] for b in blocks if b.startswith(first_line)]
    assert len(found) == 1, first_line
    return found[0]


def test_run_init_takes_the_readmes_run_toml_and_node_toml(tmp_path):
    (tmp_path / "run.toml").write_text(_readme_toml("# run.toml"))
    (tmp_path / "node.toml").write_text(_readme_toml("seed = 0 "))  # data.path names a folder that is not there
    made = {}
    for name in ("run", "node"):
        out = tmp_path / f"{name}.manifest"
        res = _cli("run", "init", "--run-id", name, "--config", str(tmp_path / f"{name}.toml"),
                   "--identity", str(tmp_path / "owner.key"), "--out", str(out))
        assert res.returncode == 0, res.stderr
        made[name] = manifest.load(str(out))
    for m in made.values():
        assert m.settings["model.n_embd"] == 128 and m.settings["outer.sync_every"] == 24
        assert not set(m.settings) & set(manifest.per_node_settings())
    assert made["node"].settings["outer.lr"] == 0.7  # the node's run settings are kept
    # per-node settings with --set are left out too (a preset of node settings, a folder that is not here)
    res = _cli("run", "init", "--run-id", "flags", "--set", "data.path=/elsewhere", "--set", "status_every=1",
               "--set", "outer.sync_every=30", "--identity", str(tmp_path / "owner.key"),
               "--out", str(tmp_path / "flags.manifest"))
    assert res.returncode == 0, res.stderr
    assert manifest.load(str(tmp_path / "flags.manifest")).settings["outer.sync_every"] == 30
    # a typo in a run setting of the file is still refused, not taken for a per-node setting
    (tmp_path / "typo.toml").write_text("[model]\nn_embed = 64\n")
    res = _cli("run", "init", "--run-id", "typo", "--config", str(tmp_path / "typo.toml"),
               "--identity", str(tmp_path / "owner.key"), "--out", str(tmp_path / "typo.manifest"))
    assert res.returncode == 2 and not (tmp_path / "typo.manifest").exists()


def test_a_damaged_or_dead_runs_handle_stops_the_joiner_in_one_line(tmp_path):
    """A handle cut short (copied in part): exit 2 before anything starts; a manifest whose
    initial peers are all gone (a dead run): exit 1, also before any daemon starts."""
    good = _init(tmp_path, "owner", "dead", target=0)
    handle = manifest.load(str(good)).to_string()
    with socket.socket() as s:  # a port nothing listens on: the run's only peer, gone
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gone = f"/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooWLjcrBiAfYefCLrWvn1dxAg8fTnBN4ZUhWEUbnRXgD4Av"
    dead = tmp_path / "gone.manifest"
    made = _cli("run", "init", "--run-id", "dead", "--initial-peers", gone, "--identity", str(tmp_path / "owner.key"),
                "--out", str(dead))
    assert made.returncode == 0, made.stderr
    for join, code in ((handle[:-12], 2), (str(dead), 1)):
        res = _cli("node", "run", "--join", join, "--host", "127.0.0.1", "--port", "0",
                   "--data-dir", str(tmp_path / "joiner"))
        assert res.returncode == code, res.stderr
        _one_line(res)  # one line, no traceback
        assert not (tmp_path / "joiner" / "p2p.key").exists()


def _one_line(res: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("p2pdiloco: ") and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def test_a_model_too_large_for_this_machine_is_refused_before_it_is_built(tmp_path):
    """A validly signed manifest of a 38.6e9-parameter GPT: the joiner refuses it in one line,
    exit 2, within 5 s, before its identity, daemon or model exist."""
    path = _init(tmp_path, "owner", "huge", "model.n_layer=96", "model.n_embd=5788")
    assert manifest.load(str(path)).settings["model.n_embd"] == 5788
    d = tmp_path / "joiner"
    t0 = time.monotonic()
    res = _cli("node", "run", "--join", str(path), "--host", "127.0.0.1", "--port", "0", "--data-dir", str(d),
               env={"XDG_CONFIG_HOME": str(tmp_path)})
    seconds = time.monotonic() - t0
    assert res.returncode == 2, res.stderr
    assert _one_line(res).startswith("p2pdiloco: model: training this 38.")
    assert seconds < 5, seconds
    assert not (d / "p2p.key").exists()  # refused before the node made its identity, let alone a daemon
    assert not (tmp_path / "p2pdiloco").exists()  # nor pinned the run's owner


def test_a_factory_models_size_comes_from_the_meta_device():
    from p2pdiloco.footprint import model_size
    from p2pdiloco.model import build_model
    from p2pdiloco.model_config import ModelConfig

    small = ModelConfig(n_layer=2, n_embd=64, factory="p2pdiloco.models.torch_lm:decoder_lm")
    built = build_model(small, 0)
    assert model_size(small) == (sum(p.numel() for p in built.parameters()), 128 * 128 * 4)  # + the causal mask
    assert model_size(ModelConfig()) == (ModelConfig().num_parameters, 0)  # the GPT: analytic
    rss = psutil.Process().memory_info().rss
    params, _ = model_size(ModelConfig(n_layer=64, n_embd=8192, factory="p2pdiloco.models.torch_lm:decoder_lm"))
    assert params > 5 * 10**10  # 200 GB of fp32, not allocated:
    assert psutil.Process().memory_info().rss - rss < 512 << 20


def test_the_first_owner_of_a_run_is_pinned_and_another_is_refused(tmp_path):
    ours, theirs = _init(tmp_path, "ours", "pinned"), _init(tmp_path, "theirs", "pinned", target=10**15)
    owners_file = tmp_path / "cfg" / "p2pdiloco" / "owners.json"
    env = {"XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    first = _cli("run", "show", str(ours), "--json", env=env)
    assert first.returncode == 0, first.stderr
    owner = manifest.load(str(ours)).owner_id
    assert json.loads(first.stdout)["owner_pinned"] == "new" and owner in first.stderr
    assert json.loads(owners_file.read_text()) == {"runs": {"pinned": owner}}
    for args in (["run", "show", str(theirs)],
                 ["node", "run", "--join", str(theirs), "--host", "127.0.0.1", "--port", "0",
                  "--data-dir", str(tmp_path / "joiner")]):
        res = _cli(*args, env=env)
        assert res.returncode == 2, res.stderr
        assert owner in _one_line(res)
    assert not (tmp_path / "joiner" / "p2p.key").exists()
    assert json.loads(owners_file.read_text()) == {"runs": {"pinned": owner}}
    again = _cli("run", "show", str(ours), "--json", env=env)
    assert again.returncode == 0 and json.loads(again.stdout)["owner_pinned"] == "same" and not again.stderr


@pytest.mark.asyncio
@pytest.mark.timeout(240)
async def test_sybil_manifests_do_not_change_what_swarm_status_shows(harness):
    """Nine strangers store manifests of the run (target 1e15) under its DHT key before a node
    republishes the owner's: `swarm status` shows the pinned owner's target only, and with no
    owner pinned it trusts none."""
    from p2pdiloco.net.transport.swarm import Swarm

    maddr = harness.bootstrap()
    ours = manifest.load(str(_init(harness.tmp, "ours", "sybil")))
    sybils = [manifest.load(str(_init(harness.tmp, f"s{i}", "sybil", target=10**15))) for i in range(9)]
    for m in [*sybils, ours]:  # each under its own storer's peer ID, as joined nodes store theirs
        swarm = await Swarm.start(initial_peers=[maddr])
        try:
            assert await swarm.store("sybil/manifest", swarm.peer_id, m.encode(), 300)
        finally:
            await swarm.shutdown()
    pinned = {"XDG_CONFIG_HOME": str(harness.tmp / "pinned")}
    assert _cli("run", "show", str(harness.tmp / "ours.manifest"), env=pinned).returncode == 0

    def status(env: dict[str, str]) -> dict:
        res = _cli("swarm", "status", "--initial-peers", maddr, "--run-id", "sybil", "--json", "--wait", "1", env=env)
        assert res.returncode == 1, res.stderr  # 1: no node of the run stored a heads record
        return json.loads(res.stdout)

    view = await asyncio.to_thread(status, pinned)
    assert view["owner"] == ours.owner_id
    assert view["manifests"] == [{"digest": ours.digest, "owner": ours.owner_id, "target_tokens": 10**7}]
    assert view["progress"]["target_tokens"] == 10**7
    view = await asyncio.to_thread(status, {"XDG_CONFIG_HOME": str(harness.tmp / "none")})
    assert view["owner"] is None and view["manifests"] == [] and view["progress"]["target_tokens"] is None
