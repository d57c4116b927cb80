"""Invariants I1 and I8 (docs/architecture.md) across CPU generations: the initial model, the
outer step and the merge give the same bytes whichever kernel set torch dispatches to. Each capability runs in its own
subprocess (``ATEN_CPU_CAPABILITY`` is read once, at import) on inputs made here and passed
as a file, so even the inputs do not depend on a kernel. A capability this CPU lacks is left
out (avx512 needs the ``avx512f`` flag in /proc/cpuinfo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = r"""
import hashlib, json, sys
import torch
from p2pdiloco.core.merge import merge_pseudo_gradients
from p2pdiloco.core.outer import FragmentState, nesterov_outer_step
from p2pdiloco.core.periods import Ledger
from p2pdiloco.core.robust import robust_merge
from p2pdiloco.model import ModelConfig, build_model

inputs = torch.load(sys.argv[1])
state = FragmentState.create(0, 0, inputs["theta"], [torch.zeros_like(t) for t in inputs["theta"]])
digests = []
for k, deltas in enumerate(inputs["deltas"]):  # ten outer steps, partial (fractions of a period) and full
    f, units = ((0.5, 512), (0.3330078125, 853), (1 / 1024, 854), (1.0, 1024))[k % 4]
    start = 100 * (k - k % 4) + (100 * k if k % 4 == 3 else 0)  # the full step begins a period of its own
    state = nesterov_outer_step(state, deltas, 0.7, 0.9, f, Ledger(start, 0, 1.0, units, 0))
    digests.append(state.digest)
merged = merge_pseudo_gradients(inputs["members"], inputs["weights"], inputs["embedding_mask"])
robust = robust_merge(inputs["members"], inputs["weights"], inputs["embedding_mask"])
h = hashlib.sha256()
for t in [*merged, *robust.merged]:
    h.update(t.contiguous().numpy().tobytes())
init = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in build_model(ModelConfig(), 7).parameters()))
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "outer": digests, "init": init.hexdigest(),
                  "merge": h.hexdigest(), "clipped": robust.clipped, "misaligned": robust.misaligned}))
"""


def _capabilities() -> list[str]:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return ["default", *(["avx2"] if " avx2" in flags else []), *(["avx512"] if " avx512f" in flags else [])]


def test_initial_model_outer_step_and_merge_are_bit_identical_on_every_cpu_kernel_set(tmp_path):
    caps = _capabilities()
    if len(caps) < 2:
        pytest.skip(f"this CPU offers only {caps}")
    g = torch.Generator().manual_seed(0)
    shapes = [(257, 33), (1031,), (64, 8)]  # odd sizes: vector bodies and scalar tails both run
    theta = [torch.randn(s, generator=g) for s in shapes]
    deltas = [[torch.randn(s, generator=g) * 0.01 for s in shapes] for _ in range(10)]
    members = [[torch.randn(s, generator=g) * 0.01 for s in shapes] for _ in range(4)]
    members[3] = [t * 40 for t in members[3]]  # an outlier: norm-clipped by robust_merge
    members[2][1] = -members[0][1] - members[1][1]  # against the others: the misaligned check runs
    path = tmp_path / "inputs.pt"
    torch.save({"theta": theta, "deltas": deltas, "members": members, "weights": [1.0, 2.5, 0.7, 1.3],
                "embedding_mask": [False, False, True]}, path)
    out = {}
    for cap in caps:
        env = dict(os.environ, ATEN_CPU_CAPABILITY=cap)
        run = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], env=env, capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        out[cap] = json.loads(run.stdout.splitlines()[-1])
        assert out[cap]["capability"].lower() == cap
    first = out[caps[0]]
    assert first["clipped"], "the outlier was meant to be clipped"
    for cap in caps[1:]:
        assert out[cap]["outer"] == first["outer"], (cap, caps[0])
        assert out[cap]["merge"] == first["merge"], (cap, caps[0])
        assert out[cap]["init"] == first["init"], (cap, caps[0])  # invariant I8: the same start


def test_the_same_inputs_differ_under_a_fused_multiply_add_so_the_check_above_can_fail(tmp_path):
    """Guard for the test above: torch's own ``add(alpha=)`` rounds differently on the default
    and the avx2 kernels (a fused multiply-add in the vectorised kernel only), so comparing
    digests across capabilities does detect kernel-dependent rounding."""
    caps = _capabilities()
    if "avx2" not in caps:
        pytest.skip("needs avx2")
    g = torch.Generator().manual_seed(1)
    path = tmp_path / "ab.pt"
    torch.save([torch.randn(4099, generator=g), torch.randn(4099, generator=g)], path)
    script = ("import sys, hashlib, torch; a, b = torch.load(sys.argv[1]); "
              "print(hashlib.sha256(a.add(b, alpha=0.7).numpy().tobytes()).hexdigest())")
    got = {cap: subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=60,
                               env=dict(os.environ, ATEN_CPU_CAPABILITY=cap)).stdout.strip() for cap in ("default", "avx2")}
    assert got["default"] and got["avx2"] and got["default"] != got["avx2"]
