"""The ``topk2`` wire codec: chunk-wise top-k sparsification with 2-bit values (SparseLoCo,
Sarfi et al., arXiv 2508.15706, section 3: top-k of 1-3% per chunk, 2-bit quantization, error
feedback), its entries' places Rice-coded (Golomb-Rice coding of the gaps between positions,
as Sparse Ternary Compression codes them: Sattler et al., arXiv 1903.02891). The
node keeps what a contribution leaves out and adds it to its next pseudo-gradient (error
feedback: ``RoundResult.residual``, ``node.committed``), so nothing is lost, only delayed.

Chunks. Each tensor is cut into chunks of ``SPARSE_CHUNK`` (4096) consecutive elements, in
row-major order; the last chunk of a tensor may be shorter and chunks never span two tensors.

Places (both layouts below). A chunk of m elements listing c entries at strictly ascending
indices i_0 < ... < i_{c-1} codes the gaps g_0 = i_0, g_j = i_j - i_{j-1} - 1 with the Rice
parameter r(m, c) (:func:`rice_parameter`: the r in 0..12 that makes the chunk's longest
possible code, c (r + 1) + floor((m - c) / 2^r) bits, shortest; ties to the smaller r; r = 0
when c = 0). A gap g is its low r bits (the remainder) and floor(g / 2^r) in unary (that many 1
bits, then a 0). A chunk's gaps add up to at most m - c (its unlisted elements), so its unary
bits are at most c + floor((m - c) / 2^r): at 224 of 4096, r = 4 and at most 6.1 bits a place
(remainder and unary) against 12 for a plain index. Every remainder of the slice, in chunk then
entry order, forms one bit stream (bit j of a field at the field's start + j; byte b holds bits
8b..8b+7, least significant first; zero-padded to a byte), and every unary code another, in the
same order.

Contribution (a member's slice; :func:`encode` / :func:`decode`, size fixed by the shapes). A
chunk of m elements keeps its ``k(m) = ceil(m * TOPK / SPARSE_CHUNK)`` entries of largest
magnitude (TOPK = 224: 5.47% of a full chunk, above SparseLoCo's 1-3%: fewer entries trained
measurably worse in DiLoCo's regime, docs/benchmarks/codecs_density_grid.md; ties go to the
lower index). Of those, the ``ceil(k/2)`` largest get magnitude ``hi`` = the mean of their
magnitudes, the others ``lo`` = the mean of theirs (``lo = hi`` when k = 1): two levels per
sign, 2 bits per value. A chunk that holds a non-finite element has ``lo = hi = NaN``, so
receivers' finiteness checks reject it. Layout, all little-endian:

* every chunk's (lo, hi) as two fp32, in tensor then chunk order;
* the remainders' stream;
* the unary stream, zero-padded to the sum of every chunk's longest unary code (so the size
  depends on the shapes only, :func:`nbytes`);
* every kept entry's code, 2 bits each in the same entry order, packed as the remainders: bit
  0 the sign (1 = negative), bit 1 the level (1 = hi, 0 = lo); zero-padded to a byte.

Merged slice (a reducer's answer; :func:`encode_merged` / :func:`decode_merged`). The merge of
sparse contributions is supported on the union of their entries, so the answer lists its
nonzero entries per chunk, each as an int8 code of the chunk's absmax scale (as ``int8`` in
:mod:`p2pdiloco.net.codecs.wire`: ``s = absmax / 127`` in fp32, ``q = round(x / s)`` half to even,
entries whose code is 0 left out; a chunk with a non-finite element lists no entry and has a
NaN scale, which receivers refuse). Layout: every chunk's entry count as uint16, every chunk's
scale as fp32, the remainders' stream, the unary stream padded to a byte only, then one signed
byte per entry. Its size depends on the values; :func:`merged_max_nbytes` bounds it. Every
member decodes the same bytes, so the answer's own rounding is the same on every member
(invariant I1).

Every decoder checks the byte count against the shapes (and, for a merged slice, its counts:
at most the union of the round's contributions, :func:`merged_cap`, and its unary stream: at
most its chunks' longest codes, no byte past the last code) before it builds any tensor, and
refuses a unary stream that ends before its last entry, indices outside their chunk, nonzero
padding, and in a merged slice scales that are negative or not finite, codes never written
(0, -128) and values that overflow fp32: :class:`p2pdiloco.errors.ProtocolError`. Scales and
levels are not checked for the one form the encoder writes (a contribution's lo above hi, a
merged chunk's largest code under 127): such bytes decode like any others, the same on every
member, and a contribution's decoded values pass the receiver's checks as any contribution
does (``is_finite_contribution``, the robust merge).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch

from p2pdiloco.errors import ProtocolError

SPARSE_CHUNK = 4096  # elements per chunk
TOPK = 224  # entries kept of a full chunk (5.47%; 64 until wire version 13, 128 until 14: docs/benchmarks/codecs.md)
MAX_RICE = 12  # the largest Rice parameter: a gap within a chunk has at most 12 bits (SPARSE_CHUNK == 2 ** 12)
CODE_BITS = 2
assert SPARSE_CHUNK == 1 << MAX_RICE


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


def rice_parameter(m: np.ndarray, c: np.ndarray) -> np.ndarray:
    """r(m, c) of chunks of ``m`` elements listing ``c`` entries (int64 arrays of one shape):
    the r in 0..MAX_RICE minimising c (r + 1) + floor((m - c) / 2^r), the most bits the
    chunk's places can take (module docstring); ties to the smaller r; 0 where c = 0."""
    r = np.arange(MAX_RICE + 1)  # [R]
    longest = c[..., None] * (r + 1) + ((m - c)[..., None] >> r)  # [..., R]
    return np.where(c > 0, longest.argmin(axis=-1), 0).astype(np.int64)


