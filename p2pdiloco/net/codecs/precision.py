"""The names of the wire precisions (their encodings: :mod:`p2pdiloco.net.codecs.wire`), without torch,
so that a node's settings are checked before torch is imported (p2pdiloco.cli)."""

from __future__ import annotations

import typing
from typing import Literal

__all__ = ["WirePrecision", "WIRE_PRECISIONS"]

WirePrecision = Literal["fp32", "fp16", "bf16", "int8", "int4", "topk2"]
WIRE_PRECISIONS: tuple[str, ...] = typing.get_args(WirePrecision)
