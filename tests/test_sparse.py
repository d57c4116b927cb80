"""The topk2 wire codec (p2pdiloco.net.codecs.sparse): bytes computed by hand, hostile bytes refused,
and error feedback carrying what a contribution leaves out into the next one."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from p2pdiloco.errors import ProtocolError
from p2pdiloco.net.codecs import sparse, wire


def bits(values: list[int], width: int) -> bytes:
    """A bit stream of ``values``, ``width`` bits each, computed as one little-endian integer."""
    n = sum(v << (width * i) for i, v in enumerate(values))
    return n.to_bytes(-(-len(values) * width // 8), "little")


def test_the_rice_parameter_makes_a_chunks_longest_places_shortest() -> None:
    # r minimises c (r + 1) + floor((m - c) / 2^r), ties to the smaller r:
    # (4096, 128): r = 3: 512 + 496 = 1008; r = 4: 640 + 248 = 888; r = 5: 768 + 124 = 892.
    # (8, 1): r = 1: 2 + 3 = 5; r = 2: 3 + 1 = 4; r = 3: 4 + 0 = 4 (tie: 2).
    # (3, 1): r = 0, 1, 2 all cost 3 (tie: 0). (128, 4): r = 4: 20 + 7 = 27; r = 5: 24 + 3 = 27 (tie: 4).
    # (4096, 1): r = 11: 12 + 1 = 13; r = 12: 13 + 0 = 13 (tie: 11). (4096, 4096): r = 0: 4096.
    # (4096, 224), the codec's full chunk: r = 3: 896 + 484 = 1380; r = 4: 1120 + 242 = 1362; r = 5: 1344 + 121.
    m = np.array([4096, 8, 3, 128, 4096, 4096, 4096, 4096])
    c = np.array([128, 1, 1, 4, 1, 4096, 0, 224])
    assert sparse.rice_parameter(m, c).tolist() == [4, 2, 0, 4, 11, 0, 0, 4]


def test_a_short_chunk_keeps_its_largest_entry_at_one_level() -> None:
    # 8 elements: k(8) = ceil(8 * 224 / 4096) = 1, so lo = hi = 3.0. Index 1 at r(8, 1) = 2: the
    # remainder 1 in 2 bits, the quotient 0 as a lone 0 bit (unary cap 1 + floor(7 / 4) = 2
    # bits: one byte); code 3 (sign 1: negative, level 1: hi) in 2 bits.
    data = wire.encode([torch.tensor([0.5, -3.0, 1.0, 0.0, 2.0, 0.0, 0.0, 0.0])], "topk2")
    assert data == struct.pack("<2f", 3.0, 3.0) + bytes([0x01]) + bytes([0x00]) + bytes([0x03])
    assert len(data) == wire.wire_nbytes([(8,)], "topk2") == 11
    (out,) = wire.decode(data, [(8,)], "topk2")
    assert out.dtype == torch.float32 and out.tolist() == [0.0, -3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_two_levels_ties_to_the_lower_index_and_codes_in_index_order() -> None:
    # 64 elements: k = ceil(64 * 224 / 4096) = 4. Magnitudes 4 (index 10), 2 (20), then three
    # 1s (30, 40, 50): the tie keeps 30 and 40. The 2 largest share hi = (4 + 2) / 2 = 3, the others lo = 1.
    # r(64, 4) = 3 (4 x 4 + floor(60 / 8) = 23 bits; r = 4 ties, r = 2: 27): gaps 10, 9, 9, 9 are
    # remainders 2, 1, 1, 1 in 3 bits and quotients 1, 1, 1, 1, in unary 10 | 10 | 10 | 10 (8 bits
    # of a cap of 4 + 7 = 11: two bytes).
    x = torch.zeros(64)
    x[10], x[20], x[30], x[40], x[50], x[60] = 4.0, -2.0, 1.0, -1.0, 1.0, 0.5
    data = wire.encode([x], "topk2")
    codes = [0b10, 0b11, 0b00, 0b01]  # (level << 1) | sign for indices 10, 20, 30, 40
    assert data == struct.pack("<2f", 1.0, 3.0) + bits([2, 1, 1, 1], 3) + bytes([0x55, 0x00]) + bits(codes, 2)
    assert bits(codes, 2) == bytes([0x4E]) and bits([1, 0] * 4, 1) == bytes([0x55])
    (out,) = wire.decode(data, [(64,)], "topk2")
    expected = torch.zeros(64)
    expected[10], expected[20], expected[30], expected[40] = 3.0, -3.0, 1.0, -1.0
    assert torch.equal(out, expected)


def test_places_spread_to_the_chunks_end_fill_the_unary_cap_exactly() -> None:
    # 64 elements, entries at 0, 20, 21, 63: gaps 0, 19, 0, 41 (sum 60 = m - k). At r = 3:
    # remainders 0, 3, 0, 1; quotients 0, 2, 0, 5, in unary 0 | 110 | 0 | 111110: 11 bits, the cap.
    x = torch.zeros(64)
    x[0], x[20], x[21], x[63], x[40] = 4.0, -2.0, 1.0, -1.0, 0.5
    data = wire.encode([x], "topk2")
    unary = [0, 1, 1, 0, 0, 1, 1, 1, 1, 1, 0]
    assert data == (struct.pack("<2f", 1.0, 3.0) + bits([0, 3, 0, 1], 3) + bits(unary, 1)
                    + bits([0b10, 0b11, 0b00, 0b01], 2))
    assert bits(unary, 1) == bytes([0xE6, 0x03])
    (out,) = wire.decode(data, [(64,)], "topk2")
    assert torch.nonzero(out).reshape(-1).tolist() == [0, 20, 21, 63]


def test_chunks_of_4096_never_span_tensors_and_sizes_follow_the_shapes() -> None:
    # [2, 4100] = 8200 elements: chunks 4096, 4096, 8 -> k 224, 224, 1; then [3] -> k 1.
    # k(m) = ceil(7 m / 128): 4078 -> 223.02 -> 224, 4077 -> 222.96 -> 223, 19 -> 1.04 -> 2, 18 -> 0.98 -> 1.
    # r = 4, 4, 2, 0; unary caps 224 + floor(3872 / 16) = 466 (twice), 1 + floor(7 / 4) = 2, 1 + 2 = 3.
    shapes = [(2, 4100), (3,)]
    k = 224 + 224 + 1 + 1
    assert [sparse.kept(m) for m in (4096, 4078, 4077, 19, 18, 1)] == [224, 224, 223, 2, 1, 1]
    remainder_bits, unary_bits = 2 * 224 * 4 + 2 + 0, 2 * 466 + 2 + 3
    assert wire.wire_nbytes(shapes, "topk2") == 4 * 8 + -(-remainder_bits // 8) + -(-unary_bits // 8) + -(-k * 2 // 8)
    assert wire.wire_nbytes(shapes, "topk2") == 488  # 12-bit indices: 32 + 675 + 113 = 820
    x = torch.randn(2, 4100, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0.0, -5.0, 1.0])
    a, b = wire.decode(wire.encode([x, y], "topk2"), shapes, "topk2")
    flat = a.reshape(-1)
    assert [int((flat[s:s + 4096] != 0).sum()) for s in (0, 4096, 8192)] == [224, 224, 1]
    top = x.reshape(-1)[:4096].abs().topk(224).indices
    assert set(torch.nonzero(flat[:4096]).reshape(-1).tolist()) == set(top.tolist())
    assert b.tolist() == [0.0, -5.0, 0.0]


def test_a_non_finite_element_makes_its_chunk_non_finite() -> None:
    x = torch.ones(5000)
    x[4500] = float("nan")
    (out,) = wire.decode(wire.encode([x], "topk2"), [(5000,)], "topk2")
    assert torch.isfinite(out[:4096]).all() and not torch.isfinite(out[4096:]).all()


def test_the_merged_slice_lists_nonzero_int8_codes_per_chunk() -> None:
    # absmax 127 -> scale 1.0; codes 127, -4 (-3.5 half to even), 0.25 -> 0 is left out; the
    # second tensor is all zero: count 0, scale 0. Indices 1, 3 of 5 at r(5, 2) = 0 (5 = 2 + 3
    # and 4 + 1 bits; tie): no remainder bits, gaps 1, 1 in unary 10 | 10 = 0x05.
    data = wire.encode_merged([torch.tensor([0.0, 127.0, 0.0, -3.5, 0.25]), torch.zeros(3)], "topk2")
    assert data == (struct.pack("<2H", 2, 0) + struct.pack("<2f", 1.0, 0.0) + bits([1, 0, 1, 0], 1)
                    + bytes([0x7F, 0xFC]))
    a, b = wire.decode_merged(data, [(5,), (3,)], "topk2")
    assert a.tolist() == [0.0, 127.0, 0.0, -4.0, 0.0] and b.tolist() == [0.0, 0.0, 0.0]
    # the most: every entry listed, r = 0: 5 x 8 code bits + 5 unary bits, and 3 x 8 + 3; 2 bytes of padding
    assert wire.merged_max_nbytes([(5,), (3,)], "topk2") == 2 * 6 + -(-(45 + 27) // 8) + 2


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8", "int4"])
def test_dense_precisions_answer_in_their_own_encoding(precision: str) -> None:
    t = [torch.randn(300, generator=torch.Generator().manual_seed(1))]
    assert wire.encode_merged(t, precision) == wire.encode(t, precision)
    assert wire.merged_max_nbytes([(300,)], precision) == wire.wire_nbytes([(300,)], precision)


def test_the_union_of_sparse_contributions_round_trips_within_int8_rounding() -> None:
    g = torch.Generator().manual_seed(2)
    shapes = [(64, 80), (100,)]
    parts = [wire.decode(wire.encode([torch.randn(s, generator=g) for s in shapes], "topk2"), shapes, "topk2")
             for _ in range(3)]
    merged = [sum(p[i] for p in parts) / 3 for i in range(len(shapes))]
    data = wire.encode_merged(merged, "topk2")
    assert len(data) <= wire.merged_max_nbytes(shapes, "topk2", members=3) < wire.merged_max_nbytes(shapes, "topk2") / 4
    for m, back in zip(merged, wire.decode_merged(data, shapes, "topk2")):
        assert not (back[m == 0] != 0).any()  # no entry outside the union (an entry may round to 0)
        for s in range(0, m.numel(), 4096):
            chunk, got = m.reshape(-1)[s:s + 4096], back.reshape(-1)[s:s + 4096]
            assert (chunk - got).abs().max() <= chunk.abs().max() / 127 / 2 * (1 + 1e-6)


def hostile_cases() -> list[tuple[str, bytes, str]]:
    """(codec, bytes, error) for a [150] tensor. A contribution keeps k = 9 (ceil(150 * 224 /
    4096)) at r(150, 9) = 3 (9 x 4 + 17 = 53 bits at most; r = 4 ties): the entries 141..149 of
    arange(150) are gaps 141, 0, ..., 0, so remainders 5, 0, ..., 0 (27 bits: 4 bytes) and
    quotients 17, 0, ..., 0 (unary seventeen 1s, then nine 0s: 26 bits, the cap; 4 bytes); 18
    code bits (3 bytes). Strictly ascending places need no check: every gap is at least 0."""
    ok = wire.encode([torch.arange(150.0)], "topk2")
    head, remainders, unary, codes = ok[:8], ok[8:12], ok[12:16], ok[16:]
    assert remainders == bits([5] + [0] * 8, 3) and unary == bytes([0xFF, 0xFF, 0x01, 0x00]) and len(ok) == 19
    cases = [
        ("contribution", ok[:-1], "expected 19 tensor bytes, got 18"),
        ("contribution", head + remainders + bytes([0xFF] * 4) + codes, "ends before its last entry"),
        ("contribution", head + remainders + bytes([0xFF, 0xFF, 0x03, 0x00]) + codes, "outside its chunk"),  # 18 x 8 + 5
        ("contribution", head + remainders + bytes([0xFF, 0xFF, 0x01, 0x80]) + codes, "padding"),  # past the 9th 0
        ("contribution", head + ok[8:11] + bytes([ok[11] | 0x80]) + unary + codes, "padding"),  # bit 31 of 27
        ("contribution", ok[:-1] + bytes([ok[-1] | 0x80]), "padding"),
    ]
    # The merged slice lists 1..149 (code round(i * 127 / 149) != 0 for i >= 1): 149 entries
    # at r(150, 149) = 0, gaps 1, 0, ..., 0 in unary 10 0...0: 150 bits (19 bytes), then 149 codes.
    good = wire.encode_merged([torch.arange(150.0)], "topk2")
    count = struct.unpack_from("<H", good)[0]
    codes_at = len(good) - count
    assert count == 149 and codes_at == 6 + 19
    cases += [
        ("merged", good[:2] + struct.pack("<f", -1.0) + good[6:], "negative or not finite"),
        ("merged", good[:2] + struct.pack("<f", float("nan")) + good[6:], "negative or not finite"),
        ("merged", good[:codes_at] + b"\x00" + good[codes_at + 1:], "a code of 0 or -128"),
        ("merged", good[:codes_at] + b"\x80" + good[codes_at + 1:], "a code of 0 or -128"),
        ("merged", good[:-30], "expected 155 to 174 tensor bytes, got 144"),
        ("merged", good[:codes_at] + b"\x00" + good[codes_at:], "expected 155 to 174 tensor bytes, got 175"),
        ("merged", b"\x00", "expected at least 6"),
        ("merged", struct.pack("<H", 151) + good[2:], "more entries than its chunk"),
        ("merged", struct.pack("<H", count - 1) + good[2:], "expected"),
        ("merged", good[:6] + b"\xff" * 19 + good[codes_at:], "ends before its last entry"),
    ]
    return cases


@pytest.mark.parametrize("codec, data, error", hostile_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_hostile_bytes_are_refused(codec: str, data: bytes, error: str) -> None:
    decode = wire.decode if codec == "contribution" else wire.decode_merged
    with pytest.raises(ProtocolError, match=error):
        decode(data, [(150,)], "topk2")


def test_error_feedback_delivers_a_constant_pseudo_gradient_over_rounds() -> None:
    """Sending x every round with the residual added back (RoundResult.residual): after T
    rounds the decoded sum is T x minus the last residual, which stays bounded, so the mean
    delivered per round tends to x although each round sends 5.5% of the entries."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    residual, sent = torch.zeros(4096), torch.zeros(4096)
    errors = []
    for t in range(1, 301):
        (got,) = wire.decode(wire.encode([x + residual], "topk2"), [(4096,)], "topk2")
        residual = x + residual - got
        sent += got
        assert torch.allclose(sent + residual, t * x, atol=1e-3 * t)  # nothing is lost, only delayed
        errors.append(float((sent / t - x).norm() / x.norm()))
    assert errors[0] > 0.8 and errors[-1] < 0.1 and errors[-1] < errors[99] < errors[9]