def _unary_cap(m: np.ndarray, c: np.ndarray, r: np.ndarray) -> np.ndarray:
    """The most unary bits each chunk's places take: c + floor((m - c) / 2^r), 0 where c = 0."""
    return np.where(c > 0, c + ((m - c) >> r), 0)


def _stream_bytes(lengths: np.ndarray, counts: np.ndarray) -> tuple[int, int]:
    """(bytes of the remainders' stream, most bytes of the unary stream) of chunks of
    ``lengths`` listing ``counts`` entries (module docstring)."""
    r = rice_parameter(lengths, counts)
    return _packed_bytes(int((counts * r).sum()), 1), _packed_bytes(int(_unary_cap(lengths, counts, r).sum()), 1)


def _layout(shapes: Sequence[tuple[int, ...]]) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(numels, chunk lengths, kept entries per chunk) of a contribution of ``shapes``."""
    numels = [math.prod(s) for s in shapes]
    lengths = np.asarray(_chunk_lengths(numels), dtype=np.int64)
    return numels, lengths, np.asarray([kept(int(m)) for m in lengths], dtype=np.int64)


def nbytes(shapes: Sequence[tuple[int, ...]]) -> int:
    """Bytes of a contribution of tensors of ``shapes``."""
    _, lengths, counts = _layout(shapes)
    return 8 * len(lengths) + sum(_stream_bytes(lengths, counts)) + _packed_bytes(int(counts.sum()), CODE_BITS)


def merged_cap(m: int, members: int | None) -> int:
    """Entries a merged slice may list in a chunk of m elements: the union of ``members``
    contributions of k(m) entries each, at most m (None: m)."""
    return m if members is None else min(m, members * kept(m))


@functools.lru_cache(maxsize=256)
def _merged_chunk_bits(m: int, cap: int) -> int:
    """The most bits of places and codes a merged chunk of m elements and at most ``cap``
    entries can take: the largest c (r + 9) + floor((m - c) / 2^r) over c <= cap."""
    c = np.arange(cap + 1, dtype=np.int64)
    ms = np.full_like(c, m)
    r = rice_parameter(ms, c)
    return int((c * (r + 8) + _unary_cap(ms, c, r)).max())


def merged_max_nbytes(shapes: Sequence[tuple[int, ...]], members: int | None = None) -> int:
    """The most bytes a merged slice of tensors of ``shapes`` can take, merged from
    ``members`` contributions (None: every entry listed): 6 a chunk, every chunk's most bits
    of places and codes, and 2 bytes of padding (the two bit streams')."""
    lengths = _chunk_lengths([math.prod(s) for s in shapes])
    return 6 * len(lengths) + _packed_bytes(sum(_merged_chunk_bits(m, merged_cap(m, members)) for m in lengths), 1) + 2


# ---- bit streams --------------------------------------------------------------------------

def _pack(values: np.ndarray, widths: np.ndarray) -> bytes:
    """Unsigned ``values`` (each < 2 ** its width) as the module docstring's bit stream of
    fields of ``widths`` bits (int64 arrays of one length; widths may be 0)."""
    total = int(widths.sum())
    if total == 0:
        return b""
    start = np.repeat(np.cumsum(widths) - widths, widths)  # [total]: each bit's field start
    bits = (np.repeat(values, widths) >> (np.arange(total) - start)) & 1
    return np.packbits(bits.astype(np.uint8), bitorder="little").tobytes()


def _bits(data: bytes) -> np.ndarray:
    return np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")


def _unpack(data: bytes, widths: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_pack` (int64, one value per width; ``data`` exactly the stream's
    bytes); ProtocolError if a padding bit is set."""
    bits = _bits(data)
    total = int(widths.sum())
    if bits[total:].any():
        raise ProtocolError("nonzero padding bits")
    ends = np.cumsum(widths)
    weighted = bits[:total].astype(np.int64) << (np.arange(total) - np.repeat(ends - widths, widths))
    sums = np.concatenate([[0], np.cumsum(weighted)])
    return sums[ends] - sums[ends - widths]


def _encode_places(idx: np.ndarray, counts: np.ndarray, lengths: np.ndarray) -> tuple[bytes, bytes]:
    """(remainders' stream, unary stream padded to a byte) of entries at indices ``idx``
    (ascending within each chunk; chunks listing ``counts`` entries, of ``lengths``)."""
    if idx.size == 0:
        return b"", b""
    first = np.zeros(idx.size, dtype=bool)
    first[(np.cumsum(counts) - counts)[counts > 0]] = True  # each chunk's first entry
    gaps = idx - np.where(first, -1, np.concatenate([[0], idx[:-1]])) - 1  # [entries]
    r = np.repeat(rice_parameter(lengths, counts), counts)
    q = gaps >> r
    unary = np.ones(int(q.sum()) + idx.size, dtype=np.uint8)
    unary[np.cumsum(q + 1) - 1] = 0
    return _pack(gaps & ((1 << r) - 1), r), np.packbits(unary, bitorder="little").tobytes()


def _decode_places(remainders: bytes, unary: bytes, counts: np.ndarray, lengths: np.ndarray,
                   exact: bool) -> np.ndarray:
    """Indices within their chunks (int64 [entries], chunk order) from the two streams;
    ``exact``: ``unary`` must end in the byte of the last entry's 0 (a merged slice), else
    anything after it is padding. ProtocolError if the unary stream ends early, a padding bit
    is set, the stream runs past its last code, or an index is outside its chunk."""
    k = int(counts.sum())
    r = np.repeat(rice_parameter(lengths, counts), counts)
    rem = _unpack(remainders, r)
    bits = _bits(unary)
    ends = np.flatnonzero(bits == 0)[:k]  # [k]: each code's closing 0
    if ends.size < k:
        raise ProtocolError("the unary stream ends before its last entry")
    last = int(ends[-1]) + 1 if k else 0
    if bits[last:].any():
        raise ProtocolError("nonzero padding bits")
    if exact and len(unary) != _packed_bytes(last, 1):
        raise ProtocolError("the unary stream runs past its last entry")
    q = np.diff(np.concatenate([[-1], ends])) - 1
    steps = ((q << r) | rem) + 1  # [k]: gap + 1 = index - previous index
    before = np.concatenate([[0], np.cumsum(steps)])
    starts = np.repeat(np.cumsum(counts) - counts, counts)  # each entry's chunk's first entry
    idx = before[1:] - before[starts] - 1
    if k and (idx >= np.repeat(lengths, counts)).any():
        raise ProtocolError("index outside its chunk")
    return idx


def _le(array: np.ndarray) -> bytes:
    return array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()


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


def _mean(mag: torch.Tensor) -> torch.Tensor:
    """Row means of ``mag`` [r, n] in fp32, in fp64 where fp32's sum overflows (finite values of
    magnitude near fp32's largest; their mean is finite)."""
    mean = mag.mean(dim=1)
    over = torch.isinf(mean) & torch.isfinite(mag).all(dim=1)
    return torch.where(over, mag.double().mean(dim=1).float(), mean) if over.any() else mean


def _select(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scales fp32 [r, 2] as (lo, hi), indices int64 [r, k] ascending, codes int64 [r, k]) of
    the chunks ``rows`` [r, m] (module docstring)."""
    k = kept(rows.shape[1])
    order = torch.sort(rows.abs().neg(), dim=1, stable=True).indices[:, :k]  # largest first; ties: lower index
    picked = rows.gather(1, order)  # [r, k]
    mag = picked.abs()
    h = -(-k // 2)
    hi = _mean(mag[:, :h])
    lo = _mean(mag[:, h:]) if k > h else hi
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
    _, lengths, counts = _layout([tuple(t.shape) for t in tensors])
    remainders, unary = _encode_places(idx, counts, lengths)
    _, cap = _stream_bytes(lengths, counts)
    return (_le(scales.astype(np.float32)) + remainders + unary.ljust(cap, b"\0")
            + _pack(codes, np.full(codes.size, CODE_BITS)))


def decode(data: bytes, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """Inverse of :func:`encode`: fp32 tensors of ``shapes``, zero outside the kept entries.

    Raises:
        ProtocolError: the byte count does not match the shapes, the unary stream ends before
            its last entry, an index is outside its chunk, or a padding bit is set.
    """
    numels, lengths, counts = _layout(shapes)
    expected = nbytes(shapes)
    if len(data) != expected:
        raise ProtocolError(f"expected {expected} tensor bytes, got {len(data)}")
    k = int(counts.sum())
    at = 8 * len(lengths)
    scales = np.frombuffer(data, dtype="<f4", count=2 * len(lengths)).astype(np.float32).reshape(-1, 2)
    remainder_bytes, unary_bytes = _stream_bytes(lengths, counts)
    unary_at = at + remainder_bytes
    codes_at = unary_at + unary_bytes
    idx = _decode_places(data[at:unary_at], data[unary_at:codes_at], counts, lengths, exact=False)
    code = _unpack(data[codes_at:], np.full(k, CODE_BITS))
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
        q = q.masked_fill_(~torch.isfinite(scale)[:, None], 0)  # non-finite: no entry, the NaN scale refused
        q = q.masked_fill_((scale == 0)[:, None], 0)
        where = torch.nonzero(q)  # [entries, 2] (row, index), chunk then index order
        counts.append((q != 0).sum(dim=1))
        scales.append(scale)
        indices.append(where[:, 1])
        codes.append(q[where[:, 0], where[:, 1]].to(torch.int8))
    if not counts:
        return b""
    count = torch.cat(counts).numpy().astype(np.int64)
    lengths = np.asarray(_chunk_lengths([t.numel() for t in tensors]), dtype=np.int64)
    remainders, unary = _encode_places(torch.cat(indices).numpy(), count, lengths)
    return (_le(count.astype(np.uint16)) + _le(torch.cat(scales).numpy()) + remainders + unary
            + torch.cat(codes).numpy().tobytes())


def decode_merged(data: bytes, shapes: Sequence[tuple[int, ...]], members: int | None = None) -> list[torch.Tensor]:
    """Inverse of :func:`encode_merged`: fp32 tensors of ``shapes``, merged from ``members``
    contributions (None: any number).

    Raises:
        ProtocolError: a count exceeds what its chunk holds (:func:`merged_cap`), the byte
            count does not fit the counts, a scale is negative or not finite, a code is 0 or
            -128 (never written), the unary stream ends before its last entry or runs past it,
            an index is outside its chunk, or a padding bit is set.
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
    remainder_bytes, unary_most = _stream_bytes(lengths, counts)
    unary_at = 6 * c + remainder_bytes
    if not unary_at <= len(data) - k <= unary_at + unary_most:
        raise ProtocolError(f"expected {unary_at + k} to {unary_at + unary_most + k} tensor bytes, got {len(data)}")
    scales = np.frombuffer(data, dtype="<f4", count=c, offset=2 * c).astype(np.float32)
    if not (np.isfinite(scales) & (scales >= 0)).all():
        raise ProtocolError("a scale is negative or not finite")
    codes = np.frombuffer(data, dtype=np.int8, offset=len(data) - k) if k else np.zeros(0, np.int8)
    if ((codes == 0) | (codes == -128)).any():
        raise ProtocolError("a code of 0 or -128")
    idx = _decode_places(data[6 * c:unary_at], data[unary_at:len(data) - k], counts, lengths, exact=True)
    with np.errstate(over="ignore"):
        values = codes.astype(np.float32) * np.repeat(scales, counts)  # fp32
    if not np.isfinite(values).all():
        raise ProtocolError("a value overflows fp32")
    values = torch.from_numpy(values)
    flat = _scatter(numels, lengths, counts, idx, values)
    return [t.reshape(s) for t, s in zip(flat.split(numels), shapes)]
