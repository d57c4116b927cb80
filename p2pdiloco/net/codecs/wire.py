"""Tensor encoding on the wire. Merge arithmetic stays fp32; only the bytes sent are narrowed
(fp16 was lossless in OpenDiLoCo, arXiv 2407.07852; int8 in INTELLECT-1, arXiv 2412.01152;
int4 outer gradients about lossless in Decoupled DiLoCo, arXiv 2604.21428).

Precisions (``WIRE_DTYPES``, the registry the config validates against):

* ``fp32``, ``fp16``, ``bf16``: every element as that float type, little-endian, rounded to
  nearest.
* ``int8``, ``int4``: symmetric per-chunk absmax quantization. Each tensor is cut into
  chunks of ``CHUNK`` consecutive elements (row-major; the last chunk of a tensor may be
  shorter; chunks never span two tensors). A chunk's scale is ``s = absmax / L`` in fp32
  (``L`` = 127 for int8, 7 for int4) and each element is sent as ``q = round(x / s)``
  (round half to even) clamped to ``[-L, L]``; an all-zero chunk has ``s = 0`` and ``q = 0``.
  On receipt, ``x' = q * s`` is computed in fp32, so every sum that follows accumulates in
  fp32. Layout: every chunk's scale as little-endian fp32, in tensor then chunk order,
  followed by the codes: int8 one signed byte per element; int4 two's-complement nibbles,
  two per byte, the element with the even index in the low nibble, and a final high nibble
  of 0 when the element count is odd. A non-finite element makes its chunk's scale (and so
  every decoded element of that chunk) non-finite, so receivers' finiteness checks still
  reject it.
* ``topk2``: chunk-wise top-k (5.47%) with 2-bit values, SparseLoCo's codec (arXiv
  2508.15706), the entries' places Rice-coded; layout and rules in :mod:`p2pdiloco.net.codecs.sparse`.

A member's slice (its contribution) and a reducer's merged slice use the same encoding
(:func:`encode`, :func:`encode_merged`), except for ``topk2``, whose merged slice lists the
union of the contributions' entries at int8 (:func:`p2pdiloco.net.codecs.sparse.encode_merged`) and
has a size that depends on its values, bounded by :func:`merged_max_nbytes`. Lossy precisions
leave a quantisation residual with the sender, added to its next pseudo-gradient (error
feedback, ``RoundResult.residual``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import numpy as np
import torch

from p2pdiloco.errors import ProtocolError
from p2pdiloco.net.codecs import sparse
from p2pdiloco.net.codecs.precision import WIRE_PRECISIONS

# name -> storage dtype of one element on the wire (int4 codes are packed two per uint8)
WIRE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int8": torch.int8,
    "int4": torch.uint8,
    "topk2": torch.uint8,  # a byte stream (p2pdiloco.net.codecs.sparse)
}
assert tuple(WIRE_DTYPES) == WIRE_PRECISIONS, "p2pdiloco/net/codecs/precision.py names the same precisions"
QUANT_LEVELS: dict[str, int] = {"int8": 127, "int4": 7}  # largest code magnitude L
CHUNK = 256  # elements per absmax scale


def wire_dtype(name: str) -> torch.dtype:
    """The torch storage dtype of a wire precision name; ValueError for an unknown name."""
    try:
        return WIRE_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown wire precision {name!r}; choose one of {sorted(WIRE_DTYPES)}") from None


def _num_chunks(numel: int) -> int:
    return -(-numel // CHUNK)


def wire_nbytes(shapes: Sequence[tuple[int, ...]], precision: str = "fp32") -> int:
    """Bytes :func:`encode` produces for tensors of ``shapes`` at ``precision``."""
    dtype = wire_dtype(precision)
    if precision == "topk2":
        return sparse.nbytes(shapes)
    numels = [math.prod(s) for s in shapes]
    total = sum(numels)
    if precision not in QUANT_LEVELS:
        return total * torch.empty((), dtype=dtype).element_size()
    scales = 4 * sum(_num_chunks(n) for n in numels)
    return scales + (total if precision == "int8" else -(-total // 2))


def _swap(data: bytes, itemsize: int) -> bytes:
    """Reverse the byte order of every ``itemsize``-byte item (the wire is little-endian)."""
    return np.frombuffer(data, dtype=f"u{itemsize}").byteswap().tobytes()


def _le_fp32(t: torch.Tensor) -> bytes:
    data = t.contiguous().view(torch.uint8).numpy().tobytes()
    return data if sys.byteorder == "little" else _swap(data, 4)


def _quantize(tensors: Sequence[torch.Tensor], levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales fp32 [chunks], codes int8 [elements]) of the module docstring's scheme."""
    scales, codes = [], []
    for t in tensors:
        flat = t.detach().reshape(-1).to("cpu", torch.float32)
        n = flat.numel()
        if n == 0:
            continue
        pad = _num_chunks(n) * CHUNK - n
        chunks = torch.nn.functional.pad(flat, (0, pad)).view(-1, CHUNK)  # [chunks, CHUNK]
        absmax = chunks.abs().amax(dim=1)  # NaN if the chunk holds a NaN
        absmax = torch.where(torch.isnan(chunks).any(dim=1), torch.full_like(absmax, math.nan), absmax)
        scale = absmax / levels  # fp32
        safe = torch.where((scale == 0) | ~torch.isfinite(scale), torch.ones_like(scale), scale)
        q = torch.round(chunks / safe[:, None]).clamp_(-levels, levels)
        q = torch.where(torch.isfinite(q), q, torch.zeros_like(q))
        scales.append(scale)
        codes.append(q.reshape(-1)[:n].to(torch.int8))
    if not codes:
        return torch.empty(0), torch.empty(0, dtype=torch.int8)
    return torch.cat(scales), torch.cat(codes)


