"""How much memory a node needs, from its settings alone, shown before it starts and checked
before anything is built (docs/trust.md, threat table: a signed manifest can name any model
size; docs/operating.md, "Memory").

The built-in GPT's parameter count is analytic (:attr:`~p2pdiloco.model_config.ModelConfig.num_parameters`);
a factory model (``model.factory``) is built on torch's ``meta`` device, which allocates no
storage, and its parameters and buffers are counted. From the count N, the node's settings and
the process's resident memory before the model is built, :func:`estimate` adds, in bytes:

- the model's fp32 weights (4 N) and their gradients (4 N);
- AdamW's two moments (8 N; Loshchilov & Hutter, arXiv 1711.05101);
- the global state Θ (4 N) and the outer Nesterov momentum (4 N) of every fragment
  (DiLoCo, arXiv 2311.08105; Decoupled DiLoCo, arXiv 2604.21428);
- the log of each fragment's last merged rounds, kept to serve nodes that are behind
  (p2pdiloco/net/state/deltas.py: at most ``DELTA_SHARE`` = 0.5 of the fragment's 8-byte
  state per parameter: 4 N);
- the buffers of one fragment's round or state transfer in flight (fragments sync one at a
  time, staggered: arXiv 2501.18512): :data:`TRANSFER_COPIES` fp32 copies of the largest
  fragment (≈ N / ``outer.fragments``): the pseudo-gradient, its wire bytes, the peers' parts
  and the merged result, the new Θ and momentum before the old ones are freed;
- the activations one inner step keeps for its backward pass at ``data.batch_size`` x
  ``model.block_size``: per layer ``ACTIVATION_WORDS_PER_TOKEN`` x n_embd fp32 values per
  token plus 2 attention maps of n_head x block_size per token (Korthikanti et al., arXiv
  2205.05198, section 4.1, without dropout masks, in fp32), and the logits with their
  log-softmax and gradient (3 x vocab_size per token).

A checkpoint serializes the live tensors between two steps (node/checkpoint.py) and a state is
evaluated through a view of the live model (p2pdiloco.exported.GlobalView): neither adds a copy.
On glibc, :func:`bound_heap` makes freed tensors go back to the system, so resident memory
follows what is allocated (without it a node's heap and per-thread arenas kept freed tensors:
6.4 GiB resident against 3.5 GiB estimated for a 101M-parameter model).
"""

from __future__ import annotations

import logging
import ctypes
import math
import sys
from dataclasses import dataclass
from typing import Any

import psutil

from p2pdiloco.errors import ConfigError

__all__ = ["Footprint", "estimate", "bound_heap", "model_size", "check_memory", "rss_mib", "peak_rss_mib", "TRANSFER_COPIES",
           "ACTIVATION_WORDS_PER_TOKEN", "LOGIT_COPIES"]

log = logging.getLogger(__name__)

MIB = 2**20
FP32 = 4
TRANSFER_COPIES = 6  # fp32 copies of one fragment while its round or download is in flight (module docstring)
ACTIVATION_WORDS_PER_TOKEN = 32  # fp32 values per token and n_embd saved per layer for the backward pass
LOGIT_COPIES = 3  # logits, their log-softmax and its gradient, vocab_size fp32 values each per token
ROUND_LOG_BYTES_PER_PARAMETER = 4  # net.state.deltas: DELTA_SHARE (0.5) x 8 state bytes per parameter
MMAP_THRESHOLD = 1 << 20  # bytes: allocations this large or larger are mapped on their own (bound_heap)
MALLOC_ARENAS = 2  # glibc malloc arenas at most (bound_heap)
_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # mallopt(3) parameters, glibc's malloc.h


def bound_heap() -> bool:
    """On glibc (Linux): ``mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)`` so every allocation of
    1 MiB or more (tensors) is mapped on its own and returned to the system when freed (a set
    threshold also stops glibc from raising it to 32 MiB after the first such free), and
    ``mallopt(M_ARENA_MAX, MALLOC_ARENAS)`` so threads share few arenas. Call once, early in
    the process. Returns whether both were set (False elsewhere: nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(_M_ARENA_MAX, MALLOC_ARENAS))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


def rss_mib() -> float:
    """This process's resident memory, MiB."""
    return psutil.Process().memory_info().rss / MIB


