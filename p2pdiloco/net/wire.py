"""Tensor encoding on the wire. Merge arithmetic stays fp32; only the bytes sent are narrowed
(brief section 1, "Wire precision": fp16 was lossless in OpenDiLoCo, arXiv 2407.07852)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch

from p2pdiloco.errors import ProtocolError

WIRE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


def wire_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire precision name; ValueError for an unknown name."""
    try:
        return WIRE_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown wire precision {name!r}; choose one of {sorted(WIRE_DTYPES)}") from None


def _swap(data: bytes, itemsize: int) -> bytes:
    """Reverse the byte order of every ``itemsize``-byte item (the wire is little-endian)."""
    return np.frombuffer(data, dtype=f"u{itemsize}").byteswap().tobytes()


def encode(tensors: Sequence[torch.Tensor], precision: str = "fp32") -> bytes:
    """Concatenate ``tensors`` (any shapes, float, any device) as ``precision`` little-endian
    bytes, rounding to nearest."""
    dtype = wire_dtype(precision)
    if not tensors:
        return b""
    flat = torch.cat([t.detach().reshape(-1).to("cpu", dtype) for t in tensors])
    data = flat.view(torch.uint8).numpy().tobytes()
    return data if sys.byteorder == "little" else _swap(data, flat.element_size())


def decode(data: bytes, shapes: Sequence[tuple[int, ...]], precision: str = "fp32") -> list[torch.Tensor]:
    """Inverse of :func:`encode`: fp32 tensors of ``shapes``.

    Raises:
        ProtocolError: the byte count does not match the shapes.
    """
    dtype = wire_dtype(precision)
    numels = [int(torch.Size(s).numel()) for s in shapes]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(data) != sum(numels) * itemsize:
        raise ProtocolError(f"expected {sum(numels) * itemsize} tensor bytes, got {len(data)}")
    if not numels:
        return []
    if not data:  # every shape has a zero dimension; frombuffer refuses an empty buffer
        return [torch.zeros(s) for s in shapes]
    raw = bytearray(data) if sys.byteorder == "little" else bytearray(_swap(data, itemsize))
    flat = torch.frombuffer(raw, dtype=dtype).to(torch.float32)
    return [chunk.reshape(s) for chunk, s in zip(flat.split(numels), shapes)]
