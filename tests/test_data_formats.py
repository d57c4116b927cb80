"""Training text as people keep it (text folders, JSON Lines, Parquet) and a run's tokenizer:
each format reads as its plain text, shards and held-out bytes are the same for every reader,
bad input is one line and exit 2, a trained tokenizer round-trips and is pinned by its digest,
and two real nodes train on a JSON Lines corpus with a tokenizer to one global state."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import TINY, read_report
from p2pdiloco import manifest, tokenizer
from p2pdiloco.cli import main
from p2pdiloco.config import load_config
from p2pdiloco.data import default_corpus_files, load_corpus
from p2pdiloco.errors import ConfigError
from p2pdiloco.formats import collect_files, document_bytes
from p2pdiloco.trust.identity import Identity


def _docs(total: int = 300_000) -> list[str]:
    """Real documents (standard-library sources, one with non-ASCII text), about ``total`` bytes."""
    docs, size = ["naïve café — ünïcödé ✓ 日本語"], 0
    for f in default_corpus_files():
        docs.append(f.read_text(errors="replace"))
        size += len(docs[-1])
        if size >= total:
            return docs
    return docs


def _write(folder: Path, name: str, docs: list[str], kind: str, field: str = "text") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    if kind == "text":  # the equivalent plain text: each document and one newline
        path.write_bytes(b"".join(d.encode() + b"\n" for d in docs))
    elif kind == "jsonl":
        path.write_text("".join(json.dumps({field: d, "n": i}) + "\n" for i, d in enumerate(docs)))
    else:
        pq.write_table(pa.table({field: docs, "n": list(range(len(docs)))}), path, row_group_size=7)
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path, list[str]]:
    """(a JSON Lines corpus folder, a tokenizer trained on it by `p2pdiloco data tokenizer`, its documents)."""
    tmp = tmp_path_factory.mktemp("tok")
    docs = _docs()
    _write(tmp / "corpus", "part-0.jsonl", docs[::2], "jsonl")
    _write(tmp / "corpus" / "sub", "part-1.jsonl", docs[1::2], "jsonl")
    assert main(["data", "tokenizer", "--input", str(tmp / "corpus"), "--vocab-size", "400",
                 "--output", str(tmp / "tok.json")]) == 0
    return tmp / "corpus", tmp / "tok.json", docs


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_each_format_reads_as_the_same_tokens_as_its_plain_text(tmp_path, trained, kind):
    docs = _docs()
    name = f"corpus.{kind}"  # the split is keyed by the file's name: the plain text under the same name
    plain, structured = _write(tmp_path / "plain", name, docs, "text"), _write(tmp_path / kind, name, docs, kind)
    assert document_bytes(structured, kind, "text") == plain.read_bytes()
    tok = tokenizer.load(trained[1])
    for shard, shards in [(0, 1), (1, 3)]:
        for tk in (None, tok):
            a = load_corpus([plain], shard, shards, fmt="text", tokenizer=tk)
            b = load_corpus([structured], shard, shards, fmt="auto", tokenizer=tk)
            assert torch.equal(a.train, b.train) and torch.equal(a.heldout, b.heldout)
            assert a.train.dtype == (torch.uint8 if tk is None else torch.int32) and a.heldout.numel() > 0


def test_a_folder_reads_recursively_in_sorted_order_and_auto_picks_by_extension(tmp_path):
    docs = _docs(100_000)
    _write(tmp_path / "c" / "b", "x.parquet", docs[:2], "parquet")
    _write(tmp_path / "c", "a.jsonl", docs[2:4], "jsonl")
    _write(tmp_path / "c", "z.txt", docs[4:], "text")
    (tmp_path / "c" / ".hidden.jsonl").write_text("not json\n")
    rel = [p.relative_to(tmp_path / "c").as_posix() for p in collect_files(tmp_path / "c", "auto")]
    assert rel == ["a.jsonl", "b/x.parquet", "z.txt"]
    assert [p.name for p in collect_files(tmp_path / "c", "jsonl")] == ["a.jsonl"]
    assert [p.name for p in collect_files(tmp_path / "c", "parquet")] == ["x.parquet"]


def test_shards_and_heldout_are_identical_for_two_readers_and_disjoint(tmp_path, trained, monkeypatch):
    corpus = trained[0]
    files = collect_files(corpus, "auto")
    monkeypatch.chdir(corpus)  # a second reader: relative paths, another working directory
    again = collect_files(Path("."), "jsonl")
    total = sum(len(document_bytes(f, "jsonl", "text")) for f in files)
    parts = []
    for shard in range(3):
        a = load_corpus(files, shard, 3, fmt="auto")
        b = load_corpus(again, shard, 3, fmt="jsonl")
        assert torch.equal(a.train, b.train) and torch.equal(a.heldout, b.heldout)
        parts.append(a)
    assert all(torch.equal(p.heldout, parts[0].heldout) for p in parts)  # every node evaluates alike
    assert sum(p.train.numel() for p in parts) + parts[0].heldout.numel() == total  # disjoint, complete


def _bad_corpora(tmp: Path) -> dict[str, tuple[Path, str]]:
    """{what: (corpus path, data.format)} of inputs no node may start on."""
    (tmp / "array.jsonl").write_text('{"text": "fine"}\n[1, 2]\n')
    (tmp / "broken.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    (tmp / "missing.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    (tmp / "number.jsonl").write_text('{"text": 7}\n')
    (tmp / "empty").mkdir()
    (tmp / "empty" / "e.jsonl").write_text('{"text": ""}\n\n')
    pq.write_table(pa.table({"body": ["no text column"]}), tmp / "nocol.parquet")
    (tmp / "notparquet.parquet").write_text("plain words")
    (tmp / "texts").mkdir()
    (tmp / "texts" / "a.txt").write_text("only text here\n")
    return {"not an object": (tmp / "array.jsonl", "auto"), "not json": (tmp / "broken.jsonl", "jsonl"),
            "missing field": (tmp / "missing.jsonl", "auto"), "not a string": (tmp / "number.jsonl", "auto"),
            "empty corpus": (tmp / "empty", "auto"), "no column": (tmp / "nocol.parquet", "auto"),
            "not parquet": (tmp / "notparquet.parquet", "parquet"), "no jsonl files": (tmp / "texts", "jsonl")}


def test_bad_input_is_one_line_and_exit_2_through_the_cli(tmp_path, capsys):
    for what, (path, fmt) in _bad_corpora(tmp_path).items():
        code = main(["data", "tokenizer", "--input", str(path), "--format", fmt, "--vocab-size", "300",
                     "--output", str(tmp_path / "t.json")])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("p2pdiloco: "), (what, err)
        assert not (tmp_path / "t.json").exists()
    assert main(["data", "tokenizer", "--input", str(tmp_path / "texts"), "--vocab-size", "256",
                 "--output", str(tmp_path / "t.json")]) == 2


def test_a_node_refuses_bad_data_in_one_line_before_its_daemon_starts(tmp_path, harness):
    """Through `node run` (Setup.build, before any daemon): exit 2, one line, no identity made."""
    (tmp_path / "bad").mkdir()
    bad = _bad_corpora(tmp_path / "bad")
    for i, what in enumerate(["not an object", "no column", "empty corpus"]):
        path, fmt = bad[what]
        proc, d = harness.node("", f"b{i}", {**TINY, "data.format": fmt}, "--data", str(path))
        assert harness.wait(proc, 120, d / "node.log") == 2
        lines = (d / "node.log").read_text().strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("p2pdiloco: "), (what, lines)


def test_without_the_data_extra_parquet_and_tokenizers_name_it(tmp_path, capsys, monkeypatch):
    bad = _bad_corpora(tmp_path)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as when pyarrow is not installed
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    assert main(["data", "tokenizer", "--input", str(bad["no column"][0]), "--vocab-size", "300",
                 "--output", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'p2pdiloco[data]'" in err[0]
    with pytest.raises(ConfigError) as e:
        load_config(env={}, overrides={"data.tokenizer": str(tmp_path / "texts" / "a.txt")})
    assert "pip install 'p2pdiloco[data]'" in str(e.value) and "\n" not in str(e.value)


def test_a_trained_tokenizer_round_trips_and_sizes_the_model(trained):
    corpus, path, docs = trained
    tok = tokenizer.load(path)
    assert tok.get_vocab_size() == 400
    for text in docs[:5]:
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text and len(ids) < len(text.encode())  # merges learnt: fewer tokens than bytes
    cfg = load_config(env={}, overrides={**TINY, "data.tokenizer": str(path)})
    assert cfg.model.vocab_size == 400 and cfg.data.tokenizer_sha256 == tokenizer.file_sha256(path)
    assert load_config(env={}, overrides=TINY).model.vocab_size == 256  # no tokenizer: bytes, as before


def test_the_manifest_carries_the_tokenizer_digest_and_a_node_with_another_file_is_refused(tmp_path, trained):
    corpus, path, _ = trained
    owner = load_config(env={}, overrides={**TINY, "data.tokenizer": str(path), "swarm.run_id": "tok"})
    m = manifest.RunManifest.create(Identity.generate(), owner)
    again = manifest.load(m.to_string())
    assert again.settings["data.tokenizer_sha256"] == tokenizer.file_sha256(path)
    assert again.settings["model.vocab_size"] == 400
    mine = load_config(env={}, overrides={"data.tokenizer": str(path)}, run=manifest.pinned(again))
    assert mine.data.tokenizer_sha256 == again.settings["data.tokenizer_sha256"]
    other = tmp_path / "other.json"
    assert main(["data", "tokenizer", "--input", str(corpus), "--vocab-size", "300", "--output", str(other)]) == 0
    for overrides in ({"data.tokenizer": str(other)}, {"data.tokenizer": str(other), "model.vocab_size": "400"}):
        with pytest.raises(ConfigError) as e:
            load_config(env={}, overrides=overrides, run=manifest.pinned(again))
        assert "sha256" in str(e.value) and "\n" not in str(e.value)
    from node.setup import Setup  # noqa: PLC0415

    no_file = load_config(env={}, run=manifest.pinned(again))  # joined without the run's tokenizer
    with pytest.raises(ConfigError) as e:
        Setup.build(dataclasses.replace(no_file, data=dataclasses.replace(no_file.data, path=str(corpus))), "n", "p")
    assert "data.tokenizer" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_two_nodes_train_on_jsonl_with_a_trained_tokenizer_to_one_state(harness, trained):
    corpus, path, _ = trained
    maddr = harness.bootstrap()
    settings = {**TINY, "data.num_shards": "2", "data.tokenizer": str(path), "data.format": "jsonl"}
    nodes = [harness.node(maddr, f"n{i}", {**settings, "data.shard_index": str(i)}, "--data", str(corpus),
                          "--duration", "14", "--set", "settle=30") for i in range(2)]
    for proc, d in nodes:
        assert harness.wait(proc, 180, d / "node.log") == 0, (d / "node.log").read_text()[-3000:]
    reports = [read_report(d) for _, d in nodes]
    assert all(r["rounds_with_peers"] > 0 for r in reports), [r["recent_rounds"] for r in reports]
    assert len({r["global_digest"] for r in reports}) == 1, [r["fragments"] for r in reports]
    configs = [json.loads((d / "node-config.json").read_text())["settings"] for _, d in nodes]
    assert all(c["model"]["vocab_size"] == 400 for c in configs)
    assert all(c["data"]["tokenizer_sha256"] == tokenizer.file_sha256(path) for c in configs)
