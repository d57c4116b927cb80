"""Wire encoding, swarm records (heads), address checks and the grace window."""

from __future__ import annotations

import socket
import struct

import pytest
import torch

from p2pdiloco.core.grace import Ema, GraceWindow
from p2pdiloco.core.outer import FragmentState
from p2pdiloco.errors import AddressError, NetworkError, ProtocolError
from p2pdiloco.net.codecs import wire
from p2pdiloco.net.transport.addresses import (
    check_announce_maddr,
    check_any_reachable,
    check_listen_port,
    check_peer_maddr,
)
from p2pdiloco.net.state.heads import Head, is_behind, newest_heads

# A valid peer ID: base58 of the sha2-256 multihash of b"p2pdiloco-test".
PID = "QmV6bPa3xB8gg5YhjHnmHBCvVpymShB3aaPJmsvxWoq5LB"
ED_PID = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"  # an Ed25519 (identity multihash) one
EXAMPLE = "for example /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW..."


# ---- wire ----------------------------------------------------------------------------------

def test_fp32_bytes_and_round_trip() -> None:
    a = torch.tensor([[1.0, -2.5], [0.1, 3.0]])
    b = torch.tensor([1e-30])
    data = wire.encode([a, b], "fp32")
    assert data == struct.pack("<5f", 1.0, -2.5, 0.1, 3.0, 1e-30)
    out = wire.decode(data, [(2, 2), (1,)], "fp32")
    assert [t.shape for t in out] == [torch.Size([2, 2]), torch.Size([1])]
    assert all(t.dtype == torch.float32 for t in out)
    assert torch.equal(out[0], a) and torch.equal(out[1], b)


def test_fp16_rounds_to_nearest() -> None:
    # 0.1 = 1.6 * 2**-4; 10 mantissa bits: round(0.6 * 1024) = 614 -> 0x2E66 = 1638 / 16384.
    # 1/3 = 1.333.. * 2**-2: round(0.333.. * 1024) = 341 -> 0x3555 = 1365 / 4096.
    data = wire.encode([torch.tensor([1.0, -2.0, 0.1, 1 / 3])], "fp16")
    assert data == bytes.fromhex("003c" "00c0" "662e" "5535")
    (out,) = wire.decode(data, [(4,)], "fp16")
    assert out.tolist() == [1.0, -2.0, 1638 / 16384, 1365 / 4096]
    assert out.dtype == torch.float32


def test_fp16_overflow_becomes_inf_so_the_finiteness_check_rejects_it() -> None:
    (out,) = wire.decode(wire.encode([torch.tensor([65504.0, 70000.0])], "fp16"), [(2,)], "fp16")
    assert out[0].item() == 65504.0 and out[1].item() == float("inf")


def test_bf16_rounds_to_nearest() -> None:
    # bf16 keeps the top 16 bits of fp32, rounded: 0.1 = 0x3DCCCCCD -> 0x3DCD = 0.10009765625;
    # 1/3 = 0x3EAAAAAB -> 0x3EAB = 0.333984375; 1.0 = 0x3F80; -2.0 = 0xC000.
    data = wire.encode([torch.tensor([1.0, -2.0]), torch.tensor([[0.1], [1 / 3]])], "bf16")
    assert data == bytes.fromhex("803f" "00c0" "cd3d" "ab3e")
    first, second = wire.decode(data, [(2,), (2, 1)], "bf16")
    assert first.tolist() == [1.0, -2.0]
    assert second.flatten().tolist() == [0.10009765625, 0.333984375]


# 7 elements: floats 7 x itemsize; int8 2 scales (one chunk per tensor) + 7 codes; int4 2
# scales + 4 bytes of nibbles
@pytest.mark.parametrize("precision, nbytes, item", [("fp32", 28, 4), ("fp16", 14, 2), ("bf16", 14, 2),
                                                     ("int8", 15, 1), ("int4", 12, 1)])
def test_truncated_or_padded_bytes_raise_protocol_error(precision: str, nbytes: int, item: int) -> None:
    data = wire.encode([torch.ones(3), torch.ones(2, 2)], precision)
    assert len(data) == nbytes == wire.wire_nbytes([(3,), (2, 2)], precision)
    for bad in (data[:-1], data[:-item], b"", data + b"\x00"):
        with pytest.raises(ProtocolError) as e:
            wire.decode(bad, [(3,), (2, 2)], precision)
        assert str(e.value) == f"expected {nbytes} tensor bytes, got {len(bad)}"


