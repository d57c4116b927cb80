import math
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from p2pdiloco.data import (PIECE_BYTES, BatchSampler, bits_per_byte, collect_text_files, default_corpus_files,
                            evaluate, heldout_batches, load_corpus)
from p2pdiloco.model import GPT, ModelConfig, build_model

SMALL = ModelConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)


def test_model_shapes_tying_and_init_loss():
    m = build_model(ModelConfig(), seed=0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 256, (2, 2, 128), generator=g)
    logits = m(x)
    assert logits.shape == (2, 128, 256) and logits.dtype == torch.float32
    names = dict(m.named_parameters())
    assert m.lm_head.weight is m.wte.weight and "lm_head.weight" not in names
    assert set(m.embedding_names()) <= set(names) and m.embedding_names() == ("wte.weight", "wpe.weight")
    loss = F.cross_entropy(logits.view(-1, 256), y.view(-1)).item()
    assert abs(loss - math.log(256)) < 0.1  # near-uniform predictions at init
    with pytest.raises(ValueError):
        m(torch.zeros(1, 129, dtype=torch.long))


def test_model_is_causal():
    m = build_model(SMALL, seed=3).eval()
    x = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256
    a, b = m(x), m(y)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-6)
    assert not torch.allclose(a[0, 10:], b[0, 10:])


def test_build_model_deterministic_and_rng_untouched():
    torch.manual_seed(42)
    expected = torch.rand(3)
    torch.manual_seed(42)
    a, b, c = build_model(SMALL, 7), build_model(SMALL, 7), build_model(SMALL, 8)
    assert torch.equal(torch.rand(3), expected)  # global RNG state restored
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["wte.weight"], sc["wte.weight"])
    assert abs(sa["wte.weight"].std().item() - 0.02) < 0.002


@pytest.mark.parametrize("kw", [dict(n_embd=30, n_head=4), dict(n_layer=0), dict(block_size=0)])
def test_model_config_validation(kw):
    with pytest.raises(ValueError):
        ModelConfig(**kw)


def test_default_corpus_files():
    files = default_corpus_files()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert len(files) > 100 and files == sorted(files)
    assert all(f.suffix == ".py" and f.is_relative_to(stdlib) for f in files)
    rel_parts = {p for f in files for p in f.relative_to(stdlib).parts}
    assert not rel_parts & {"site-packages", "test", "tests"}
    assert stdlib / "os.py" in files


def _tree(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 10)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("x = 1\n")
    (tmp_path / "sub" / "bin.dat").write_bytes(b"\x00\x01\x02binary")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / ".hidden.txt").write_text("secret")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "c.txt").write_text("hidden dir")
    return tmp_path


def test_collect_text_files(tmp_path):
    root = _tree(tmp_path)
    assert collect_text_files(root) == [root / "a.txt", root / "sub" / "b.py"]
    assert collect_text_files(root / "a.txt") == [root / "a.txt"]
    with pytest.raises(FileNotFoundError):
        collect_text_files(root / "missing")
    with pytest.raises(ValueError):
        collect_text_files(root / "sub" / "bin.dat")
    (root / "none").mkdir()
    (root / "none" / "x.bin").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError):
        collect_text_files(root / "none")


def _corpus_dir(tmp_path, n=40):
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        size = int(torch.randint(100, 3000, (1,), generator=g))
        (tmp_path / f"f{i:02d}.txt").write_bytes(bytes([65 + i % 26]) * size)
    big = bytes(range(32, 127)) * (3 * PIECE_BYTES // 95 + 1)  # spans several pieces
    (tmp_path / "big.txt").write_bytes(big)
    return sorted(tmp_path.iterdir())


def test_load_corpus_shards_disjoint_and_complete(tmp_path):
    files = _corpus_dir(tmp_path)
    total = sum(f.stat().st_size for f in files)
    shards = [load_corpus(files, i, 3, heldout_fraction=0.1) for i in range(3)]
    held = shards[0].heldout
    assert held.dtype == torch.uint8 and held.numel() > 0
    assert all(torch.equal(s.heldout, held) for s in shards)  # same held-out bytes on every node
    assert sum(s.train.numel() for s in shards) + held.numel() == total
    # per-byte-value counts add up exactly to the corpus: nothing lost, nothing duplicated
    counts = sum(torch.bincount(s.train.long(), minlength=256) for s in shards) + torch.bincount(held.long(), minlength=256)
    ref = torch.zeros(256, dtype=torch.long)
    for f in files:
        ref += torch.bincount(torch.tensor(list(f.read_bytes())), minlength=256)
    assert torch.equal(counts, ref)
    # reordering the file list (or a different absolute location) does not change the split
    again = load_corpus(list(reversed(files)), 1, 3, heldout_fraction=0.1)
    assert torch.equal(again.train, shards[1].train) and torch.equal(again.heldout, held)


def test_load_corpus_caps_and_errors(tmp_path):
    files = _corpus_dir(tmp_path, n=3)
    c = load_corpus(files, 0, 2, heldout_fraction=0.2, max_bytes=1000)
    assert c.train.numel() == 1000 and 0 < c.heldout.numel() <= 1000
    full = load_corpus(files, 0, 2, heldout_fraction=0.2)
    assert torch.equal(full.train[:1000], c.train)
    one = tmp_path / "f00.txt"
    assert load_corpus([one], 0, 1, heldout_fraction=0.05).heldout.numel() == 0  # a single piece: all trains
    with pytest.raises(ValueError, match="empty"):
        load_corpus([one], 1, 2)
    for kw in [dict(shard_index=2, num_shards=2), dict(shard_index=0, num_shards=0),
               dict(shard_index=0, num_shards=1, heldout_fraction=1.0), dict(shard_index=0, num_shards=1, max_bytes=0)]:
        with pytest.raises(ValueError):
            load_corpus(files, **kw)


def test_load_default_corpus_fast():
    c = load_corpus(default_corpus_files(), 0, 4, max_bytes=200_000)
    assert c.train.numel() == 200_000 and c.heldout.numel() > 0
    assert b"def " in bytes(c.train[:200_000].tolist())


def test_batch_sampler():
    data = torch.arange(200, dtype=torch.uint8)
    s1, s2 = BatchSampler(data, 4, 8, seed=1), BatchSampler(data, 4, 8, seed=1)
    x, y = s1.next()
    assert x.shape == y.shape == (4, 8) and x.dtype == torch.long
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)  # windows of consecutive bytes
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(4, 7, dtype=torch.long))
    assert int(y.max()) <= 199
    x2, _ = s2.next()
    assert torch.equal(x, x2)
    assert not torch.equal(s1.next()[0], x)
    with pytest.raises(ValueError):
        BatchSampler(data[:8], 1, 8, seed=0)


