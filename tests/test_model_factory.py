"""Your own model (model.factory, p2pdiloco.factory): the same start on every node and CPU
(invariant I8), a protocol tag that keeps different modules apart, one-line errors, and two
real nodes training the example factory together."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from p2pdiloco.config import load_config
from p2pdiloco.core.fragments import balanced_fragments
from p2pdiloco.errors import ConfigError
from p2pdiloco.factory import FactoryModel, redraw_parameters, resolve_factory
from p2pdiloco.model import ModelConfig, build_model

from tests.conftest import TINY, read_report

LM = "p2pdiloco.models.torch_lm:decoder_lm"
SMALL = ModelConfig(block_size=16, n_layer=2, n_head=2, n_embd=32, factory=LM)
ROOT = Path(__file__).resolve().parents[1]


# ---- factories for the error cases (importable as tests.test_model_factory:NAME) ----------

def not_a_module(cfg: ModelConfig) -> object:
    return "a string"


def wrong_width(cfg: ModelConfig) -> nn.Module:
    return nn.Sequential(nn.Embedding(cfg.vocab_size, 8), nn.Linear(8, cfg.vocab_size + 1))


def raises(cfg: ModelConfig) -> nn.Module:
    raise RuntimeError("out of coffee\nsecond line")


def hf_style(cfg: ModelConfig) -> nn.Module:
    """Returns an object with .logits, as transformers' models do, with a tied head."""
    class Out:
        def __init__(self, logits):
            self.logits = logits

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)  # registered first
            self.emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.head.weight = self.emb.weight

        def forward(self, idx):
            return Out(self.head(self.emb(idx)).double())

    return M()


def _state_digest(model: nn.Module) -> str:
    return hashlib.sha256(b"".join(t.detach().contiguous().numpy().tobytes()
                                   for t in model.state_dict().values())).hexdigest()


# ---- building ---------------------------------------------------------------------------

def test_factory_model_builds_identically_twice_and_leaves_the_rng_alone() -> None:
    before = torch.random.get_rng_state()
    a, b, c = build_model(SMALL, 7), build_model(SMALL, 7), build_model(SMALL, 8)
    assert torch.equal(before, torch.random.get_rng_state())
    assert isinstance(a, FactoryModel) and not isinstance(a, type(build_model(ModelConfig(), 0)))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)  # the seed matters
    assert a.embedding_names() == ("net.tok.weight", "net.pos.weight")
    named = dict(a.named_parameters())
    assert torch.equal(named["net.layers.0.norm1.weight"], torch.ones(32))  # constants kept as built
    assert torch.equal(named["net.layers.0.self_attn.in_proj_bias"], torch.zeros(96))
    assert 0.019 < float(named["net.tok.weight"].detach().std()) < 0.021  # the factory's scale kept (GPT-2's 0.02)
    x = torch.randint(0, 256, (3, 16))
    logits = a(x)
    assert logits.shape == (3, 16, 256) and logits.dtype == torch.float32
    later = x.clone()
    later[:, 8:] = (later[:, 8:] + 1) % 256
    assert torch.allclose(a(later)[:, :8], logits[:, :8], atol=1e-6)  # causal: a position sees only the past
    assert not torch.allclose(a(later)[:, 8:], logits[:, 8:])
    with pytest.raises(ValueError, match="exceeds block_size"):
        a(torch.zeros(1, 17, dtype=torch.long))


def test_redraw_rule_rounds_the_statistics_to_two_digits() -> None:
    m = nn.Linear(300, 200)
    with torch.no_grad():
        m.weight.normal_(0.5, 0.0123456)
        m.bias.fill_(0.25)
    redraw_parameters(m, 0)
    assert torch.equal(m.bias, torch.full((200,), 0.25))
    w = m.weight.detach().double()
    assert abs(float(w.std()) - 0.012) < 3e-4 and abs(float(w.mean()) - 0.5) < 1e-4  # N(0.5, 0.012²)


def test_an_output_object_with_logits_and_a_tied_head_first() -> None:
    m = build_model(ModelConfig(block_size=8, n_layer=1, n_head=1, n_embd=16,
                                factory="tests.test_model_factory:hf_style"), 0)
    assert m.embedding_names() == ("net.head.weight",)  # the tied weight, under its one name
    assert [n for n, _ in m.named_parameters()] == ["net.head.weight"]
    assert m(torch.zeros(2, 8, dtype=torch.long)).dtype == torch.float32


