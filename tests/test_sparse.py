"""The topk2 wire codec (p2pdiloco.net.sparse): bytes computed by hand, hostile bytes refused,
and error feedback carrying what a contribution leaves out into the next one."""

from __future__ import annotations

import struct

import pytest
import torch

from p2pdiloco.errors import ProtocolError
from p2pdiloco.net import sparse, wire


def bits(values: list[int], width: int) -> bytes:
    """The codec's bit stream of ``values``, computed as one little-endian integer."""
    n = sum(v << (width * i) for i, v in enumerate(values))
    return n.to_bytes(-(-len(values) * width // 8), "little")


def test_a_short_chunk_keeps_its_largest_entry_at_one_level() -> None:
    # 8 elements: k(8) = ceil(8 * 128 / 4096) = 1, so lo = hi = 3.0; index 1 in 12 bits; code
    # 3 (sign 1: negative, level 1: hi) in 2 bits.
    data = wire.encode([torch.tensor([0.5, -3.0, 1.0, 0.0, 2.0, 0.0, 0.0, 0.0])], "topk2")
    assert data == struct.pack("<2f", 3.0, 3.0) + bytes([0x01, 0x00]) + bytes([0x03])
    assert len(data) == wire.wire_nbytes([(8,)], "topk2") == 11
    (out,) = wire.decode(data, [(8,)], "topk2")
    assert out.dtype == torch.float32 and out.tolist() == [0.0, -3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_two_levels_ties_to_the_lower_index_and_codes_in_index_order() -> None:
    # 128 elements: k = ceil(128 * 128 / 4096) = 4. Magnitudes 4 (index 10), 2 (20), then three
    # 1s (30, 40, 50): the tie keeps 30 and 40. The 2 largest share hi = (4 + 2) / 2 = 3, the others lo = 1.
    x = torch.zeros(128)
    x[10], x[20], x[30], x[40], x[50], x[60] = 4.0, -2.0, 1.0, -1.0, 1.0, 0.5
    data = wire.encode([x], "topk2")
    codes = [0b10, 0b11, 0b00, 0b01]  # (level << 1) | sign for indices 10, 20, 30, 40
    assert data == struct.pack("<2f", 1.0, 3.0) + bits([10, 20, 30, 40], 12) + bits(codes, 2)
    assert bits(codes, 2) == bytes([0x4E])
    (out,) = wire.decode(data, [(128,)], "topk2")
    expected = torch.zeros(128)
    expected[10], expected[20], expected[30], expected[40] = 3.0, -3.0, 1.0, -1.0
    assert torch.equal(out, expected)


def test_chunks_of_4096_never_span_tensors_and_sizes_follow_the_shapes() -> None:
    # [2, 4100] = 8200 elements: chunks 4096, 4096, 8 -> k 128, 128, 1; then [3] -> k 1.
    # k(m) = ceil(m / 32): 4065 / 32 = 127.03 -> 128, 4064 / 32 = 127, 33 / 32 -> 2, 32 / 32 = 1.
    shapes = [(2, 4100), (3,)]
    k = 128 + 128 + 1 + 1
    assert [sparse.kept(m) for m in (4096, 4065, 4064, 33, 32, 1)] == [128, 128, 127, 2, 1, 1]
    assert wire.wire_nbytes(shapes, "topk2") == 4 * 8 + -(-k * 12 // 8) + -(-k * 2 // 8)
    x = torch.randn(2, 4100, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0.0, -5.0, 1.0])
    a, b = wire.decode(wire.encode([x, y], "topk2"), shapes, "topk2")
    flat = a.reshape(-1)
    assert [int((flat[s:s + 4096] != 0).sum()) for s in (0, 4096, 8192)] == [128, 128, 1]
    top = x.reshape(-1)[:4096].abs().topk(128).indices
    assert set(torch.nonzero(flat[:4096]).reshape(-1).tolist()) == set(top.tolist())
    assert b.tolist() == [0.0, -5.0, 0.0]


def test_a_non_finite_element_makes_its_chunk_non_finite() -> None:
    x = torch.ones(5000)
    x[4500] = float("nan")
    (out,) = wire.decode(wire.encode([x], "topk2"), [(5000,)], "topk2")
    assert torch.isfinite(out[:4096]).all() and not torch.isfinite(out[4096:]).all()


def test_the_merged_slice_lists_nonzero_int8_codes_per_chunk() -> None:
    # absmax 127 -> scale 1.0; codes 127, -4 (-3.5 half to even), 0.25 -> 0 is left out; the
    # second tensor is all zero: count 0, scale 0.
    data = wire.encode_merged([torch.tensor([0.0, 127.0, 0.0, -3.5, 0.25]), torch.zeros(3)], "topk2")
    assert data == (struct.pack("<2H", 2, 0) + struct.pack("<2f", 1.0, 0.0) + bits([1, 3], 12)
                    + bytes([0x7F, 0xFC]))
    a, b = wire.decode_merged(data, [(5,), (3,)], "topk2")
    assert a.tolist() == [0.0, 127.0, 0.0, -4.0, 0.0] and b.tolist() == [0.0, 0.0, 0.0]
    assert wire.merged_max_nbytes([(5,), (3,)], "topk2") == 2 * 6 + -(-8 * 12 // 8) + 8


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
    assert len(data) < wire.merged_max_nbytes(shapes, "topk2") / 10
    for m, back in zip(merged, wire.decode_merged(data, shapes, "topk2")):
        assert not (back[m == 0] != 0).any()  # no entry outside the union (an entry may round to 0)
        for s in range(0, m.numel(), 4096):
            chunk, got = m.reshape(-1)[s:s + 4096], back.reshape(-1)[s:s + 4096]
            assert (chunk - got).abs().max() <= chunk.abs().max() / 127 / 2 * (1 + 1e-6)


def hostile_cases() -> list[tuple[str, bytes, str]]:
    """(codec, bytes, error) for a [150] tensor: k = 5 (ceil(150 * 128 / 4096))."""
    ok = wire.encode([torch.arange(150.0)], "topk2")
    idx = list(range(145, 150))
    scales = ok[:8]
    cases = [
        ("contribution", ok[:-1], "expected 18 tensor bytes, got 17"),
        ("contribution", scales + bits([145, 146, 146, 148, 149], 12) + ok[16:], "not strictly ascending"),
        ("contribution", scales + bits([149, 148, 147, 146, 145], 12) + ok[16:], "not strictly ascending"),
        ("contribution", scales + bits(idx[:4] + [150], 12) + ok[16:], "outside its chunk"),
        ("contribution", ok[:-1] + bytes([ok[-1] | 0x80]), "padding"),
    ]
    good = wire.encode_merged([torch.arange(150.0)], "topk2")
    count = struct.unpack_from("<H", good)[0]
    codes_at = len(good) - count
    cases += [
        ("merged", good[:2] + struct.pack("<f", -1.0) + good[6:], "negative or not finite"),
        ("merged", good[:2] + struct.pack("<f", float("nan")) + good[6:], "negative or not finite"),
        ("merged", good[:codes_at] + b"\x00" + good[codes_at + 1:], "a code of 0 or -128"),
        ("merged", good[:codes_at] + b"\x80" + good[codes_at + 1:], "a code of 0 or -128"),
        ("merged", good[:-1], "expected"),
        ("merged", b"\x00", "expected at least 6"),
        ("merged", struct.pack("<H", 151) + good[2:], "more entries than its chunk"),
        ("merged", struct.pack("<H", count - 1) + good[2:], "expected"),
        ("merged", good[:6] + bits([1] * count, 12) + good[6 + -(-count * 12 // 8):], "not strictly ascending"),
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
    delivered per round tends to x although each round sends 3.1% of the entries."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    residual, sent = torch.zeros(4096), torch.zeros(4096)
    errors = []
    for t in range(1, 301):
        (got,) = wire.decode(wire.encode([x + residual], "topk2"), [(4096,)], "topk2")
        residual = x + residual - got
        sent += got
        assert torch.allclose(sent + residual, t * x, atol=1e-3 * t)  # nothing is lost, only delayed
        errors.append(float((sent / t - x).norm() / x.norm()))
    assert errors[0] > 0.85 and errors[-1] < 0.1 and errors[-1] < errors[99] < errors[9]


def test_a_merged_slice_lists_at_most_the_union_of_the_contributions() -> None:
    """A merged slice of M contributions holds at most M x k(m) entries a chunk: a reducer that
    lists more (a dense slice, say: each decoded entry costs memory) is refused, and the bound
    on the reply's size follows (``merged_max_nbytes`` with ``members``)."""
    dense = wire.encode_merged([torch.arange(128.0, 428.0)], "topk2")  # 300 entries; k(300) = 10
    assert len(wire.decode_merged(dense, [(300,)], "topk2")[0].nonzero()) == 300  # no bound: any number
    with pytest.raises(ProtocolError, match="more entries than its chunk holds"):
        wire.decode_merged(dense, [(300,)], "topk2", members=4)  # at most 4 x 10 = 40
    assert sparse.merged_cap(300, 4) == 40 and sparse.merged_cap(4096, 100) == 4096
    assert wire.merged_max_nbytes([(300,)], "topk2", members=4) == 6 + 60 + 40  # count, scale; 40 x 12 bits; 40 codes
    assert wire.merged_max_nbytes([(300,)], "int4", members=4) == wire.wire_nbytes([(300,)], "int4")
