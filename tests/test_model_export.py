"""``p2pdiloco model export | eval | sample`` on a checkpoint written by the node's own code path
(a real Setup of the TINY preset, trained, a global state installed, ``save_checkpoint``)."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest
import safetensors.torch
import torch

from p2pdiloco.cli import main
from p2pdiloco.config import load_config
from p2pdiloco.core.outer import FragmentState
from p2pdiloco.data import evaluate
from p2pdiloco.exported import CONFIG_FILE, EXPORT_FILE, MODEL_FILE
from p2pdiloco.model import build_model

from node.checkpoint import NODE_CONFIG, save_checkpoint, save_node_config
from node.committed import global_digest
from node.setup import Setup

from tests.conftest import TINY, wait_for


def _text(path: Path) -> Path:
    """About 200 KB of Python source (three 64 KiB pieces or more: one held out)."""
    sources = sorted(Path(json.__file__).parent.parent.glob("*.py"))  # the standard library's top level
    text = b"".join(p.read_bytes() for p in sources[:60])
    path.write_bytes((text * (1 + 200_000 // max(1, len(text))))[:200_000])
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    """A node's data dir whose checkpoint holds global states at versions 3 and 5 (Θ from 30
    inner steps) and local weights θ trained 20 steps further."""
    tmp = tmp_path_factory.mktemp("export")
    data_dir = tmp / "node"
    data_dir.mkdir()
    cfg = load_config(None, env={}, overrides={**TINY, "data.path": str(_text(tmp / "corpus.py")), "device": "cpu",
                                               "data.num_shards": "1", "data.shard_index": "0",
                                               "data_dir": str(data_dir)})
    setup = Setup.build(cfg, "node", "QmTestPeer")
    learner = setup.learner
    for _ in range(30):
        learner.inner_step(*setup.sampler.next())
    named = dict(setup.model.named_parameters())
    for frag, version in zip(setup.fragments, (3, 5)):
        theta = [named[s.name].detach() for s in frag.slots]
        learner.install(FragmentState.create(frag.index, version, theta, [torch.zeros_like(t) for t in theta]),
                        rebase=True)
    for _ in range(20):
        learner.inner_step(*setup.sampler.next())
    save_checkpoint(data_dir, learner, {"name": "node", "sends": [0, 0], "unsent": []})
    save_node_config(data_dir, cfg)
    return setup, data_dir, tmp


def test_export_writes_the_global_state_that_plain_torch_loads(trained, capsys) -> None:
    setup, data_dir, tmp = trained
    states = setup.learner.global_states
    out = tmp / "export"
    assert main(["model", "export", "--data-dir", str(data_dir), "--out", str(out)]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in out.iterdir()) == [CONFIG_FILE, EXPORT_FILE, MODEL_FILE]
    info = json.loads((out / EXPORT_FILE).read_text())
    assert info["fragments"] == [{"fragment": s.index, "version": s.version, "digest": s.digest} for s in states]
    assert [f["version"] for f in info["fragments"]] == [3, 5]
    assert info["global_digest"] == global_digest(states)
    config = json.loads((out / CONFIG_FILE).read_text())
    assert config["seed"] == setup.cfg.seed and config["model"]["n_embd"] == 64 and config["model"]["n_layer"] == 1

    # the README's recipe: plain torch and safetensors
    tensors = safetensors.torch.load_file(out / MODEL_FILE)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert {n for n, _ in setup.model.named_parameters()} <= set(tensors)
    model = build_model(setup.cfg.model, config["seed"])
    model.load_state_dict(tensors, strict=True)
    expected = evaluate(setup.global_model(states), setup.heldout)
    assert abs(evaluate(model, setup.heldout) - expected) <= 1e-5
    local = evaluate(setup.model, setup.heldout)  # θ trained 20 steps past Θ: not what is exported
    assert abs(local - expected) > 1e-3

    assert main(["model", "eval", "--model", str(out), "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert abs(view["loss"] - expected) <= 1e-5
    assert view["bits_per_byte"] == pytest.approx(view["loss"] / math.log(2))
    assert view["global_digest"] == info["global_digest"]


def test_sample_is_deterministic_for_a_seed(trained, capsys) -> None:
    _, data_dir, tmp = trained
    out = tmp / "export-sample"
    assert main(["model", "export", "--data-dir", str(data_dir), "--out", str(out)]) == 0
    capsys.readouterr()
    texts = []
    for seed in (7, 7, 8):
        assert main(["model", "sample", "--model", str(out), "--prompt", "def ", "--tokens", "40",
                     "--seed", str(seed)]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0] != texts[2]
    assert all(t.startswith("def ") for t in texts)
    assert main(["model", "sample", "--model", str(out), "--tokens", "-1"]) == 2


def test_refusals(trained, tmp_path: Path, capsys) -> None:
    _, data_dir, tmp = trained
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["model", "export", "--data-dir", str(empty), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no checkpoint" in err
    assert not (tmp_path / "x").exists()

    # a data dir without node-config.json: refused, unless the settings are given as for node run
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "checkpoint.pt").write_bytes((data_dir / "checkpoint.pt").read_bytes())
    assert main(["model", "export", "--data-dir", str(bare), "--out", str(tmp_path / "y")]) == 2
    assert NODE_CONFIG in capsys.readouterr().err
    sets = [a for k, v in TINY.items() for a in ("--set", f"{k}={v}")]
    assert main(["model", "export", "--data-dir", str(bare), "--out", str(tmp_path / "y"), *sets]) == 0
    # settings of another model: its tensors do not fit
    assert main(["model", "export", "--data-dir", str(bare), "--out", str(tmp_path / "z"), *sets,
                 "--set", "model.n_embd=32"]) == 2
    (bare / "checkpoint.pt").write_bytes(b"not a checkpoint")  # unreadable: exit 1, one line
    assert main(["model", "export", "--data-dir", str(bare), "--out", str(tmp_path / "z"), *sets]) == 1
    capsys.readouterr()

    # from the swarm: --initial-peers needs --run-id; one source only (usage errors, exit 2, no daemon)
    peer = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWAM1XnH6P5CbdqwPUmRnLqJBexe5WvUFZukqCyUBfCnvR"
    assert main(["model", "export", "--initial-peers", peer, "--out", str(tmp_path / "s")]) == 2
    assert "--run-id" in capsys.readouterr().err
    assert main(["model", "export", "--initial-peers", peer, "--run-id", "r", "--candidates", "0",
                 "--out", str(tmp_path / "s")]) == 2
    with pytest.raises(SystemExit) as usage:
        main(["model", "export", "--data-dir", str(data_dir), "--join", "x.manifest", "--out", str(tmp_path / "s")])
    assert usage.value.code == 2 and not (tmp_path / "s").exists()
    capsys.readouterr()

    # an export whose model file is not the one export.json describes
    (tmp_path / "y" / MODEL_FILE).write_bytes(b"\0" * 100)
    assert main(["model", "eval", "--model", str(tmp_path / "y")]) == 2
    assert main(["model", "eval", "--model", str(tmp_path)]) == 2
    assert all(line.startswith("p2pdiloco: ") for line in capsys.readouterr().err.splitlines())


def test_demo_samples_fit_80_columns(trained) -> None:
    """The demo's closing lines (node.export.before_after): the initial model's text and the
    trained global model's, same prompt and seed, at most 80 columns."""
    from node.export import before_after  # noqa: PLC0415

    setup, data_dir, _ = trained
    lines = before_after(data_dir, setup.cfg, "def ", tokens=120)
    assert all(len(line) <= 80 and line.isprintable() for line in lines)
    initial, trained_at = lines.index(" the initial model:"), next(
        i for i, line in enumerate(lines) if line.startswith(" the trained global model"))
    assert "versions 3,5" in lines[trained_at]
    assert lines[initial + 1:trained_at] != lines[trained_at + 1:]
    assert lines[initial + 1].startswith("  | def ") and lines[trained_at + 1].startswith("  | def ")