SCRIPT = r"""
import hashlib, json, torch
from p2pdiloco.model import ModelConfig, build_model
m = build_model(ModelConfig(block_size=16, n_layer=2, n_head=2, n_embd=32, factory="%s"), 7)
h = hashlib.sha256(b"".join(t.detach().contiguous().numpy().tobytes() for t in m.state_dict().values()))
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "init": h.hexdigest()}))
""" % LM


def test_the_same_initial_state_on_every_cpu_kernel_set() -> None:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    caps = ["default", *(["avx2"] if " avx2" in flags else []), *(["avx512"] if " avx512f" in flags else [])]
    if len(caps) < 2:
        pytest.skip(f"this CPU offers only {caps}")

    def run(cap: str) -> dict:
        out = subprocess.run([sys.executable, "-c", SCRIPT], env=dict(os.environ, ATEN_CPU_CAPABILITY=cap),
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.splitlines()[-1])

    with ThreadPoolExecutor(len(caps)) as pool:
        got = dict(zip(caps, pool.map(run, caps)))
    assert all(got[cap]["capability"].lower() == cap for cap in caps)
    assert len({g["init"] for g in got.values()}) == 1, got
    assert got[caps[0]]["init"] == _state_digest(build_model(SMALL, 7))  # and the same as here


# ---- the protocol tag -------------------------------------------------------------------

def _tag(cfg, model=None) -> str:
    from node.runtime import protocol_tag  # noqa: PLC0415  (imports hivemind)

    model = model or build_model(cfg.model, cfg.seed)
    frags = balanced_fragments([(n, tuple(p.shape)) for n, p in model.named_parameters()], cfg.outer.fragments,
                               model.embedding_names())
    return protocol_tag(cfg, frags)


def test_the_tag_covers_the_factory_and_the_parameter_shapes() -> None:
    small = {"model.n_layer": "2", "model.n_embd": "32", "model.n_head": "2", "model.block_size": "16",
             "outer.fragments": "2"}
    gpt = load_config(env={}, overrides=small)
    mine = load_config(env={}, overrides={**small, "model.factory": LM})
    wider = load_config(env={}, overrides={**small, "model.factory": LM, "model.n_embd": "48"})
    tags = {_tag(gpt), _tag(mine), _tag(wider)}
    assert len(tags) == 3
    assert _tag(mine) == _tag(load_config(env={}, overrides={**small, "model.factory": LM}))
    # the same settings, but a factory whose module differs on another node (another library
    # version, say): its parameter names and shapes tell them apart
    other = build_model(ModelConfig(block_size=16, n_layer=3, n_head=2, n_embd=32, factory=LM), 0)
    assert _tag(mine, other) != _tag(mine)


# ---- errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("spec, message", [
    ("no_colon", "model.factory: 'no_colon' is not of the form package.module:function"),
    ("no_such_module_xyz:f", "model.factory: cannot import 'no_such_module_xyz': ModuleNotFoundError: No module "
                             "named 'no_such_module_xyz'"),
    ("p2pdiloco.models.torch_lm:nothing", "model.factory: module 'p2pdiloco.models.torch_lm' has no attribute "
                                          "'nothing'"),
    ("p2pdiloco.models.torch_lm:__all__", "model.factory: p2pdiloco.models.torch_lm:__all__ is a list, not a callable"),
])
def test_a_bad_factory_is_one_config_line(spec: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(env={}, overrides={"model.factory": spec})
    assert str(e.value) == f"invalid configuration: {message} (from the command line)"


@pytest.mark.parametrize("name, message", [
    ("not_a_module", " returned a str, not a torch.nn.Module"),
    ("wrong_width", "'s module returns (1, 2, 257) for tokens [1, 2]; expected logits [1, 2, 256] (model.vocab_size)"),
    ("raises", " raised RuntimeError: out of coffee"),
])
def test_a_factory_that_builds_the_wrong_thing_is_one_line(name: str, message: str) -> None:
    spec = f"tests.test_model_factory:{name}"
    with pytest.raises(ValueError) as e:
        build_model(ModelConfig(factory=spec), 0)
    assert str(e.value) == f"model.factory: {spec}(cfg){message}"


def test_the_transformers_example_needs_transformers() -> None:
    if importlib.util.find_spec("transformers") is None:
        with pytest.raises(ValueError, match="cannot import 'p2pdiloco.models.hf': ModuleNotFoundError: No module "
                                             "named 'transformers'"):
            resolve_factory("p2pdiloco.models.hf:gpt2")
        return
    m = build_model(ModelConfig(block_size=16, n_layer=1, n_head=2, n_embd=32, factory="p2pdiloco.models.hf:gpt2"), 0)
    assert m(torch.zeros(2, 16, dtype=torch.long)).shape == (2, 16, 256)
    assert "net.transformer.wte.weight" in m.embedding_names()


def test_the_node_command_refuses_a_bad_factory_in_one_line(tmp_path: Path) -> None:
    cases = {"no_such_module_xyz:f": "model.factory: cannot import 'no_such_module_xyz'",
             "tests.test_model_factory:wrong_width": "model.factory: tests.test_model_factory:wrong_width(cfg)'s "
                                                     "module returns (1, 2, 257)"}

    def run(spec: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "node", "run", "--host", "127.0.0.1", "--port", "0",
                               "--set", f"model.factory={spec}", "--data-dir", str(tmp_path / spec.split(":")[1])],
                              capture_output=True, text=True, timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL)

    with ThreadPoolExecutor(len(cases)) as pool:
        results = dict(zip(cases, pool.map(run, cases)))
    for spec, expected in cases.items():
        res = results[spec]
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and expected in lines[0], (spec, res.returncode, res.stderr)
        assert "Traceback" not in res.stderr + res.stdout


