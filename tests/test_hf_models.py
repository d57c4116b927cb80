"""transformers models (p2pdiloco.models.hf): the Llama factory builds the same start in two
processes (invariant I8), two real nodes training it end at equal digests, and its export in
Hugging Face's layout loads with ``AutoModelForCausalLM.from_pretrained`` and gives the held-out
loss ``model eval`` gives. Skipped where transformers is not installed (the ``hf`` extra)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM  # noqa: E402

from p2pdiloco.cli import main  # noqa: E402
from p2pdiloco.data import evaluate  # noqa: E402
from p2pdiloco.exported import EXPORT_FILE, HF_DIR, heldout_of  # noqa: E402
from p2pdiloco.factory import FactoryModel  # noqa: E402
from p2pdiloco.model import ModelConfig, build_model  # noqa: E402

from tests.conftest import TINY, read_report  # noqa: E402

LLAMA = "p2pdiloco.models.hf:llama"
SMALL = ModelConfig(block_size=32, n_layer=2, n_head=2, n_embd=32, factory=LLAMA)
DIGEST = ("import hashlib, sys; from p2pdiloco.model import build_model, ModelConfig; "
          "m = build_model(ModelConfig(block_size=32, n_layer=2, n_head=2, n_embd=32, factory=sys.argv[1]), 7); "
          "h = hashlib.sha256(); [h.update(n.encode() + t.numpy().tobytes()) for n, t in m.state_dict().items()]; "
          "print(h.hexdigest())")


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for n, t in model.state_dict().items():
        h.update(n.encode() + t.numpy().tobytes())
    return h.hexdigest()


def test_the_llama_factory_builds_a_llama_sized_by_the_settings() -> None:
    m = build_model(SMALL, 0)
    config = m.net.config
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.vocab_size, config.max_position_embeddings) == ("llama", 32, 2, 2, 256, 32)
    assert config.intermediate_size == 88  # 8/3 x 32, up to a multiple of 8
    assert m(torch.zeros(2, 32, dtype=torch.long)).shape == (2, 32, 256)
    assert m.embedding_names() == ("net.model.embed_tokens.weight",)
    assert all(p.dtype == torch.float32 for p in m.parameters())


def test_one_seed_gives_bit_identical_llamas_in_two_processes() -> None:
    """Invariant I8: here and in a fresh interpreter, the same seed, the same bits; another
    seed, other bits."""
    here = _digest(build_model(SMALL, 7))
    there = subprocess.run([sys.executable, "-c", DIGEST, LLAMA], capture_output=True, text=True, check=True)
    assert there.stdout.strip() == here
    assert _digest(build_model(SMALL, 8)) != here


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_two_nodes_train_a_llama_to_equal_digests_and_its_export_loads_in_transformers(harness, capsys) -> None:
    settings = {**TINY, "model.factory": LLAMA, "model.n_embd": "32", "model.block_size": "32"}
    maddr = harness.bootstrap()
    nodes = [harness.node(maddr, f"n{i}", {**settings, "data.num_shards": "2", "data.shard_index": str(i)},
                          # settle (it ends once both are done and agree): started apart, the nodes end
                          # apart, and 10 s ran out on a loaded CI machine (v58/v56 against v56/v55)
                          "--duration", "14", "--set", "settle=60") for i in range(2)]
    for proc, d in nodes:
        assert harness.wait(proc, 240, d / "node.log") == 0, (d / "node.log").read_text()[-3000:]
    reports = [read_report(d) for _, d in nodes]
    assert len({r["global_digest"] for r in reports}) == 1, [r["fragments"] for r in reports]
    assert all(r["rounds_with_peers"] > 0 for r in reports)

    out = harness.tmp / "export"
    assert main(["model", "export", "--data-dir", str(nodes[0][1]), "--out", str(out)]) == 0
    info = json.loads((out / EXPORT_FILE).read_text())
    assert info["global_digest"] == reports[0]["global_digest"] and info["hf"] == HF_DIR
    assert {"config.json", "model.safetensors"} <= {p.name for p in (out / HF_DIR).iterdir()}
    capsys.readouterr()
    assert main(["model", "eval", "--model", str(out), "--json"]) == 0
    loss = json.loads(capsys.readouterr().out)["loss"]
    assert abs(loss - reports[0]["end_loss"]) <= 1e-5

    hf = AutoModelForCausalLM.from_pretrained(out / HF_DIR)  # transformers alone: no p2pdiloco module
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.dtype == torch.float32
    cfg = build_model(ModelConfig(block_size=32, n_layer=1, n_head=2, n_embd=32, factory=LLAMA), 0).cfg
    from p2pdiloco.config import load_config  # noqa: PLC0415

    heldout = heldout_of(load_config(None, env={}, overrides=settings), "")
    assert abs(evaluate(FactoryModel(hf, cfg), heldout) - loss) <= 1e-5
