"""``p2pdiloco model export --join MANIFEST`` (or ``--initial-peers MADDR --run-id ID``): the
swarm's global model, taken out by someone who never trained.

A short-lived swarm client (p2pd, :class:`p2pdiloco.net.transport.swarm.Swarm`, and a
:class:`p2pdiloco.net.state.statesync.StateSync` holding the run's initial state, which every node
starts from: invariant I8) reads the run's signed records (``{run}/heads``), publishes none and
trains nothing. Identities are free (docs/trust.md), so no count of peers claiming a state
decides which one is exported. Each distinct global state claimed in full by some peer (its
record's (version, digest) of every fragment) is a candidate; up to ``--candidates`` of them,
chosen at random when more are claimed (so that many identities do not decide which are
asked), are downloaded from the peers that claim them (``StateSync.download``: the bytes must
hash to the claimed digest, and bounded moves apply), put in the model, and scored by their
held-out loss on the nodes' held-out bytes (:mod:`p2pdiloco.data`), as a joining node vets its
first donor (node/vetting.py; Templar's Gauntlet, arXiv 2505.21684). The candidate with the
lowest loss is written as the export folder of :mod:`p2pdiloco.exported`, the same files as a
data-dir export.

Limits: as in node/vetting.py, when every candidate asked is false, the best false one is
exported; its held-out loss is in export.json and the output, to compare with what the run's
nodes report.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from p2pdiloco.config import NodeConfig
from p2pdiloco.core.fragments import balanced_fragments
from p2pdiloco.core.outer import FragmentState
from p2pdiloco.data import evaluate
from p2pdiloco.errors import ConfigError, NetworkError, StateSyncError
from p2pdiloco.exported import heldout_of, load_global, write_export
from p2pdiloco.model import build_model
from p2pdiloco.net.state.heads import Head

from node.committed import global_digest
from node.setup import protocol_tag

__all__ = ["CANDIDATES", "export_from_swarm"]

log = logging.getLogger(__name__)

CANDIDATES = 4  # distinct claimed global states one export downloads and scores at most (default)
RECORDS_POLL_S = 1.0  # seconds between two reads of the records while none is there


async def export_from_swarm(cfg: NodeConfig, data_path: str, out: Path, *, wait: float = 30.0,
                            candidates: int = CANDIDATES, seed: int | None = None) -> dict[str, Any]:
    """Join the swarm of ``cfg.swarm`` (initial peers, run ID, ``[trust]`` identity and
    membership) as a client, export the best claimed global state (module docstring) to ``out``
    and return export.json's content (per fragment ``version`` and ``digest``,
    ``global_digest``, ``heldout_loss`` in nats per token (per byte without a tokenizer), ``holders``: the peer IDs that claimed
    it). ``data_path``: the text whose held-out split scores candidates ("" = the Python
    standard library's source, the nodes' default). ``wait``: seconds to wait for a record;
    ``seed``: the order candidates are picked in (None: random). The daemon ends before this
    returns or raises.

    Raises:
        ConfigError: the model or the held-out text cannot be built from ``cfg``/``data_path``.
        NetworkError: no initial peer answered, no record of the run appeared within ``wait``,
            or no candidate's state could be downloaded and verified.
        OSError: ``out`` cannot be written.
    """
    try:
        model = build_model(cfg.model, cfg.seed)
        shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        fragments = balanced_fragments(shapes, cfg.outer.fragments, model.embedding_names())
    except ValueError as e:
        raise ConfigError(str(e)) from None
    heldout = heldout_of(cfg, data_path)
    named = dict(model.named_parameters())
    initial = [FragmentState.create(f.index, 0, [named[s.name].detach() for s in f.slots],
                                    [torch.zeros_like(named[s.name]) for s in f.slots]) for f in fragments]

    def score(states: Sequence[FragmentState]) -> float:  # blocking: in a thread, one at a time
        return evaluate(load_global(model, fragments, states), heldout)

    from p2pdiloco.net.state.statesync import StateSync  # noqa: PLC0415  (imports hivemind)
    from p2pdiloco.net.transport.swarm import Swarm  # noqa: PLC0415
    from p2pdiloco.trust import load_node_trust  # noqa: PLC0415

    sw = cfg.swarm
    trust = load_node_trust(cfg.trust, None)  # a key held in memory, unless [trust] names one
    swarm = await Swarm.start(initial_peers=sw.initial_peers, host_maddrs=[f"/ip4/{sw.host}/tcp/0"],
                              identity=trust.identity, membership=trust.membership,
                              admission_key=f"{sw.run_id}/heads")
    try:
        sync = StateSync(swarm, sw.run_id, fragments, lambda: initial, tag=protocol_tag(cfg, fragments),
                         outer=(cfg.outer.lr, cfg.outer.momentum))
        await sync.start()
        claims = await _claims(sync, len(fragments), wait)
        loss, claim, states, tried = await _best(sync, claims, score, candidates, seed, sw.run_id)
    finally:
        await swarm.shutdown()
    load_global(model, fragments, states)
    info = {"fragments": [{"fragment": s.index, "version": s.version, "digest": s.digest} for s in states],
            "global_digest": global_digest(states), "parameters": sum(p.numel() for p in model.parameters()),
            "source": f"swarm run {sw.run_id}", "heldout_loss": loss, "holders": sorted(claims[claim]),
            "candidates": tried}
    return write_export(out, model, cfg, data_path, info)


async def _best(sync: Any, claims: dict[tuple, list[str]], score: Callable[[Sequence[FragmentState]], float],
                candidates: int, seed: int | None, run_id: str) -> tuple[float, tuple, list[FragmentState], int]:
    """Download up to ``candidates`` of the claimed global states (in ``seed``'s order) and
    score each on the held-out bytes; returns (loss, claim, states, candidates tried) of the
    lowest finite loss. Raises NetworkError when none could be downloaded and verified."""
    picked = list(claims)
    random.Random(seed).shuffle(picked)
    tried: list[tuple[float, tuple, list[FragmentState]]] = []
    got: dict[tuple[int, int, str], FragmentState] = {}
    for claim in picked[:max(1, candidates)]:
        states = await _download(sync, claim, claims[claim], got)
        if states is not None:
            loss = await asyncio.to_thread(score, states)
            log.info("candidate %s: held-out loss %.4f", global_digest(states), loss)
            tried.append((loss, claim, states))
    good = sorted(((loss, c, s) for loss, c, s in tried if math.isfinite(loss)), key=lambda t: t[0])
    if not good:
        raise NetworkError(f"none of the {min(len(picked), max(1, candidates))} global states claimed in run "
                           f"{run_id!r} could be downloaded and verified")
    return (*good[0], len(tried))


async def _claims(sync: Any, num_fragments: int, wait: float) -> dict[tuple, list[str]]:
    """{claimed global state: its claimants}: every full claim (a (version, digest) for each of
    the ``num_fragments`` fragments) in the run's live records (``StateSync.records``: parsed
    and bounded there), read until one appears or ``wait`` seconds passed. Raises NetworkError
    when none appeared."""
    loop = asyncio.get_running_loop()
    end = loop.time() + wait
    while True:
        try:
            records = await sync.records()
        except NetworkError as e:
            records, why = {}, str(e)
        else:
            why = "no node's record holds every fragment" if records else "no record"
        claims: dict[tuple, list[str]] = {}
        for peer, r in records.items():
            if peer != sync.swarm.peer_id and len(r.fragments) == num_fragments and all(
                    c is not None for c in r.fragments):
                claims.setdefault(tuple(r.fragments), []).append(peer)
        if claims:
            return claims
        if loop.time() >= end:
            raise NetworkError(f"run {sync.run_id!r}: {why} within {wait:g} s (check --run-id and the settings: "
                               "records of other settings are not read)")
        await asyncio.sleep(RECORDS_POLL_S)


async def _download(sync: Any, claim: tuple, holders: list[str],
                    got: dict[tuple[int, int, str], FragmentState]) -> list[FragmentState] | None:
    """The states of ``claim`` (one (version, digest) per fragment), each downloaded from
    ``holders`` once (``got``: the states downloaded so far, by (fragment, version, digest)) and
    verified against its digest by ``StateSync.download``; None when any fails."""
    states = []
    for p, (version, digest) in enumerate(claim):
        key = (p, version, digest)
        if key not in got:
            try:
                got[key] = await sync.download(p, Head(version, digest, tuple(holders)), joining=True)
            except StateSyncError as e:
                log.info("fragment %d v%d: %s", p, version, e)
                return None
        states.append(got[key])
    return states
