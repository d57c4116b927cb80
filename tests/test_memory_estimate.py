"""The memory estimate a node shows before it starts (p2pdiloco.footprint): its parts against
figures computed by hand, the refusal of a node whose estimate exceeds ``--memory-limit`` (a
real CLI process: one line, exit 2, before any daemon), and the estimate in a real node's
status JSON next to its measured peak."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import psutil
import pytest

from p2pdiloco.config import load_config
from p2pdiloco.footprint import MIB, estimate, model_size

SMALL = {"model.n_layer": "2", "model.n_embd": "64", "model.n_head": "4", "model.block_size": "64",
         "data.batch_size": "16", "outer.fragments": "4"}


def test_the_estimate_of_a_small_model_adds_up_by_hand():
    cfg = load_config(env={}, overrides=SMALL)
    n = (256 + 64) * 64 + 2 * (12 * 64 * 64 + 4 * 64) + 2 * 64  # the built-in GPT: embeddings, 2 blocks, last LayerNorm
    assert n == 119_424 and model_size(cfg.model) == (n, 0)
    fp = estimate(cfg, n, process_bytes=100 * MIB)
    assert fp.weights == fp.gradients == fp.global_state == fp.outer_momentum == fp.round_log == 4 * 119_424
    assert fp.adamw == 8 * 119_424  # two moments
    assert fp.transfers == 6 * 4 * 29_856  # six fp32 copies of the largest fragment, ceil(119424 / 4)
    tokens = 16 * 64
    per_layer = tokens * (32 * 64 + 2 * 4 * 64)  # per token: 32 x n_embd values, two n_head x block_size maps
    assert fp.activations == 4 * (2 * per_layer + 3 * tokens * 256)  # + logits, log-softmax and gradient
    assert fp.activations == 24_117_248
    assert fp.total == 100 * MIB + 28 * 119_424 + 716_544 + 24_117_248
    parts = fp.as_dict()
    assert parts["parameters"] == n and parts["process_mib"] == 100 and parts["total_mib"] == round(fp.total / MIB)


def test_a_100m_llama_estimate_is_within_the_issue_bound():
    pytest.importorskip("transformers")
    cfg = load_config(env={}, overrides={"model.factory": "p2pdiloco.models.hf:llama", "model.n_layer": "8",
                                         "model.n_embd": "1024", "model.n_head": "16", "model.block_size": "64",
                                         "data.batch_size": "2", "outer.fragments": "8"})
    n, buffers = model_size(cfg.model)
    assert n == 101_336_064  # 8 x (4 x 1024^2 + 3 x 1024 x 2736 + 2 x 1024) + 2 x 256 x 1024 + 1024
    fp = estimate(cfg, n, buffers, process_bytes=0)
    # 28 bytes per parameter, 3 more for one fragment's transfers: under 8 x fp32 bytes + 1 GiB
    assert 28 * n < fp.total < 8 * 4 * n + 2**30


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "p2pdiloco.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_a_node_over_its_memory_limit_is_refused_in_one_line(tmp_path):
    pytest.importorskip("transformers")
    before = {p.pid for p in psutil.process_iter()}
    res = _cli("node", "run", "--host", "127.0.0.1", "--port", "0", "--data-dir", str(tmp_path / "node"),
               "--memory-limit", "2000", "--set", "model.factory=p2pdiloco.models.hf:llama", "--set", "model.n_layer=8",
               "--set", "model.n_embd=1024", "--set", "model.n_head=16", "--set", "model.block_size=64",
               "--set", "data.batch_size=2", "--set", "outer.fragments=8")
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("p2pdiloco: memory_limit: training this 101.34M-parameter model"), \
        res.stderr
    assert not (tmp_path / "node" / "p2p.key").exists()  # refused before the node made its identity
    assert not any(p.name() == "p2pd" for p in psutil.process_iter() if p.pid not in before)


def test_a_node_shows_its_estimate_in_its_status_and_stays_within_it(tmp_path):
    status = tmp_path / "status.json"
    res = subprocess.run([sys.executable, "-m", "node", "run", "--host", "127.0.0.1", "--port", "0", "--no-progress",
                          "--data-dir", str(tmp_path / "node"), "--max-steps", "30", "--report-file", str(status),
                          "--memory-limit", "4000", *(a for k, v in {**SMALL, "settle": "0", "eval_every": "10"}.items()
                                                      for a in ("--set", f"{k}={v}"))],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    hw = json.loads(status.read_text())["hardware"]
    est = hw["memory_estimate"]
    n = 119_424
    assert est["parameters"] == n
    assert est["weights_mib"] == round(4 * n / MIB) and est["adamw_mib"] == round(8 * n / MIB)
    assert est["total_mib"] >= est["process_mib"] > 0
    # measured peak of the whole run against the estimate shown at start
    assert hw["peak_rss_mib"] <= 1.5 * est["total_mib"], hw
    assert math.isfinite(hw["rss_mib"]) and hw["memory_limit_mib"] == 4000 and not hw["over_memory_limit"]


def test_a_downloaded_state_is_held_once():
    """A state's payload is read into one buffer (not pieces and their join) and its tensors
    are views of that buffer (not copies): traced memory peaks at about one payload."""
    import asyncio
    import tracemalloc

    import torch

    from p2pdiloco.core.outer import FragmentState
    from p2pdiloco.net.codecs import wire
    from p2pdiloco.net.transport.framing import CHUNK_BYTES, read_payload

    shapes = [(2048, 1024), (1024,)] * 2  # theta and momentum of one fragment, 16 MiB
    tensors = [torch.randn(s) for s in shapes]
    data = wire.encode(tensors, "fp32")
    n = len(data)
    assert n > 2 * CHUNK_BYTES

    async def send(reader: asyncio.StreamReader) -> None:  # as a socket delivers it: a piece at a time
        for i in range(0, n, 1 << 16):
            reader.feed_data(data[i:i + (1 << 16)])
            await asyncio.sleep(0)
        reader.feed_eof()

    async def receive() -> FragmentState:
        reader = asyncio.StreamReader(limit=2**30)
        sender = asyncio.create_task(send(reader))
        body = await read_payload(reader, n)
        await sender
        got = wire.decode(body, shapes, "fp32", adopt=True)
        assert all(t.data_ptr() for t in got)
        return FragmentState.adopt(0, 1, got[:2], got[2:])

    tracemalloc.start()
    try:
        state = asyncio.run(receive())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # one payload and the stream's few pieces in flight (held twice would be 2 n: pieces and their join)
    assert peak < n + 4 * CHUNK_BYTES < 1.5 * n, (peak, n)
    assert all(torch.equal(a, b) for a, b in zip(state.theta + state.momentum, tensors))
    base = state.theta[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in state.theta + state.momentum)  # one buffer
    assert state.digest == FragmentState.create(0, 1, tensors[:2], tensors[2:]).digest


def test_a_tokenized_loss_is_reported_in_bits_per_byte_of_text(tmp_path):
    pytest.importorskip("tokenizers")
    from p2pdiloco.data import bits_per_byte, load_corpus, loss_unit
    from p2pdiloco.tokenizer import load, train

    corpus = tmp_path / "text"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 4000)  # 176 kB: 3 pieces
    train([corpus / "a.txt"], 300, tmp_path / "tok.json")
    got = load_corpus([corpus / "a.txt"], 0, 1, 0.3, tokenizer=load(tmp_path / "tok.json"))
    plain = load_corpus([corpus / "a.txt"], 0, 1, 0.3)
    assert got.heldout_bytes == plain.heldout.numel() and plain.bytes_per_token == 1.0
    assert got.bytes_per_token == plain.heldout.numel() / got.heldout.numel() > 1.5  # merges: several bytes a token
    assert bits_per_byte(2.0, got.bytes_per_token) == pytest.approx(2.0 / got.bytes_per_token / math.log(2))
    assert (loss_unit(""), loss_unit(str(tmp_path / "tok.json"))) == ("nats/byte", "nats/token")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_a_spawned_nodes_peak_is_its_own_not_its_parents():
    """getrusage's ru_maxrss survives execve, and Python's subprocess spawns with vfork: a node
    started by a 700 MiB test process reported a 723 MiB peak against a 378 MiB estimate. The
    peak is the child's own address space's high-water mark."""
    held = bytearray(400 * MIB)
    held[::4096] = b"\x01" * len(held[::4096])  # resident
    out = subprocess.run([sys.executable, "-c", "from p2pdiloco.footprint import peak_rss_mib; print(peak_rss_mib())"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert float(out) < 200, out
    del held