def peak_rss_mib() -> float:
    """This process's peak resident memory since it started, MiB: on Linux the high-water mark
    of its own address space (``VmHWM`` in /proc/self/status, which a new program starts afresh;
    ``getrusage``'s ``ru_maxrss`` survives execve and, for a process its parent spawned with
    vfork as Python's subprocess does, starts at the parent's peak), else ``ru_maxrss`` (bytes
    on macOS), else its current one (Windows)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource  # noqa: PLC0415  (POSIX only)
    except ImportError:
        return rss_mib()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MIB if sys.platform == "darwin" else peak / 1024


def model_size(model: Any) -> tuple[int, int] | None:
    """(parameters, buffer bytes) of the model ``model`` (a ``ModelConfig``) builds, without
    allocating it; None when a factory model cannot be built on the ``meta`` device (its own
    code needs real tensors), so only building it tells.

    Raises:
        ConfigError: the factory cannot be imported (one line, :func:`p2pdiloco.factory.resolve_factory`)."""
    n = model.num_parameters
    if n is not None:
        return n, 0
    import torch  # noqa: PLC0415  (only for a factory model)

    from p2pdiloco.factory import resolve_factory  # noqa: PLC0415

    try:
        factory = resolve_factory(model.factory)
    except ValueError as e:
        raise ConfigError(f"model.factory: {e}") from None
    try:
        with torch.device("meta"), torch.random.fork_rng(devices=[]):
            net = factory(model)
        params = {id(p): p.numel() for p in net.parameters()}  # a tied parameter once
        buffers = sum(b.numel() * b.element_size() for b in net.buffers())
    except Exception as e:  # noqa: BLE001  (the factory's own code, on meta tensors)
        log.debug("model.factory %s on the meta device: %s", model.factory, e)
        return None
    return sum(params.values()), buffers


@dataclass(frozen=True)
class Footprint:
    """A node's memory estimate, bytes per part (:func:`estimate`; module docstring for each
    rule). ``process``: resident memory of the process before the model is built (interpreter,
    torch, libraries); ``parameters``: the model's count N."""

    parameters: int
    process: int
    weights: int
    gradients: int
    adamw: int
    global_state: int
    outer_momentum: int
    round_log: int
    transfers: int
    activations: int
    buffers: int

    @property
    def total(self) -> int:
        """All parts, bytes."""
        return (self.process + self.weights + self.gradients + self.adamw + self.global_state + self.outer_momentum
                + self.round_log + self.transfers + self.activations + self.buffers)

    def as_dict(self) -> dict[str, Any]:
        """For the status JSON: ``parameters`` and each part in MiB (rounded), ``total_mib``."""
        parts = {k: round(v / MIB) for k, v in vars(self).items() if k != "parameters"}
        return {"parameters": self.parameters, **{f"{k}_mib": v for k, v in parts.items()},
                "total_mib": round(self.total / MIB)}

    def line(self) -> str:
        """One line for the log: the total and its parts, MiB."""
        mib = lambda b: f"{b / MIB:,.0f}"  # noqa: E731
        return (f"memory estimate {mib(self.total)} MiB for this {_size(self.parameters)}-parameter model: process "
                f"{mib(self.process)}, weights {mib(self.weights)}, gradients {mib(self.gradients)}, AdamW "
                f"{mib(self.adamw)}, global state {mib(self.global_state)}, outer momentum {mib(self.outer_momentum)}, "
                f"round log {mib(self.round_log)}, transfers {mib(self.transfers)}, "
                f"activations {mib(self.activations)}"
                + (f", buffers {mib(self.buffers)}" if self.buffers else ""))


def estimate(cfg: Any, parameters: int, buffers: int = 0, process_bytes: int | None = None) -> Footprint:
    """The memory a node (``cfg``: a ``NodeConfig``) training a model of ``parameters``
    parameters (and ``buffers`` bytes of module buffers) needs at its peak, bytes per part
    (module docstring). ``process_bytes``: resident memory before the model is built (default:
    this process's now). Uses ``cfg.model`` (n_layer, n_head, n_embd, block_size, vocab_size),
    ``cfg.data.batch_size`` and ``cfg.outer.fragments``."""
    n, m = parameters, cfg.model
    fragment = math.ceil(n / max(1, min(cfg.outer.fragments, n)))
    tokens = cfg.data.batch_size * m.block_size
    per_layer = tokens * (ACTIVATION_WORDS_PER_TOKEN * m.n_embd + 2 * m.n_head * m.block_size)
    activations = FP32 * (m.n_layer * per_layer + LOGIT_COPIES * tokens * m.vocab_size)
    process = psutil.Process().memory_info().rss if process_bytes is None else process_bytes
    return Footprint(parameters=n, process=process, weights=FP32 * n, gradients=FP32 * n, adamw=2 * FP32 * n,
                     global_state=FP32 * n, outer_momentum=FP32 * n, round_log=ROUND_LOG_BYTES_PER_PARAMETER * n,
                     transfers=TRANSFER_COPIES * FP32 * fragment,
                     activations=activations, buffers=buffers)


def _size(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def check_memory(cfg: Any, parameters: int | None = None, process_bytes: int | None = None) -> Footprint | None:
    """Refuse a node (``cfg``: a ``NodeConfig``) whose model cannot train in this machine's
    available memory (``psutil.virtual_memory().available``) or within ``cfg.memory_limit`` MiB,
    before the model is built. ``parameters``: the count of a model already built, and
    ``process_bytes`` the process's resident bytes before it was built; None: the count is
    estimated from the settings (:func:`model_size`) and the process measured now. Returns the
    :func:`estimate` it checked, or None when it could not (a factory model that only building
    tells; call again with its count once built).

    Raises:
        ConfigError: one line, the estimate exceeds the available memory or the limit."""
    buffers = 0
    if parameters is None:
        size = model_size(cfg.model)
        if size is None:
            return None
        parameters, buffers = size
    fp = estimate(cfg, parameters, buffers, process_bytes)
    need = fp.total - fp.process  # what is not resident yet
    available = psutil.virtual_memory().available
    if need > available:
        raise ConfigError(f"model: training this {_size(parameters)}-parameter model needs about "
                          f"{need / 2**30:,.1f} GiB of memory, more than the {available / 2**30:,.1f} GiB this machine "
                          "has available: use (or join a run with) a smaller model, or free memory")
    if cfg.memory_limit and fp.total > cfg.memory_limit * MIB:
        raise ConfigError(f"memory_limit: training this {_size(parameters)}-parameter model needs about "
                          f"{fp.total / MIB:,.0f} MiB ({fp.process / MIB:,.0f} MiB of process, "
                          f"{(fp.total - fp.process - fp.activations) / MIB:,.0f} MiB of model, optimizer, global "
                          f"state and transfers, {fp.activations / MIB:,.0f} MiB of activations), over memory_limit = "
                          f"{cfg.memory_limit} MiB: raise it, or use a smaller model or batch")
    return fp
