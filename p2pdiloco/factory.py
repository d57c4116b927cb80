"""Your own model: any torch module built by a factory named ``package.module:function``.

``model.factory = "package.module:function"`` (``[model]`` in the TOML file, or
``--set model.factory=...``) makes every node train ``function(cfg)`` instead of the built-in
byte GPT (:mod:`p2pdiloco.model`). The factory is called with the node's whole
:class:`~p2pdiloco.model.ModelConfig` (vocab_size, block_size, n_layer, n_head, n_embd: sizes
it may follow or ignore) and must return a ``torch.nn.Module`` whose ``forward(idx)`` takes
int64 token IDs [B, T] (T <= block_size, values in [0, vocab_size)) and returns the logits
[B, T, vocab_size]: a tensor, or an object with ``.logits`` (transformers' ``CausalLMOutput``),
or a tuple whose first element is the logits. :class:`FactoryModel` wraps it so that the
learner and the evaluation get fp32 logits whatever it returns; its parameters are named
``net.<the module's own names>``.

The module is imported as ``python -m`` would find it: from the installed packages,
``PYTHONPATH``, and the current working directory (``my_models.py`` next to where the node is
started: ``model.factory = "my_models:build"``), which :func:`resolve_factory` adds to the end
of ``sys.path`` so that an installed module of the same name wins.

Examples in this repository: ``p2pdiloco.models.torch_lm:decoder_lm`` (plain torch, no extra
library) and ``p2pdiloco.models.hf:gpt2`` (needs ``transformers``).

Every node of a run builds the identical start (invariant I8, docs/architecture.md), whatever
its CPU: see :func:`redraw_parameters` for the rule. Every node of a group must also build the
same module: the protocol tag (``node.runtime.protocol_tag``) covers the factory string and
every parameter's name and shape, so nodes whose factories differ never merge.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn as nn
from torch import Tensor

if TYPE_CHECKING:  # annotations only: p2pdiloco.model imports this module to build factory models
    from p2pdiloco.model import ModelConfig

__all__ = ["FactoryModel", "build_factory_model", "redraw_parameters", "resolve_factory"]


def resolve_factory(spec: str) -> Callable[[ModelConfig], nn.Module]:
    """The callable named by ``spec`` = ``"package.module:function"`` (``function`` may be
    dotted: ``module:Class.method``). Imports the module (its top-level code runs), from the
    installed packages, ``PYTHONPATH`` or the current working directory (added to the end of
    ``sys.path``).

    Raises:
        ValueError: one line, without a traceback: ``spec`` is malformed, the module cannot be
            imported (the exception's type and message are given: a missing library, a syntax
            error...), it has no such attribute, or that attribute is not callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name.strip() or not attr.strip() or any(c.isspace() for c in spec):
        raise ValueError(f"{spec!r} is not of the form package.module:function")
    _cwd_on_path()
    try:
        obj = importlib.import_module(module_name)
    except (Exception, SystemExit) as e:  # noqa: BLE001  (a missing library, a SyntaxError...: one line each)
        raise ValueError(f"cannot import {module_name!r}: {_one_line(e)}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{spec} is a {type(obj).__name__}, not a callable")
    return obj


def _cwd_on_path() -> None:
    """Make the current working directory importable, as ``python -m`` does (it puts it first;
    here it goes last, so a file in the folder never hides an installed module). Console scripts
    such as ``p2pdiloco`` start with their own folder on ``sys.path`` instead."""
    try:
        cwd = os.getcwd()
    except OSError:  # the folder was removed under us: nothing to add
        return
    if "" not in sys.path and cwd not in sys.path:
        sys.path.append(cwd)