def test_a_merged_slice_lists_at_most_the_union_of_the_contributions() -> None:
    """A merged slice of M contributions holds at most M x k(m) entries a chunk: a reducer that
    lists more (a dense slice, say: each decoded entry costs memory) is refused, and the bound
    on the reply's size follows (``merged_max_nbytes`` with ``members``)."""
    dense = wire.encode_merged([torch.arange(128.0, 428.0)], "topk2")  # 300 entries; k(300) = 17
    assert len(wire.decode_merged(dense, [(300,)], "topk2")[0].nonzero()) == 300  # no bound: any number
    with pytest.raises(ProtocolError, match="more entries than its chunk holds"):
        wire.decode_merged(dense, [(300,)], "topk2", members=4)  # at most 4 x 17 = 68
    assert sparse.merged_cap(300, 4) == 68 and sparse.merged_cap(4096, 100) == 4096
    # count and scale; at c = 68, r(300, 68) = 1 (136 + 116 = 252 bits; r = 2: 204 + 58): 68 x (1 + 8)
    # remainder and code bits and at most 68 + 116 unary bits, 796 bits; fewer entries take fewer
    # (c = 67: 786, c = 50 at r = 2: 612); 2 bytes of padding
    assert wire.merged_max_nbytes([(300,)], "topk2", members=4) == 6 + -(-796 // 8) + 2 == 108
    assert wire.merged_max_nbytes([(300,)], "int4", members=4) == wire.wire_nbytes([(300,)], "int4")


def test_a_merged_unary_stream_with_a_byte_past_its_last_entry_is_refused() -> None:
    """A merged slice's unary stream ends in the byte of its last entry, so a reducer cannot
    pad its answer. 128 entries at every 32nd place of 4096: r(4096, 128) = 4, gaps 31 =
    remainder 15 and quotient 1 (unary 10): 256 bits, 32 bytes, against a cap of 376 bits (47
    bytes), so one more zero byte still fits the size bounds."""
    x = torch.zeros(4096)
    x[31::32] = 1.0
    good = wire.encode_merged([x], "topk2")
    unary_at = 6 + 128 * 4 // 8
    assert good[6:unary_at] == bits([15] * 128, 4) and good[unary_at:unary_at + 32] == bits([1, 0] * 128, 1)
    assert torch.equal(wire.decode_merged(good, [(4096,)], "topk2", members=1)[0], x)
    padded = good[:unary_at + 32] + b"\x00" + good[unary_at + 32:]
    with pytest.raises(ProtocolError, match="runs past its last entry"):
        wire.decode_merged(padded, [(4096,)], "topk2", members=1)


def test_magnitudes_near_fp32s_largest_stay_finite_and_non_finite_merges_list_nothing() -> None:
    """Two entries of 2e38: their fp32 sum overflows, so the level is their mean taken in fp64,
    2e38, not inf (which would get an honest sender banned as non-finite). A merged chunk with
    a NaN lists no entry (its NaN scale is refused), so its slice stays within the bound; a
    finite scale whose code overflows fp32 (3e36 x 127) is refused, not decoded to inf."""
    y = torch.zeros(64)
    y[0] = y[1] = 2e38
    (out,) = wire.decode(wire.encode([y], "topk2"), [(64,)], "topk2")
    assert out[:2].tolist() == [torch.tensor(2e38).item()] * 2 and torch.isfinite(out).all()
    z = torch.zeros(4096)
    z[5] = float("nan")
    nan_slice = wire.encode_merged([z], "topk2")
    assert nan_slice[:2] == struct.pack("<H", 0) and len(nan_slice) == 6
    assert len(nan_slice) <= wire.merged_max_nbytes([(4096,)], "topk2", members=1)
    with pytest.raises(ProtocolError, match="negative or not finite"):
        wire.decode_merged(nan_slice, [(4096,)], "topk2", members=1)
    overflow = struct.pack("<Hf", 1, 3e36) + b"\x00" + b"\x00" + struct.pack("b", 127)  # index 0 of 8 at r = 2
    with pytest.raises(ProtocolError, match="overflows fp32"):
        wire.decode_merged(overflow, [(8,)], "topk2", members=1)