def _status(d: Path) -> dict | None:
    try:
        return json.loads((d / "status.json").read_text())
    except (OSError, ValueError):
        return None


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_export_from_the_swarm_by_someone_who_never_trained(harness, tmp_path: Path) -> None:
    """Two real nodes of a run that merge only in pairs (min_quorum 2): once one has spent its
    budget (it leaves, serving while it settles, as the other trains on), their global state no longer
    moves. A third process that never trained exports it from the swarm: the same global
    digest as both nodes report at the end, and plain torch on the safetensors gives their
    held-out loss of that state."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    corpus = _text(tmp_path / "corpus.py")
    settings = {**TINY, "data.path": str(corpus), "outer.min_quorum": "2", "data.num_shards": "1",
                "data.shard_index": "0"}
    maddr = harness.bootstrap()
    (a, da), (b, db) = (harness.node(maddr, "a", settings, "--max-steps", "100000"),
                        harness.node(maddr, "b", settings, "--max-steps", "160", "--set", "settle=240"))

    def settled() -> bool:
        sa, sb = _status(da), _status(db)
        return bool(sa and sb and sb.get("state") == "leaving" and sb.get("rounds_with_peers")
                    and not sb.get("merging")  # a's rounds wait for b in vain: no quorum of 2
                    and sa.get("global_digest") == sb.get("global_digest"))

    wait_for(settled, 200, lambda: f"b settling at a's state: {_status(da)}, {_status(db)}", every=0.5,
             tick=harness.track_daemons)
    out = tmp_path / "export"
    sets = [x for k, v in settings.items() for x in ("--set", f"{k}={v}")]
    done = subprocess.run([sys.executable, "-m", "p2pdiloco.cli", "model", "export", "--initial-peers", maddr,
                           "--run-id", "test", "--out", str(out), *sets], capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    info = json.loads((out / EXPORT_FILE).read_text())
    assert info["global_digest"] in done.stdout and info["source"] == "swarm run test"
    a.signal_leader(signal.SIGTERM)  # a leaves; b, settled with a done, leaves too
    for proc, d in ((a, da), (b, db)):
        assert harness.wait(proc, 120, d / "node.log") == 0
    reports = [json.loads((d / "report.json").read_text()) for d in (da, db)]
    assert {r["global_digest"] for r in reports} == {info["global_digest"]}, [r["fragments"] for r in reports]
    assert [[f["version"], f["digest"][:len(r)]] for f, (_, r) in zip(info["fragments"], reports[1]["fragments"])] \
        == reports[1]["fragments"]
    cfg = load_config(None, env={}, overrides=settings)
    model = build_model(cfg.model, cfg.seed)
    model.load_state_dict(safetensors.torch.load_file(out / MODEL_FILE), strict=True)
    from p2pdiloco.exported import heldout_of  # noqa: PLC0415

    assert abs(evaluate(model, heldout_of(cfg, str(corpus))) - reports[1]["end_loss"]) <= 1e-5
    assert abs(info["heldout_loss"] - reports[1]["end_loss"]) <= 1e-5