def test_empty_and_zero_size_tensors() -> None:
    assert wire.encode([], "fp16") == b""
    assert wire.decode(b"", [], "fp16") == []
    out = wire.decode(wire.encode([torch.ones(0, 3)], "fp32"), [(0, 3)], "fp32")
    assert len(out) == 1 and out[0].shape == (0, 3)
    a, b = wire.decode(wire.encode([torch.ones(0), torch.full((2,), 2.0)], "fp32"), [(0,), (2,)], "fp32")
    assert a.shape == (0,) and b.tolist() == [2.0, 2.0]


def test_unknown_precision() -> None:
    with pytest.raises(ValueError, match=r"unknown wire precision 'int2'; choose one of "
                                         r"\['bf16', 'fp16', 'fp32', 'int4', 'int8', 'topk2'\]"):
        wire.encode([torch.ones(1)], "int2")


# int8 / int4: per-chunk absmax scale (fp32), round half to even, codes clamped to [-L, L]

def test_int8_bytes_and_exact_round_trip() -> None:
    # absmax 127 -> scale 1.0: codes are round(x): -3.4 -> -3, 0.5 -> 0 and 2.5 -> 2 (half to
    # even), 1.5 -> 2; an all-zero tensor gets scale 0 and codes 0.
    a = torch.tensor([127.0, -3.4, 0.5, 1.5, 2.5, -127.0])
    data = wire.encode([a, torch.zeros(2)], "int8")
    assert data == struct.pack("<2f", 1.0, 0.0) + bytes.fromhex("7ffd00020281" "0000")
    assert len(data) == wire.wire_nbytes([(6,), (2,)], "int8") == 2 * 4 + 8
    out, zero = wire.decode(data, [(6,), (2,)], "int8")
    assert out.dtype == torch.float32 and out.tolist() == [127.0, -3.0, 0.0, 2.0, 2.0, -127.0]
    assert zero.tolist() == [0.0, 0.0]


def test_int4_bytes_nibble_order_and_exact_round_trip() -> None:
    # absmax 7 -> scale 1.0; codes 7, -7, 4 (3.5, half to even), 0 (-0.5), 1; two per byte,
    # even index in the low nibble, two's complement (-7 = 0x9), odd count padded with 0.
    data = wire.encode([torch.tensor([7.0, -7.0, 3.5, -0.5, 1.0])], "int4")
    assert data == struct.pack("<f", 1.0) + bytes([0x97, 0x04, 0x01])
    assert len(data) == wire.wire_nbytes([(5,)], "int4") == 4 + 3
    (out,) = wire.decode(data, [(5,)], "int4")
    assert out.dtype == torch.float32 and out.tolist() == [7.0, -7.0, 4.0, 0.0, 1.0]


@pytest.mark.parametrize("precision, levels", [("int8", 127), ("int4", 7)])
def test_chunks_have_their_own_scale_and_never_span_tensors(precision: str, levels: int) -> None:
    # A [2, 150] tensor is 300 elements: chunk 0 (256 elements) holds multiples of 2 up to
    # 2 * L, chunk 1 (44) multiples of 0.25 up to 0.25 * L: scales 2.0 and 0.25 exactly, so
    # every value is a code times its scale and comes back bit-exact. The next tensor starts
    # a chunk of its own (scale 0.5).
    assert wire.CHUNK == 256
    first = torch.cat([2.0 * (torch.arange(256) % (2 * levels + 1) - levels),
                       0.25 * (torch.arange(44) % (2 * levels + 1) - levels)]).view(2, 150)
    second = torch.tensor([0.5 * levels, -0.5])
    data = wire.encode([first, second], precision)
    assert data[:12] == struct.pack("<3f", 2.0, 0.25, 0.5)
    assert len(data) == wire.wire_nbytes([(2, 150), (2,)], precision)
    a, b = wire.decode(data, [(2, 150), (2,)], precision)
    assert torch.equal(a, first) and torch.equal(b, second)


@pytest.mark.parametrize("precision, levels", [("int8", 127), ("int4", 7)])
def test_quantization_error_is_at_most_half_a_step(precision: str, levels: int) -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 10, 1000)
    (y,) = wire.decode(wire.encode([x], precision), [(1000,)], precision)
    for k in range(0, 1000, wire.CHUNK):
        chunk, back = x[k:k + wire.CHUNK], y[k:k + wire.CHUNK]
        step = chunk.abs().max() / levels
        assert (chunk - back).abs().max() <= step / 2 * (1 + 1e-6)
        assert back.abs().max().item() == pytest.approx(chunk.abs().max().item(), rel=1e-6)  # absmax kept