def _one_line(e: BaseException) -> str:
    """``Type: first line of the message`` of an exception."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _logits(out: object) -> Tensor:
    """The logits in a module's output: a tensor, ``out.logits``, or ``out[0]``."""
    if isinstance(out, Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    raise TypeError(f"the model returned a {type(out).__name__}, not logits (a tensor, .logits or a tuple)")


class FactoryModel(nn.Module):
    """A factory's module ``net`` with the built-in GPT's interface: ``forward(idx)``: idx
    int64 [B, T], T <= block_size -> logits fp32 [B, T, V] (V = the module's output width,
    checked equal to ``cfg.vocab_size`` when built by :func:`build_factory_model`), and
    ``embedding_names()``. Raises ValueError when T exceeds ``cfg.block_size``."""

    def __init__(self, net: nn.Module, cfg: ModelConfig) -> None:
        super().__init__()
        self.net, self.cfg = net, cfg
        names = {id(p): n for n, p in self.named_parameters()}  # tied weights: the first name only
        self._embeddings = tuple(dict.fromkeys(
            names[id(p)] for m in self.modules() if isinstance(m, nn.Embedding)
            for p in m.parameters(recurse=False) if id(p) in names))

    def embedding_names(self) -> tuple[str, ...]:
        """Names of the parameters of every ``nn.Embedding`` inside (a weight tied to an output
        layer is named once, under the name ``named_parameters`` gives it), in model order."""
        return self._embeddings

    def forward(self, idx: Tensor) -> Tensor:
        if idx.shape[-1] > self.cfg.block_size:
            raise ValueError(f"sequence length {idx.shape[-1]} exceeds block_size {self.cfg.block_size}")
        return _logits(self.net(idx)).float()


def _round_sig2(x: float) -> tuple[float, int]:
    """``x`` > 0 rounded to 2 significant decimal digits, and the decimal exponent of its
    leading digit (from Python's correctly rounded formatting: the same on every machine)."""
    text = f"{x:.1e}"
    return float(text), int(text.split("e")[1])


def redraw_parameters(model: nn.Module, seed: int) -> None:
    """Redraw ``model``'s parameters in place so that their values depend on ``seed`` and the
    module's structure alone, not on the CPU (invariant I8).

    Rule: for each parameter in ``named_parameters`` order, a tensor whose values are all equal
    (LayerNorm ones, zero biases) is kept as built. Every other one is replaced by draws from
    NumPy's PCG64 generator (``np.random.default_rng(seed).standard_normal``, float64, one
    generator for the whole model) scaled to N(mean, σ²) and rounded once to the parameter's
    dtype, where σ is the tensor's own standard deviation as built, rounded to 2 significant
    digits, and mean its own mean, rounded to the decimal place of σ's second digit (so a
    zero-mean init's sampling noise, about σ/√n, becomes 0 on any tensor of more than a
    hundred or so elements). Statistics are computed in float64 by NumPy.

    Why: torch's own init draws (``normal_``) run different kernels on different CPUs
    (default, avx2, avx512 vectorised Box-Muller) whose values differ in their last bits, so
    the module the factory builds is not bit-identical across machines, and nodes that start
    from different bits never hold equal digests. Those differences move a tensor's mean and
    σ by about 1e-7 relative; rounding to 2 digits removes them (unless a statistic lies
    within that distance of a rounding boundary: about one tensor in a million) and keeps
    the scale the factory chose (GPT-2's 0.02, nn.Linear's 1/√(3·fan_in) uniform, which
    becomes a normal of the same σ). Buffers are left as built: a factory must not fill
    buffers at random."""
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            values = p.detach().to("cpu", torch.float64).numpy()
            if values.size == 0 or values.min() == values.max():
                continue
            sigma, exponent = _round_sig2(float(values.std()))
            mean = round(float(values.mean()), 1 - exponent)
            draws = rng.standard_normal(tuple(p.shape)) * sigma + mean
            p.copy_(torch.from_numpy(draws.astype(np.float32)).to(p.dtype))


def build_factory_model(cfg: ModelConfig, seed: int) -> FactoryModel:
    """``cfg.factory(cfg)``, built with torch's RNG seeded with ``seed`` (the caller's RNG
    states are left untouched), converted to fp32, wrapped in :class:`FactoryModel`, its
    parameters redrawn by :func:`redraw_parameters` (the same start on every node and CPU),
    and probed once with a [1, min(2, block_size)] batch of token 0 to check its output.

    Raises:
        ValueError: one line naming ``model.factory``: the factory cannot be resolved
            (:func:`resolve_factory`), raises, returns no ``nn.Module``, has no parameters or
            non-floating ones, or returns anything but logits [B, T, vocab_size].
    """
    spec = cfg.factory
    try:
        factory = resolve_factory(spec)
    except ValueError as e:
        raise ValueError(f"model.factory: {e}") from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            net = factory(cfg)
        except Exception as e:  # noqa: BLE001  (a factory's own error: one line)
            raise ValueError(f"model.factory: {spec}(cfg) raised {_one_line(e)}") from None
        if not isinstance(net, nn.Module):
            raise ValueError(f"model.factory: {spec}(cfg) returned a {type(net).__name__}, not a torch.nn.Module")
        params = list(net.parameters())
        if not params:
            raise ValueError(f"model.factory: {spec}(cfg) built a module without parameters")
        if not all(p.is_floating_point() for p in params):
            raise ValueError(f"model.factory: {spec}(cfg) built a module with non-floating-point parameters")
        model = FactoryModel(net.float(), cfg)
        redraw_parameters(model, seed)
        T = min(2, cfg.block_size)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                logits = model(torch.zeros(1, T, dtype=torch.long))
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"model.factory: {spec}(cfg)'s module fails on int64 tokens [1, {T}]: "
                             f"{_one_line(e)}") from None
        finally:
            model.train(was_training)
    if tuple(logits.shape) != (1, T, cfg.vocab_size):
        raise ValueError(f"model.factory: {spec}(cfg)'s module returns {tuple(logits.shape)} for tokens [1, {T}]; "
                         f"expected logits [1, {T}, {cfg.vocab_size}] (model.vocab_size)")
    if not bool(torch.isfinite(logits).all()):
        raise ValueError(f"model.factory: {spec}(cfg)'s module returns non-finite logits at its start")
    return model
