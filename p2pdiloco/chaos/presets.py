"""Node settings for chaos runs: the demo's small model, or a tiny one for tests."""

from __future__ import annotations

# The integration tests' model (tests/conftest.py TINY): 1 layer, 64 wide, 2 fragments.
TINY = {
    "model.n_layer": "1", "model.n_embd": "64", "model.n_head": "2", "model.block_size": "64",
    "inner.lr": "3e-3", "inner.warmup_steps": "10", "inner.total_steps": "2000",
    "outer.fragments": "2", "outer.sync_every": "20", "outer.momentum": "0.5", "outer.min_quorum": "1",
    "outer.grace_min": "1.0", "outer.grace_max": "3", "outer.quorum_timeout": "8",
    "outer.liveness_timeout": "8",
    "data.batch_size": "8", "data.max_bytes": "200000", "data.eval_batches": "4", "eval_every": "40",
}


def demo() -> dict[str, str]:
    """The demo's settings (node/demo.py): a 0.4M-parameter model, 4 fragments, H = 40."""
    from node.demo import DEMO_SETTINGS  # noqa: PLC0415

    return dict(DEMO_SETTINGS)


PRESETS = {"demo": demo, "tiny": lambda: dict(TINY)}