def test_quantized_sizes() -> None:
    shapes = [(1024,), (3, 100), (0, 4)]  # chunks: 4 + 2 + 0
    assert wire.wire_nbytes(shapes, "fp32") == 1324 * 4
    assert wire.wire_nbytes(shapes, "int8") == 6 * 4 + 1324
    assert wire.wire_nbytes(shapes, "int4") == 6 * 4 + 662
    assert wire.wire_nbytes([(3,)], "int4") == 4 + 2


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_non_finite_values_stay_non_finite_in_their_chunk(precision: str) -> None:
    x = torch.ones(600)
    x[10], x[300] = float("nan"), float("inf")
    (y,) = wire.decode(wire.encode([x], precision), [(600,)], precision)
    assert not torch.isfinite(y[:256]).any()  # the NaN's chunk: scale NaN
    assert not torch.isfinite(y[256:512]).any()  # the inf's chunk: scale inf (0 * inf = NaN)
    assert torch.equal(y[512:], torch.ones(88))


def test_quantized_empty_and_zero_size_tensors() -> None:
    assert wire.encode([], "int4") == b""
    assert wire.decode(b"", [], "int8") == []
    a, b = wire.decode(wire.encode([torch.ones(0), torch.full((2,), 2.0)], "int4"), [(0,), (2,)], "int4")
    assert a.shape == (0,) and b.tolist() == [2.0, 2.0]
    (z,) = wire.decode(wire.encode([torch.ones(0, 3)], "int8"), [(0, 3)], "int8")
    assert z.shape == (0, 3)


def test_byte_swap_helper() -> None:
    assert wire._swap(bytes.fromhex("0102" "0304"), 2) == bytes.fromhex("0201" "0403")
    assert wire._swap(bytes.fromhex("01020304"), 4) == bytes.fromhex("04030201")


# ---- records: newest heads and is_behind ---------------------------------------------------

D1, D2, D3 = "1" * 64, "2" * 64, "3" * 64  # sha256 hex digests have one length ...
W1, W2, W3 = (bytes.fromhex(d) for d in (D1, D2, D3))  # ... and are 32 bytes on the wire


def test_highest_version_wins_even_with_fewer_holders() -> None:
    records = {"A": {"f": [[3, W2], [1, W1]]}, "B": {"f": [[2, W1], [1, W1]]}, "C": {"f": [[2, W1], [0, W3]]}}
    assert newest_heads(records, 2) == [Head(3, D2, ("A",)), Head(1, D1, ("A", "B"))]


def test_equal_version_more_holders_wins() -> None:
    records = {"A": {"f": [[5, W1]]}, "B": {"f": [[5, W2]]}, "C": {"f": [[5, W2]]}}
    assert newest_heads(records, 1) == [Head(5, D2, ("B", "C"))]


def test_equal_version_and_holders_smaller_digest_wins() -> None:
    records = {"A": {"f": [[5, W2]]}, "B": {"f": [[5, W1]]}}
    assert newest_heads(records, 1) == [Head(5, D1, ("B",))]
    assert newest_heads(dict(reversed(records.items())), 1) == [Head(5, D1, ("B",))]  # order-independent


def test_malformed_records_are_ignored() -> None:
    records = {
        "good": {"f": [[1, W1], [2, W2]], "t": 0.0, "step": 10},
        "not-a-dict": [[9, W3], [9, W3]],
        "no-f": {"x": [[9, W3], [9, W3]]},
        "f-not-list": {"f": "9"},
        "wrong-count": {"f": [[9, W3]]},
        "bad-items": {"f": [[9], ["9", W3]]},
        "half-bad": {"f": [[9, 3], [4, W3]]},  # one bad entry: the whole record is dropped
        "huge-version": {"f": [[2**63, W3], [2**63, W3]]},
        "inf-version": {"f": [[float("inf"), W3], [4, W3]]},
        "hex-digest": {"f": [[9, D3], [9, D3]]},  # the node's own form, not the wire's
        "short-digest": {"f": [[9, W3[:31]], [9, W3]]},
    }
    assert newest_heads(records, 2) == [Head(1, D1, ("good",)), Head(2, D2, ("good",))]


def test_no_records() -> None:
    assert newest_heads({}, 3) == [None, None, None]


