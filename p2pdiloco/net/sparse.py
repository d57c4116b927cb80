"""The ``topk2`` wire codec: chunk-wise top-k sparsification with 2-bit values (SparseLoCo,
Sarfi et al., arXiv 2508.15706, section 3: top-k of 1-3% per chunk, 2-bit quantization, error
feedback). The node keeps what a contribution leaves out and adds it to its next
pseudo-gradient (error feedback: ``RoundResult.residual``, ``node.committed``), so nothing is
lost, only delayed.

Chunks. Each tensor is cut into chunks of ``SPARSE_CHUNK`` (4096) consecutive elements, in
row-major order; the last chunk of a tensor may be shorter and chunks never span two tensors.

Contribution (a member's slice; :func:`encode` / :func:`decode`, size fixed by the shapes).
A chunk of m elements keeps its ``k(m) = ceil(m * TOPK / SPARSE_CHUNK)`` entries of largest
magnitude (TOPK = 128: 3.125% of a full chunk; ties go to the lower index). Of those, the
``ceil(k/2)`` largest get magnitude ``hi`` = the mean of their magnitudes, the others ``lo`` =
the mean of theirs (``lo = hi`` when k = 1): two levels per sign, 2 bits per value. A chunk
that holds a non-finite element has ``lo = hi = NaN``, so receivers' finiteness checks reject
it. Layout, all little-endian:

* every chunk's (lo, hi) as two fp32, in tensor then chunk order;
* every kept entry's index within its chunk, 12 bits each (``INDEX_BITS``), strictly
  ascending within a chunk, in chunk order, packed into one bit stream (bit j of entry i at
  bit ``12 i + j``; byte b holds bits 8b..8b+7, least significant first), zero-padded to a
  byte;
* every kept entry's code, 2 bits each in the same entry order and packing: bit 0 the sign
  (1 = negative), bit 1 the level (1 = hi, 0 = lo); zero-padded to a byte.

Merged slice (a reducer's answer; :func:`encode_merged` / :func:`decode_merged`). The merge of
sparse contributions is supported on the union of their entries, so the answer lists its
nonzero entries per chunk, each as an int8 code of the chunk's absmax scale (as ``int8`` in
:mod:`p2pdiloco.net.wire`: ``s = absmax / 127`` in fp32, ``q = round(x / s)`` half to even,
entries whose code is 0 left out). Layout: every chunk's entry count as uint16, every chunk's
scale as fp32, the entries' indices packed as above, then one signed byte per entry. Its size
depends on the values; :func:`merged_max_nbytes` bounds it. Every member decodes the same
bytes, so the answer's own rounding is the same on every member (invariant I1).

Every decoder checks the byte count against the shapes (and, for a merged slice, its counts:
at most the union of the round's contributions, :func:`merged_cap`) before it reads anything,
and refuses indices out of a chunk, not strictly ascending, or nonzero padding, and in a
merged slice scales that are negative or not finite and codes never written (0, -128):
:class:`p2pdiloco.errors.ProtocolError`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from p2pdiloco.errors import ProtocolError

SPARSE_CHUNK = 4096  # elements per chunk
TOPK = 128  # entries kept of a full chunk (3.125%; 64 until wire version 13: docs/benchmarks/codecs.md)
INDEX_BITS = 12  # bits of an index within a chunk: SPARSE_CHUNK == 2 ** INDEX_BITS
CODE_BITS = 2
assert SPARSE_CHUNK == 1 << INDEX_BITS


def _chunk_lengths(numels: Sequence[int]) -> list[int]:
    """Every chunk's element count, in tensor then chunk order."""
    out = []
    for n in numels:
        out += [SPARSE_CHUNK] * (n // SPARSE_CHUNK) + ([n % SPARSE_CHUNK] if n % SPARSE_CHUNK else [])
    return out


def kept(m: int) -> int:
    """k(m): entries a contribution keeps of a chunk of m elements."""
    return -(-m * TOPK // SPARSE_CHUNK)


def _packed_bytes(count: int, bits: int) -> int:
    return -(-count * bits // 8)


def nbytes(shapes: Sequence[tuple[int, ...]]) -> int:
    """Bytes of a contribution of tensors of ``shapes``."""
    lengths = _chunk_lengths([math.prod(s) for s in shapes])
    k = sum(kept(m) for m in lengths)
    return 8 * len(lengths) + _packed_bytes(k, INDEX_BITS) + _packed_bytes(k, CODE_BITS)


def merged_cap(m: int, members: int | None) -> int:
    """Entries a merged slice may list in a chunk of m elements: the union of ``members``
    contributions of k(m) entries each, at most m (None: m)."""
    return m if members is None else min(m, members * kept(m))


def merged_max_nbytes(shapes: Sequence[tuple[int, ...]], members: int | None = None) -> int:
    """The most bytes a merged slice of tensors of ``shapes`` can take, merged from
    ``members`` contributions (None: every entry listed)."""
    lengths = _chunk_lengths([math.prod(s) for s in shapes])
    n = sum(merged_cap(m, members) for m in lengths)
    return 6 * len(lengths) + _packed_bytes(n, INDEX_BITS) + n


# ---- bit streams --------------------------------------------------------------------------

def _pack(values: np.ndarray, bits: int) -> bytes:
    """``values`` (unsigned, each < 2**bits; bits 12 or 2) as the module docstring's bit
    stream: two 12-bit values in three bytes, four 2-bit values in one."""
    if values.size == 0:
        return b""
    per = 2 if bits == INDEX_BITS else 4
    v = np.zeros(-(-values.size // per) * per, dtype=np.uint16)
    v[:values.size] = values
    if bits == INDEX_BITS:
        a, b = v[0::2], v[1::2]
        out = np.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], axis=1).astype(np.uint8).reshape(-1)
    else:
        q = v.reshape(-1, 4)
        out = (q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)).astype(np.uint8)
    return out[:_packed_bytes(values.size, bits)].tobytes()


def _unpack(data: bytes, count: int, bits: int) -> np.ndarray:
    """Inverse of :func:`_pack` for ``count`` values (int64; about 10 bytes of memory a value);
    ProtocolError if a padding bit is set."""
    if count == 0:
        if any(data):
            raise ProtocolError("nonzero padding bits")
        return np.zeros(0, dtype=np.int64)
    raw = np.frombuffer(data, dtype=np.uint8)
    if bits == INDEX_BITS:
        padded = np.zeros(-(-raw.size // 3) * 3, dtype=np.uint16)
        padded[:raw.size] = raw
        t = padded.reshape(-1, 3)
        values = np.stack([t[:, 0] | ((t[:, 1] & 0xF) << 8), (t[:, 1] >> 4) | (t[:, 2] << 4)], axis=1).reshape(-1)
    else:
        values = np.stack([(raw >> s) & 3 for s in (0, 2, 4, 6)], axis=1).reshape(-1)
    if values[count:].any():
        raise ProtocolError("nonzero padding bits")
    return values[:count].astype(np.int64)


def _le(array: np.ndarray) -> bytes:
    return array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()


def _check_indices(idx: np.ndarray, counts: np.ndarray, lengths: np.ndarray) -> None:
    """Every chunk's indices lie in [0, m) and are strictly ascending; ProtocolError if not."""
    if idx.size == 0:
        return
    chunk_of = np.repeat(np.arange(len(counts)), counts)  # [entries]
    if (idx >= lengths[chunk_of]).any():
        raise ProtocolError("index outside its chunk")
    starts = np.zeros(idx.size, dtype=bool)
    starts[np.cumsum(counts)[:-1][counts[1:] > 0]] = True  # first entry of every chunk after the first
    if not ((idx[1:] > idx[:-1]) | starts[1:]).all():
        raise ProtocolError("indices not strictly ascending within a chunk")


def _scatter(numels: Sequence[int], lengths: np.ndarray, counts: np.ndarray, idx: np.ndarray,
             values: torch.Tensor) -> torch.Tensor:
    """A flat fp32 tensor of ``sum(numels)`` zeros with ``values`` at the entries' places."""
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if lengths.size else np.zeros(0, dtype=np.int64)
    where = torch.from_numpy(np.repeat(offsets, counts) + idx)
    return torch.zeros(sum(numels), dtype=torch.float32).index_put_((where,), values)


# ---- contribution ---------------------------------------------------------------------------

def _rows(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every chunk, as fp32 CPU matrices of equal-length chunks: per tensor its full chunks
    [n // SPARSE_CHUNK, SPARSE_CHUNK], then its last chunk [1, n % SPARSE_CHUNK]; chunk order."""
    out = []
    for t in tensors:
        flat = t.detach().reshape(-1).to("cpu", torch.float32)
        full = flat.numel() // SPARSE_CHUNK * SPARSE_CHUNK
        out += [flat[:full].view(-1, SPARSE_CHUNK), flat[full:].view(1, -1)]
    return [m for m in out if m.numel()]


def _select(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scales fp32 [r, 2] as (lo, hi), indices int64 [r, k] ascending, codes int64 [r, k]) of
    the chunks ``rows`` [r, m] (module docstring)."""
    k = kept(rows.shape[1])
    order = torch.sort(rows.abs().neg(), dim=1, stable=True).indices[:, :k]  # largest first; ties: lower index
    picked = rows.gather(1, order)  # [r, k]
    mag = picked.abs()
    h = -(-k // 2)
    hi = mag[:, :h].mean(dim=1)
    lo = mag[:, h:].mean(dim=1) if k > h else hi
    bad = ~torch.isfinite(rows).all(dim=1)
    scales = torch.stack([lo, hi], dim=1).masked_fill_(bad[:, None], math.nan)
    codes = (picked < 0).to(torch.int64) | ((torch.arange(k) < h).to(torch.int64) << 1)  # [r, k]
    idx, by_index = order.sort(dim=1)
    return scales, idx, codes.gather(1, by_index)


def encode(tensors: Sequence[torch.Tensor]) -> bytes:
    """A contribution of ``tensors`` (any shapes, float, any device) in the module docstring's
    layout; :func:`nbytes` of their shapes long."""
    parts = [_select(rows) for rows in _rows(tensors)]
    if not parts:
        return b""
    scales, idx, codes = (torch.cat([p[i].reshape(-1) for p in parts]).numpy() for i in range(3))
    return _le(scales.astype(np.float32)) + _pack(idx, INDEX_BITS) + _pack(codes, CODE_BITS)


def decode(data: bytes, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """Inverse of :func:`encode`: fp32 tensors of ``shapes``, zero outside the kept entries.

    Raises:
        ProtocolError: the byte count does not match the shapes, an index is outside its
            chunk or not strictly ascending, or a padding bit is set.
    """
    numels = [math.prod(s) for s in shapes]
    expected = nbytes(shapes)
    if len(data) != expected:
        raise ProtocolError(f"expected {expected} tensor bytes, got {len(data)}")
    lengths = np.asarray(_chunk_lengths(numels), dtype=np.int64)
    counts = np.asarray([kept(int(m)) for m in lengths], dtype=np.int64)
    k = int(counts.sum())
    scales = np.frombuffer(data, dtype="<f4", count=2 * len(lengths)).astype(np.float32).reshape(-1, 2)
    at = 8 * len(lengths)
    idx = _unpack(data[at:at + _packed_bytes(k, INDEX_BITS)], k, INDEX_BITS)
    code = _unpack(data[at + _packed_bytes(k, INDEX_BITS):], k, CODE_BITS)
    _check_indices(idx, counts, lengths)
    chunk_of = np.repeat(np.arange(len(lengths)), counts)
    mag = np.where(code >> 1, scales[chunk_of, 1], scales[chunk_of, 0]).astype(np.float32)
    values = torch.from_numpy(np.where(code & 1, -mag, mag).astype(np.float32))
    flat = _scatter(numels, lengths, counts, idx, values)
    return [t.reshape(s) for t, s in zip(flat.split(numels), shapes)]


# ---- merged slice ---------------------------------------------------------------------------

def encode_merged(tensors: Sequence[torch.Tensor]) -> bytes:
    """A merged slice of ``tensors`` in the module docstring's layout (size depends on the
    values, at most :func:`merged_max_nbytes` of the shapes)."""
    counts, scales, indices, codes = [], [], [], []
    for rows in _rows(tensors):  # [r, m]
        scale = rows.abs().amax(dim=1) / 127  # fp32 [r]; NaN or inf for a non-finite chunk
        scale = scale.masked_fill_(~torch.isfinite(rows).all(dim=1), math.nan)
        safe = torch.where((scale == 0) | ~torch.isfinite(scale), torch.ones_like(scale), scale)
        q = torch.round(rows / safe[:, None]).clamp_(-127, 127)
        q = torch.where(torch.isfinite(scale)[:, None], q, torch.ones_like(q))  # non-finite: every entry, NaN
        q = q.masked_fill_((scale == 0)[:, None], 0)
        where = torch.nonzero(q)  # [entries, 2] (row, index), chunk then index order
        counts.append((q != 0).sum(dim=1))
        scales.append(scale)
        indices.append(where[:, 1])
        codes.append(q[where[:, 0], where[:, 1]].to(torch.int8))
    if not counts:
        return b""
    idx = torch.cat(indices).numpy()
    return (_le(torch.cat(counts).numpy().astype(np.uint16)) + _le(torch.cat(scales).numpy())
            + _pack(idx, INDEX_BITS) + torch.cat(codes).numpy().tobytes())


def decode_merged(data: bytes, shapes: Sequence[tuple[int, ...]], members: int | None = None) -> list[torch.Tensor]:
    """Inverse of :func:`encode_merged`: fp32 tensors of ``shapes``, merged from ``members``
    contributions (None: any number).

    Raises:
        ProtocolError: a count exceeds what its chunk holds (:func:`merged_cap`), the byte
            count does not match the counts, a scale is negative or not finite, a code is 0 or
            -128 (never written), an index is outside its chunk or not strictly ascending, or
            a padding bit is set.
    """
    numels = [math.prod(s) for s in shapes]
    lengths = np.asarray(_chunk_lengths(numels), dtype=np.int64)
    c = len(lengths)
    if len(data) < 6 * c:
        raise ProtocolError(f"expected at least {6 * c} tensor bytes, got {len(data)}")
    counts = np.frombuffer(data, dtype="<u2", count=c).astype(np.int64)
    if (counts > np.asarray([merged_cap(int(m), members) for m in lengths], dtype=np.int64)).any():
        raise ProtocolError("more entries than its chunk holds")
    k = int(counts.sum())
    expected = 6 * c + _packed_bytes(k, INDEX_BITS) + k
    if len(data) != expected:
        raise ProtocolError(f"expected {expected} tensor bytes, got {len(data)}")
    scales = np.frombuffer(data, dtype="<f4", count=c, offset=2 * c).astype(np.float32)
    if not (np.isfinite(scales) & (scales >= 0)).all():
        raise ProtocolError("a scale is negative or not finite")
    idx = _unpack(data[6 * c:6 * c + _packed_bytes(k, INDEX_BITS)], k, INDEX_BITS)
    _check_indices(idx, counts, lengths)
    codes = np.frombuffer(data, dtype=np.int8, offset=len(data) - k) if k else np.zeros(0, np.int8)
    if ((codes == 0) | (codes == -128)).any():
        raise ProtocolError("a code of 0 or -128")
    q = codes.astype(np.float32)
    values = torch.from_numpy(q * np.repeat(scales, counts))  # fp32
    flat = _scatter(numels, lengths, counts, idx, values)
    return [t.reshape(s) for t, s in zip(flat.split(numels), shapes)]