# ---- real nodes -------------------------------------------------------------------------

@pytest.mark.integration
@pytest.mark.timeout(240)
def test_two_nodes_train_a_factory_model_together(harness) -> None:
    maddr = harness.bootstrap()
    nodes = [harness.node(maddr, f"n{i}", {**TINY, "model.factory": LM, "data.num_shards": "2",
                                           "data.shard_index": str(i)}, "--duration", "14", "--set", "settle=60")  # ends once both agree
             for i in range(2)]
    for proc, d in nodes:
        assert harness.wait(proc, 200, d / "node.log") == 0, (d / "node.log").read_text()[-3000:]
    reports = [read_report(d) for _, d in nodes]
    assert all(r["rounds_with_peers"] > 0 for r in reports), [r["rounds_with_peers"] for r in reports]
    assert len({r["global_digest"] for r in reports}) == 1, [r["fragments"] for r in reports]
    assert all(r["end_loss"] < r["start_loss"] for r in reports)
    assert f"from {LM}" in (nodes[0][1] / "node.log").read_text()


MY_MODELS = '''
import torch.nn as nn


def build(cfg):
    return nn.Sequential(nn.Embedding(cfg.vocab_size, 16), nn.Linear(16, cfg.vocab_size))
'''


def _p2pdiloco_command() -> list[str]:
    """The ``p2pdiloco`` console script of this environment: like any console script it starts
    with its own folder first on sys.path, not the current one. Where it is not installed, the
    same entry point under ``python -P`` (no current folder either)."""
    script = Path(sys.executable).with_name("p2pdiloco")
    return [str(script)] if script.exists() else [sys.executable, "-P", "-c",
                                                   "import sys; from p2pdiloco.cli import main; sys.exit(main())"]


@pytest.mark.timeout(180)
def test_a_factory_module_in_the_current_folder_is_found(tmp_path: Path) -> None:
    """``model.factory = "my_models:build"`` with my_models.py in the folder the command runs in,
    without PYTHONPATH naming that folder: a manifest is made, and a lone node builds and trains
    the model for a few steps."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "my_models.py").write_text(MY_MODELS)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's p2pdiloco, and not the folder

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*_p2pdiloco_command(), *args], capture_output=True, text=True, timeout=150,
                              cwd=work, env=env, stdin=subprocess.DEVNULL)

    made = cli("run", "init", "--run-id", "mine", "--set", "model.factory=my_models:build",
               "--identity", str(tmp_path / "owner.key"), "--out", str(tmp_path / "mine.manifest"))
    assert made.returncode == 0, made.stderr
    node = tmp_path / "node"
    ran = cli("node", "run", "--host", "127.0.0.1", "--port", "0", "--data-dir", str(node),
              "--report-file", str(node / "report.json"), "--max-steps", "3", "--no-progress",
              *(a for k, v in {**TINY, "model.factory": "my_models:build", "settle": "0"}.items()
                for a in ("--set", f"{k}={v}")))
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert read_report(node)["step"] >= 3