def test_is_behind() -> None:
    mine = FragmentState.create(0, 2, [torch.zeros(2)], [torch.zeros(2)])
    other = FragmentState.create(0, 2, [torch.ones(2)], [torch.zeros(2)])
    assert not is_behind(mine, None)
    assert not is_behind(mine, Head(2, mine.digest, ("A",)))
    assert is_behind(mine, Head(2, other.digest, ("A",)))  # split brain at my version: follow the winner
    assert is_behind(mine, Head(3, "f" * 64, ("A",)))
    assert not is_behind(mine, Head(1, "f" * 64, ("A",)))


# ---- addresses -----------------------------------------------------------------------------

@pytest.mark.parametrize("maddr", [
    f"/ip4/127.0.0.1/tcp/31337/p2p/{PID}",
    f"/ip4/203.0.113.5/tcp/1/p2p/{ED_PID}",
    f"/ip6/::1/tcp/4001/p2p/{PID}",
    f"/dns4/boot.example.org/tcp/4001/p2p/{PID}",
    f"/ip4/10.0.0.1/udp/4001/quic-v1/p2p/{PID}",
])
def test_good_peer_maddrs(maddr: str) -> None:
    assert check_peer_maddr(maddr) == maddr


@pytest.mark.parametrize("maddr, message", [
    ("", "initial peer: empty multiaddr"),
    (f"/ip4/127.0.0.1/tcp/5 /p2p/{PID}", "initial peer '{m}': multiaddrs contain no spaces "
                                         "(use one flag or comma per address)"),
    (f"ip4/127.0.0.1/tcp/5/p2p/{PID}", f"initial peer '{{m}}': a multiaddr starts with '/', {EXAMPLE}"),
    (f"/http/127.0.0.1/tcp/5/p2p/{PID}", "initial peer '{m}': /http is not a host protocol; a multiaddr starts "
                                         f"with one of /ip4, /ip6, /dns, /dns4, /dns6, {EXAMPLE}"),
    (f"/ip4/127.0.0.1/sctp/5/p2p/{PID}", "initial peer '{m}': needs a /tcp/PORT or /udp/PORT/quic-v1 part"),
    (f"/ip4/127.0.0.1/tcp/5/tls/p2p/{PID}/x", "initial peer '{m}' is not a valid multiaddr: "
                                              "protocol x: Unknown Protocol"),
    ("/ip4/127.0.0.1/tcp/5", "initial peer '{m}': missing the /p2p/PEER_ID part (copy the whole address "
                             f"the bootstrap peer printed, {EXAMPLE})"),
    (f"/ip4/127.0.0.1/tcp/0/p2p/{PID}", "initial peer '{m}': port 0 cannot be dialed; give the real port"),
    (f"/ip4/127.0.0.1/tcp/70000/p2p/{PID}", "initial peer '{m}': /tcp/ needs a port number in 1..65535, "
                                            "got '70000'"),
    (f"/ip4/127.0.0.1/tcp/http/p2p/{PID}", "initial peer '{m}': /tcp/ needs a port number in 1..65535, "
                                           "got 'http'"),
    ("/ip4/127.0.0.1/tcp/5/p2p/notapeerid", "initial peer '{m}': 'notapeerid' after /p2p/ is not a valid peer ID "
                                            f"(copy the whole address the bootstrap peer printed, {EXAMPLE})"),
    (f"/ip4/127.0.0.1/tcp/5/p2p/{PID[:-3]}", f"initial peer '{{m}}': '{PID[:-3]}' after /p2p/ is not a valid "
                                             f"peer ID (copy the whole address the bootstrap peer printed, {EXAMPLE})"),
    (f"/ip4/999.1.1.1/tcp/5/p2p/{PID}", "initial peer '{m}': '999.1.1.1' is not an IPv4 address"),
    (f"/ip4/0.0.0.0/tcp/5/p2p/{PID}", "initial peer '{m}': 0.0.0.0 means 'every interface' and cannot be dialed; "
                                      "give this machine's real IP address"),
    (f"/ip4/127.0.0.1/p2p/{PID}", "initial peer '{m}': needs a /tcp/PORT or /udp/PORT/quic-v1 part"),
])
def test_malformed_peer_maddrs(maddr: str, message: str) -> None:
    with pytest.raises(AddressError) as e:
        check_peer_maddr(maddr)
    assert str(e.value) == message.replace("{m}", maddr)


