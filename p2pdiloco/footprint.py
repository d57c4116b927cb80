"""How much memory a node's model needs, from its settings alone, checked before anything is
built (docs/trust.md, threat table: a signed manifest can name any model size).

The built-in GPT's parameter count is analytic (:attr:`~p2pdiloco.model_config.ModelConfig.num_parameters`);
a factory model (``model.factory``) is built on torch's ``meta`` device, which allocates no
storage, and its parameters and buffers are counted. The estimate is the process's resident
memory now plus :data:`BYTES_PER_PARAMETER` per parameter (activations come on top: a lower
bound, so a model it refuses cannot train here).
"""

from __future__ import annotations

import logging
from typing import Any

import psutil

from p2pdiloco.errors import ConfigError

__all__ = ["RESIDENT_BYTES_PER_PARAMETER", "TRAINING_BYTES_PER_PARAMETER", "BYTES_PER_PARAMETER",
           "model_size", "check_memory", "rss_mib"]

log = logging.getLogger(__name__)

RESIDENT_BYTES_PER_PARAMETER = 12  # built with the model: its fp32 weights 4, the global Θ 4, outer momentum 4
TRAINING_BYTES_PER_PARAMETER = 24  # allocated at the first steps and rounds: gradient 4, AdamW moments 8,
# pseudo-gradient and its wire and merge buffers 12
BYTES_PER_PARAMETER = RESIDENT_BYTES_PER_PARAMETER + TRAINING_BYTES_PER_PARAMETER


def rss_mib() -> float:
    """This process's resident memory, MiB."""
    return psutil.Process().memory_info().rss / 2**20


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


def _size(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def check_memory(cfg: Any, parameters: int | None = None) -> bool:
    """Refuse a node (``cfg``: a ``NodeConfig``) whose model cannot train in this machine's
    available memory (``psutil.virtual_memory().available``) or within ``cfg.memory_limit`` MiB,
    before the model is built. ``parameters``: the count of a model already built (its
    resident bytes are then in this process's memory); None: estimated from the settings
    (:func:`model_size`). Returns whether it could check (False: a factory model that only
    building tells; call again with its count once built).

    Raises:
        ConfigError: one line, the estimate exceeds the available memory or the limit."""
    buffers = 0
    if parameters is None:
        size = model_size(cfg.model)
        if size is None:
            return False
        parameters, buffers = size
        new = parameters * BYTES_PER_PARAMETER + buffers
    else:
        new = parameters * TRAINING_BYTES_PER_PARAMETER
    rss = rss_mib()
    need, available = new / 2**20, psutil.virtual_memory().available / 2**20
    if need > available:
        raise ConfigError(f"model: training this {_size(parameters)}-parameter model needs about {need / 1024:,.1f} GiB "
                          f"of memory, more than the {available / 1024:,.1f} GiB this machine has available: use (or join "
                          "a run with) a smaller model, or free memory")
    if cfg.memory_limit and rss + need > cfg.memory_limit:
        raise ConfigError(f"memory_limit: training this {_size(parameters)}-parameter model needs about "
                          f"{rss + need:,.0f} MiB (more with large batches), over memory_limit = {cfg.memory_limit} "
                          "MiB: raise it, or use a smaller model or batch")
    return True
