"""The node's journal: what happened to it, one JSON object per line, in ``{data_dir}/events.jsonl``.

A flight recorder for a run, read back by people (``jq``) and by the tests, which assert on
it instead of on log wording. Every line is ``{"t": unix seconds, "event": KIND, ...fields}``:

* ``round``: an outer round ended: ``fragment``, ``version`` (produced when committed, else the
  anchor's), ``members`` (0 when none was formed), ``seconds``, ``committed``, ``reason``
  (why not: "late", "no_quorum", "excluded", the failure), ``digest`` (12 hex, committed only),
  ``fraction`` (of an outer period, the step the round applied; committed only);
* ``follow``: a state made without our progress in it was installed, our progress rebased on
  it: ``fragment``, ``from_version``, ``version``, ``digest``, ``ours`` (our contribution was
  inside it after all: overwritten, not rebased), ``bytes`` and ``rounds`` (the payload of its
  download: the state's, with rounds 0, or that of the rounds it was computed from,
  ``net.state.deltas``), ``excluded`` (present, true, when it is the result of our own round that
  merged without our contribution, taken without a download);
* ``download_failed``: ``fragment``, ``version``, ``donor`` (peer ID), ``reason``;
* ``send``: a round of ``fragment`` starts with our progress, the ``n``-th of that fragment
  over the data dir's life (written before anything is sent, and synced to disk: a resumed node
  reads it to tell which checkpointed progress never left, ``node.checkpoint.kept_progress``);
* ``resumed``: the local checkpoint was loaded: ``step``, ``kept`` (fragments whose checkpointed
  progress is kept on top of the swarm's state);
* ``joined``: the node took the swarm's inner step with the first state it downloaded:
  ``step``, ``lr``.

Bounded: past ``max_bytes`` the file is renamed to ``events.jsonl.1`` (replacing an older one)
and a new one starts. Lines are appended whole and flushed; a reader skips a torn last line
(a process killed mid-write).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FILE = "events.jsonl"
MAX_BYTES = 8 * 2**20


class Journal:
    """Appends events to ``path`` (None: keeps nothing). One per node, written from its event
    loop only (each line is one ``write`` on an unbuffered binary file)."""

    def __init__(self, path: Path | None, max_bytes: int = MAX_BYTES):
        self.path, self.max_bytes = path, max_bytes
        self._size = path.stat().st_size if path is not None and path.exists() else 0
        self._torn = self._size > 0 and _last_byte(path) != b"\n"  # a previous process died mid-line
        self.failing = False  # the last write failed (logged once per streak)

    def record(self, event: str, *, sync: bool = False, **fields: Any) -> bool:
        """Append one event (fields JSON-able); sync: on disk before returning (fsync), not only
        in the page cache, which a killed process keeps but a crashed machine loses. Returns
        whether it was written. Never raises: a full disk costs the journal, not the run."""
        if self.path is None:
            return False
        line = (json.dumps({"t": round(time.time(), 3), "event": event, **fields}, separators=(",", ":")) + "\n").encode()
        if self._torn:  # end the torn line first, so that this one stays whole
            line, self._torn = b"\n" + line, False
        try:
            if self._size + len(line) > self.max_bytes and self._size:
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))
                self._size = 0
            with open(self.path, "ab", buffering=0) as f:
                written = f.write(line) or 0
                self._size += written
                if written != len(line):  # a short write (full disk): the line is torn, not written
                    self._torn = True
                    raise OSError(f"wrote {written} of {len(line)} bytes")
                if sync:
                    os.fsync(f.fileno())
        except OSError as e:
            if not self.failing:
                log.warning("journal %s: %s (events are not recorded until a write succeeds)", self.path, e)
            self.failing = True
            return False
        self.failing = False
        return True


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


def read_journals(path: Path) -> list[dict[str, Any]]:
    """Every complete event in ``path`` and in the file it rotated to (``path.1``), oldest first."""
    return read_journal(path.with_name(path.name + ".1")) + read_journal(path)


def read_journal(path: Path) -> list[dict[str, Any]]:
    """Every complete event in ``path`` (``events.jsonl``), oldest first; [] if it does not exist."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:  # a torn last line
            continue
        if isinstance(event, dict):
            out.append(event)
    return out


def save_round_trace(folder: Path, peer_id: str, round_id: str, members, contrib, merged, fraction: float, anchor,
                     new, embedding_mask: list[bool], shares: tuple[int, ...] = (),
                     trust: tuple[float, ...] = ()) -> Path:
    """Save one committed round, its inputs and result, for offline checks (``trace_dir``):
    ``f{fragment}-v{version}-{round}-{peer[-8:]}.pt`` with this member's Δ and counters (a
    ``Contribution``), the merged Δ and counters (a ``RoundResult``), the fraction of a period
    the step applied, the anchor's ledger and digest, the new digest, the group's all-reduce
    shares (which member reduced which tensor: ``assign_parts``) and this member's trust multipliers of
    the members in the merges it reduced (``AllReducer.trust_used``). Atomic write; returns the path."""
    import torch  # noqa: PLC0415  (only nodes that trace pay for the import here)

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"f{new.index}-v{new.version}-{round_id}-{peer_id[-8:]}.pt"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save({"fragment": new.index, "version": new.version, "round_id": round_id, "members": members,
                "me": peer_id, "delta": contrib.delta, "tokens": contrib.tokens, "steps": contrib.steps,
                "span": contrib.span, "position": contrib.position, "merged": merged.delta, "fraction": fraction,
                "first": merged.first, "ledger": anchor.ledger, "anchor_digest": anchor.digest,
                "digest": new.digest, "embedding_mask": embedding_mask, "shares": tuple(shares),
                "trust": tuple(trust)}, tmp)
    tmp.replace(path)
    return path