def test_announce_maddrs() -> None:
    assert check_announce_maddr("/ip4/203.0.113.5/tcp/4001") == "/ip4/203.0.113.5/tcp/4001"
    assert check_announce_maddr(f"/ip4/203.0.113.5/tcp/4001/p2p/{PID}").endswith(PID)
    with pytest.raises(AddressError) as e:
        check_announce_maddr("/ip4/203.0.113.5/tcp/0")
    assert str(e.value) == "announce address '/ip4/203.0.113.5/tcp/0': port 0 cannot be dialed; give the real port"
    with pytest.raises(AddressError) as e:
        check_announce_maddr("/dns4/boot.example.org")
    assert str(e.value) == "announce address '/dns4/boot.example.org': needs a /tcp/PORT or /udp/PORT/quic-v1 part"
    with pytest.raises(AddressError) as e:
        check_announce_maddr("/dns4")
    assert str(e.value) == f"announce address '/dns4': /dns4 needs a host after it, {EXAMPLE}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_listen_port_check() -> None:
    check_listen_port("127.0.0.1", 0)
    check_listen_port("127.0.0.1", _free_port())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(NetworkError) as e:
            check_listen_port("127.0.0.1", port)
        assert str(e.value) == (f"port {port} on 127.0.0.1 is already in use (another bootstrap peer or node?); "
                                "choose another --port, or --port 0 for any free port")
    with pytest.raises(NetworkError, match=r"^cannot listen on 203.0.113.5: not an address of this machine"):
        check_listen_port("203.0.113.5", 4001)


def test_reachability_check() -> None:
    closed = f"/ip4/127.0.0.1/tcp/{_free_port()}/p2p/{PID}"
    with pytest.raises(NetworkError) as e:
        check_any_reachable([closed], timeout=2)
    assert str(e.value) == (f"none of the initial peers is reachable ({closed}: Connection refused); check the "
                            "addresses, or to start a new swarm instead, run `p2pdiloco bootstrap` and pass the "
                            "multiaddr it prints to --initial-peers")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        open_ = f"/ip4/127.0.0.1/tcp/{s.getsockname()[1]}/p2p/{PID}"
        check_any_reachable([closed, open_], timeout=2)  # one reachable peer is enough
    check_any_reachable([])  # nothing to check: a node may start a swarm alone
    check_any_reachable([closed, f"/ip4/127.0.0.1/udp/4001/quic-v1/p2p/{PID}"])  # QUIC cannot be probed


# ---- grace window --------------------------------------------------------------------------

def test_ema_hand_computed() -> None:
    ema = Ema(alpha=0.25)
    assert ema.value is None
    assert ema.update(1.0) == 1.0  # first sample taken as is
    assert ema.update(2.0) == 1.25  # 0.75 * 1 + 0.25 * 2
    assert ema.update(0.0) == 0.9375  # 0.75 * 1.25
    default = Ema()
    default.update(1.0)
    assert default.update(2.0) == pytest.approx(1.2, abs=1e-15)  # alpha 0.2
    with pytest.raises(ValueError, match="a duration cannot be negative, got -1"):
        ema.update(-1)


def test_grace_window_formula_and_clamping() -> None:
    g = GraceWindow(tau=2, gamma=0.5, minimum=0.5, maximum=5.0)
    assert g.seconds() == 0.5  # no step time yet: the minimum
    g.t_step.update(3.0)
    assert g.seconds() == 3.0  # 0.5 * (2 * 3)
    g.t_quorum.update(1.0)
    assert g.seconds() == 2.5  # 0.5 * (6 - 1)
    g.t_sync.update(0.5)
    assert g.seconds() == 2.25  # 0.5 * (6 - 1 - 0.5)
    g.t_step.update(23.0)  # EMA 0.8 * 3 + 0.2 * 23 = 7: 0.5 * (14 - 1.5) = 6.25, clamped
    assert g.t_step.value == pytest.approx(7.0, abs=1e-12)
    assert g.seconds() == 5.0
    g.t_quorum.update(81.0)  # EMA 0.8 * 1 + 0.2 * 81 = 17: slack 14 - 17 - 0.5 < 0, clamped
    assert g.seconds() == 0.5


def test_grace_window_tau_zero_gives_minimum() -> None:
    g = GraceWindow(tau=0, gamma=0.9, minimum=0.25, maximum=1.0)
    g.t_step.update(10.0)
    assert g.seconds() == 0.25


@pytest.mark.parametrize("kwargs, message", [
    ({"tau": 2, "gamma": 1.0}, "gamma must be in (0, 1), got 1.0"),
    ({"tau": 2, "minimum": 2.0, "maximum": 1.0}, "need 0 <= minimum <= maximum, got 2.0, 1.0"),
    ({"tau": -1}, "tau must be >= 0, got -1"),
])
def test_grace_window_refuses_bad_parameters(kwargs, message) -> None:
    with pytest.raises(ValueError) as e:
        GraceWindow(**kwargs)
    assert str(e.value) == message