def test_heldout_batches():
    data = torch.arange(101, dtype=torch.uint8)
    bs = heldout_batches(data, batch_size=2, block_size=10, num_batches=3)
    # 6 windows evenly spaced over starts 0..90: 0, 18, 36, 54, 72, 90
    assert [int(x[i, 0]) for x, _ in bs for i in range(2)] == [0, 18, 36, 54, 72, 90]
    assert all(torch.equal(y, x + 1) for x, y in bs)
    again = heldout_batches(data, 2, 10, 3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(bs, again))
    with pytest.raises(ValueError):
        heldout_batches(data[:10], 2, 10, 1)


def test_evaluate_matches_manual_cross_entropy():
    m = build_model(SMALL, seed=0)
    m.train()
    data = torch.randint(0, 256, (500,), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    batches = heldout_batches(data, 3, 16, 2)
    with torch.no_grad():
        ce = [F.cross_entropy(m(x).reshape(-1, 256), y.reshape(-1), reduction="none") for x, y in batches]
    manual = torch.cat(ce).mean().item()
    got = evaluate(m, batches)
    assert math.isclose(got, manual, rel_tol=1e-5) and m.training
    assert math.isclose(bits_per_byte(math.log(256)), 8.0)
    with pytest.raises(ValueError):
        evaluate(m, [])


def test_gpt_direct_construction():
    assert isinstance(GPT(SMALL), torch.nn.Module)


@pytest.mark.parametrize("n_layer", [1, 2, 3])
def test_num_tensors_counts_the_models_parameters(n_layer) -> None:
    cfg = ModelConfig(n_layer=n_layer, n_embd=32, n_head=2, block_size=16)
    assert cfg.num_tensors == len(list(build_model(cfg, 0).parameters()))


@pytest.mark.parametrize("block_size", [32, 128])
def test_min_text_bytes_is_the_smallest_text_one_node_trains_on(tmp_path, block_size):
    """The size a too-small corpus's refusal gives: one file of min_text_bytes works for one node
    (one shard, or the default 8 with the shard from its peer ID), one byte less is refused with a
    ConfigError (exit 2), whichever of its two pieces the hash holds out."""
    from node.setup import Setup  # noqa: PLC0415

    from p2pdiloco.config import load_config  # noqa: PLC0415
    from p2pdiloco.data import min_text_bytes  # noqa: PLC0415
    from p2pdiloco.errors import ConfigError  # noqa: PLC0415

    small = {"model.n_layer": "1", "model.n_embd": "16", "model.n_head": "1", "model.block_size": str(block_size)}
    for name in ("a.txt", "b.txt", "notes.md"):
        for size, works in ((min_text_bytes(block_size), True), (min_text_bytes(block_size) - 1, False)):
            path = tmp_path / str(size) / name
            path.parent.mkdir(exist_ok=True)
            path.write_text(("the quick brown fox jumps over the lazy dog\n" * (size // 44 + 1))[:size])
            for shards in ({"data.num_shards": "1"}, {}):
                cfg = load_config(env={}, overrides={**small, **shards, "data.path": str(path)})
                if works:
                    setup = Setup.build(cfg, "n", "12D3KooWpeer")
                    assert setup.sampler.data.numel() >= block_size + 1
                else:
                    with pytest.raises(ConfigError):
                        Setup.build(cfg, "n", "12D3KooWpeer")
