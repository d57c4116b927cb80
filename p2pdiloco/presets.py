"""Named node settings (``section.field`` overrides of ``p2pdiloco.config``), the one place
that defines them: the demo's (``p2pdiloco demo``, the chaos harness's ``--preset demo`` and
the benchmarks) and the tiny model of the integration tests and chaos tests."""

from __future__ import annotations

# Sized for a 2-core machine: a 0.8M-parameter model, 4 fragments, a sync every 40 steps.
DEMO = {
    "model.n_layer": "2", "model.n_embd": "128", "model.n_head": "4", "model.block_size": "128",
    "inner.lr": "2e-3", "inner.warmup_steps": "50", "inner.total_steps": "3000",
    "outer.fragments": "4", "outer.sync_every": "40", "outer.overlap": "2", "outer.min_quorum": "1",
    "outer.grace_min": "1.0", "outer.grace_max": "3.0", "outer.lr": "0.7", "outer.momentum": "0.9",
    "data.batch_size": "16", "data.max_bytes": "3000000", "data.eval_batches": "8",
    "eval_every": "100", "status_every": "1",  # its view of every node redraws each second
}

# 1 layer, 64 wide, 2 fragments: several nodes on 2 cores, real text, real sockets.
TINY = {
    "model.n_layer": "1", "model.n_embd": "64", "model.n_head": "2", "model.block_size": "64",
    "inner.lr": "3e-3", "inner.warmup_steps": "10", "inner.total_steps": "2000",
    "outer.fragments": "2", "outer.sync_every": "20", "outer.momentum": "0.5", "outer.min_quorum": "1",
    "outer.grace_min": "1.0", "outer.grace_max": "3", "outer.quorum_timeout": "8",
    "outer.liveness_timeout": "8",
    "data.batch_size": "8", "data.max_bytes": "200000", "data.eval_batches": "4", "eval_every": "40",
    "status_every": "1",
}

PRESETS = {"demo": DEMO, "tiny": TINY}  # copy before changing: dict(PRESETS[name])
