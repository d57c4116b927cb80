"""The status snapshot's documented JSON form (p2pdiloco.status) against docs/operating.md and
its readers' checks: the table in the docs is the one the schema gives, and the type check
accepts and refuses what it should."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from p2pdiloco.status import Report, Starting, Status, conforms, keys, parse_status, read_status, schema_table

DOCS = Path(__file__).resolve().parents[1] / "docs" / "operating.md"


def test_the_docs_table_is_the_schemas():
    text = DOCS.read_text()
    found = re.search(r"<!-- status-schema: [^>]*-->\n(.*?)\n<!-- /status-schema -->", text, re.S)
    assert found, "docs/operating.md lost its status-schema table"
    assert found.group(1) == schema_table(), "regenerate with python -c 'from p2pdiloco.status import " \
                                             "schema_table; print(schema_table())'"


def test_each_schema_extends_the_one_before_and_every_key_is_documented():
    start, status, report = keys(Starting), keys(Status), keys(Report)
    assert set(start) < set(status) < set(report)
    assert set(report) - set(status) == {"start_loss", "end_loss", "end_bits_per_byte", "heldout_history",
                                           "exit_code", "exit_reason"}
    assert all(doc.strip() for _, doc in report.values())


@pytest.mark.parametrize("key,value,fits", [
    ("step", 3, True), ("step", 3.0, False), ("step", True, False), ("tokens_per_s", 3, True),
    ("loss", None, True), ("loss", "1.2", False), ("connections", None, True), ("maddrs", ["/ip4/x"], True),
    ("maddrs", "/ip4/x", False), ("bans", {"12D3": "bad signature"}, True), ("alone", None, True),
    ("heldout_rising", False, True), ("heldout_rising", 0, False),
])
def test_conforms(key, value, fits):
    assert conforms(value, keys(Report)[key][0]) is fits


def test_read_status_takes_a_node_file_and_nothing_else(tmp_path):
    path = tmp_path / "status.json"
    assert read_status(path) is None  # missing
    for text in ("{", "[]", json.dumps({"name": "n0"}), json.dumps({"name": 1, "state": "training"})):
        path.write_text(text)
        assert read_status(path) is None, text
    path.write_text(json.dumps({"name": "n0", "state": "training", "step": 4}))
    s = read_status(path)
    assert (s.name, s.state, s.step) == ("n0", "training", 4)


def test_the_metrics_table_lists_every_metric_the_node_serves():
    """docs/operating.md's Prometheus table against what node.control's collector serves for a
    snapshot where every figure is known: the same metric names, none missing, none extra."""
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from node.control import SCALAR_METRICS, SnapshotCollector  # noqa: PLC0415

    snap = {key: 1 for *_, key in SCALAR_METRICS}
    snap.update(name="n", peer_id="p", run_id="r", state="training", reachability="public", rejected={"nan": 1},
                fragment_status=[{"fragment": 0, "version": 3, "swarm_version": 4}],
                swarm={"peers": 2, "learners": 2, "behind": [0]})
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(lambda: parse_status(snap)))
    served = {sample.name for family in registry.collect() for sample in family.samples}
    section = DOCS.read_text().split("## Prometheus metrics", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    documented = {re.sub(r"\{.*", "", name) for row in rows for name in re.findall(r"`([^`]+)`", row)}
    assert served == documented, {"not in the table": served - documented, "not served": documented - served}