def encode(tensors: Sequence[torch.Tensor], precision: str = "fp32") -> bytes:
    """Concatenate ``tensors`` (any shapes, float, any device) in the wire format of
    ``precision`` (module docstring); floats are rounded to nearest."""
    dtype = wire_dtype(precision)
    if not tensors:
        return b""
    if precision == "topk2":
        return sparse.encode(tensors)
    if precision in QUANT_LEVELS:
        scales, codes = _quantize(tensors, QUANT_LEVELS[precision])
        if precision == "int8":
            body = codes.numpy().tobytes()
        else:
            nib = (codes.to(torch.int16) & 0xF).to(torch.uint8)
            if nib.numel() % 2:
                nib = torch.cat([nib, torch.zeros(1, dtype=torch.uint8)])
            body = (nib[0::2] | (nib[1::2] << 4)).numpy().tobytes()
        return _le_fp32(scales) + body
    flat = torch.cat([t.detach().reshape(-1).to("cpu", dtype) for t in tensors])
    data = flat.view(torch.uint8).numpy().tobytes()
    return data if sys.byteorder == "little" else _swap(data, flat.element_size())


def encode_view(tensors: Sequence[torch.Tensor]) -> memoryview:
    """:func:`encode` at ``fp32`` as a read-only view of one flat copy of ``tensors``, not
    ``bytes``: one copy of a state being served, where ``encode`` holds two while it returns."""
    if sys.byteorder != "little" or not tensors:
        return memoryview(encode(tensors, "fp32"))
    flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])
    return memoryview(flat.view(torch.uint8).numpy()).toreadonly()


def _dequantize(data: bytes, numels: list[int], precision: str) -> torch.Tensor:
    n_scales = sum(_num_chunks(n) for n in numels)
    raw = bytearray(data[:4 * n_scales])
    if sys.byteorder != "little":
        raw = bytearray(_swap(bytes(raw), 4))
    scales = torch.frombuffer(raw, dtype=torch.float32) if raw else torch.empty(0)
    body = bytearray(data[4 * n_scales:])
    total = sum(numels)
    if precision == "int8":
        codes = torch.frombuffer(body, dtype=torch.int8).to(torch.float32)
    else:
        packed = torch.frombuffer(body, dtype=torch.uint8).to(torch.int16)
        nib = torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1)[:total]
        codes = torch.where(nib >= 8, nib - 16, nib).to(torch.float32)
    out, c, s = [], 0, 0
    for n in numels:
        k = _num_chunks(n)
        per_elem = scales[s:s + k].repeat_interleave(CHUNK)[:n]
        out.append(codes[c:c + n] * per_elem)  # fp32
        c, s = c + n, s + k
    return torch.cat(out) if out else torch.empty(0)


def decode(data: bytes | bytearray, shapes: Sequence[tuple[int, ...]], precision: str = "fp32", *,
           adopt: bool = False) -> list[torch.Tensor]:
    """Inverse of :func:`encode`: fp32 tensors of ``shapes``. ``adopt`` (fp32 on a little-endian
    machine, ``data`` a ``bytearray``): the tensors are views of ``data`` itself, no copy; the
    caller hands the buffer over and must not use it again.

    Raises:
        ProtocolError: the byte count does not match the shapes.
    """
    dtype = wire_dtype(precision)
    if precision == "topk2":
        return sparse.decode(data, shapes)
    numels = [int(torch.Size(s).numel()) for s in shapes]
    expected = wire_nbytes(shapes, precision)
    if len(data) != expected:
        raise ProtocolError(f"expected {expected} tensor bytes, got {len(data)}")
    if not numels:
        return []
    if sum(numels) == 0:  # every shape has a zero dimension; frombuffer refuses an empty buffer
        return [torch.zeros(s) for s in shapes]
    if precision in QUANT_LEVELS:
        flat = _dequantize(data, numels, precision)
    else:
        itemsize = torch.empty((), dtype=dtype).element_size()
        if adopt and isinstance(data, bytearray) and sys.byteorder == "little" and dtype == torch.float32:
            raw = data
        else:
            raw = bytearray(data) if sys.byteorder == "little" else bytearray(_swap(data, itemsize))
        flat = torch.frombuffer(raw, dtype=dtype).to(torch.float32)
    return [chunk.reshape(s) for chunk, s in zip(flat.split(numels), shapes)]


def merged_max_nbytes(shapes: Sequence[tuple[int, ...]], precision: str = "fp32", members: int | None = None) -> int:
    """The most bytes :func:`encode_merged` produces for tensors of ``shapes`` merged from
    ``members`` contributions (None: any number): exactly :func:`wire_nbytes` except for
    ``topk2``."""
    wire_dtype(precision)
    if precision == "topk2":
        return sparse.merged_max_nbytes(shapes, members)
    return wire_nbytes(shapes, precision)


def encode_merged(tensors: Sequence[torch.Tensor], precision: str = "fp32") -> bytes:
    """A reducer's merged slice of ``tensors`` at ``precision`` (module docstring)."""
    wire_dtype(precision)
    return sparse.encode_merged(tensors) if precision == "topk2" else encode(tensors, precision)


def decode_merged(data: bytes, shapes: Sequence[tuple[int, ...]], precision: str = "fp32",
                  members: int | None = None) -> list[torch.Tensor]:
    """Inverse of :func:`encode_merged`: fp32 tensors of ``shapes``, merged from ``members``
    contributions (None: any number).

    Raises:
        ProtocolError: the bytes do not match the shapes (:func:`decode`,
            :func:`p2pdiloco.net.codecs.sparse.decode_merged`).
    """
    wire_dtype(precision)
    if precision == "topk2":
        return sparse.decode_merged(data, shapes, members)
    return decode(data, shapes, precision)
