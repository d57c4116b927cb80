"""Wire and record fuzzer: every decoder of peer input gets 10,000 hostile inputs.

Inputs are mutations of a valid value (fields dropped, swapped for other types, numbers
replaced by infinities, NaN, 2**63, negatives, strings and lists grown to thousands of
entries, maps nested deep) and random bytes decoded with msgpack, from a fixed seed. Each
decoder may raise only the error its docstring names (``ProtocolError`` for records and
messages, ``CertificateError`` for certificates and revocation lists); anything else,
a call slower than ``SLOW_S`` (a hang), or more than ``PEAK_BYTES`` of memory allocated at
once fails the test.
"""

from __future__ import annotations

import math
import random
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from p2pdiloco.errors import ProtocolError
from p2pdiloco.net.records import parse as rec
from p2pdiloco.net.rounds import reduce_messages as rm
from p2pdiloco.net.codecs import wire
from p2pdiloco.trust.certificates import Certificate, RevocationList, SwarmKey
from p2pdiloco.trust.errors import CertificateError
from p2pdiloco.trust.identity import Identity

N = 10_000
SLOW_S = 1.0  # seconds of this thread's CPU per decode (tracemalloc on): far below a pathological case, above a loaded machine's noise
PEAK_BYTES = 64 << 20
P = 4
PEERS = sorted(Identity.generate().peer_id for _ in range(3))
KEYS = rec.wire_members(PEERS)  # as sent: their public keys
D = bytes.fromhex("ab" * 32)  # a sha256 digest as sent: 32 bytes

VALID: dict[str, Any] = {
    "heads": {"f": [[3, D], [2, D], None, [0, D]], "r": ["a1", "", "b2", ""], "t": 1.5, "name": "n0",
              "state": "training", "done": False, "step": 12, "tps": 100.5, "loss": 2.25},
    "gathering": {"g": [[0, 3, D], [2, 1, D]], "t": 5.0, "l": [[1, 3, D, 4.5], [0, 2, D, 3.0]]},
    "declaration": {"open": False, "t": 5.0, "g": True},
    "join_request": {"f": 1, "v": 3, "d": D, "sig": b"s" * 64, "bw": 6104},
    "join_answer": {"members": KEYS, "round": "abcd", "t": 0.5, "s": [500, 500, 0], "bw": [6104, 6104, 244],
                    "js": [b"s" * 64] * 3},
    "state_request": {"f": 1, "join": True},
    "state_answer": {"v": 3, "d": D, "l": [200, 4096, 8192.0, 512, 10**6]},
    "reduce_request": {"round": "abcd", "g": b"g" * 16, "r": 1, "tokens": 100,
                       "steps": 4, "span": 2, "pos": 120, "sig": b"s" * 64},
    "statement": {"c": [0, 2], "n": [2048, 120, 512], "sig": b"s" * 64, "rej": {}},
    "final_request": {"round": "abcd", "r": 0, "st": [[0, [0, 1], [2048, 120, 1024], b"h" * 32, b"s" * 64]]},
    "dialback_request": {"ports": [31337, 4001]},
    "dialback_answer": {"observed": "203.0.113.21", "reachable": [31337]},
    "delta_request": {"f": 1, "v": 3, "d": D, "tv": 5, "td": D, "max": 4096},
    "delta_answer": {"s": [[D, 2048, 120, 512, 3, "int4", [[[0, 2], 100], [[1], 60]]]]},
}
DECODERS: dict[str, Callable[[Any], Any]] = {
    "heads": lambda v: rec.parse_heads(v, P),
    "heads_any_count": lambda v: rec.parse_heads(v, None),
    "gathering": lambda v: rec.parse_gathering(v, P),
    "declaration": rec.parse_declaration,
    "join_request": lambda v: rec.parse_join_request(v, P),
    "join_answer": rec.parse_join_answer,
    "state_request": lambda v: rec.parse_state_request(v, P),
    "state_answer": rec.parse_state_answer,
    "reduce_request": rm.parse_reduce_request,
    "statement": lambda v: rm.parse_statement(v, 3),
    "final_request": rm.parse_final_request,
    "dialback_request": rec.parse_dialback_request,
    "dialback_answer": rec.parse_dialback_answer,
    "delta_request": lambda v: rec.parse_delta_request(v, P, 8),
    "delta_answer": lambda v: rec.parse_delta_answer(v, 1, 3, frozenset({"int4", "fp32"})),
}
NASTY: list[Any] = [None, True, False, 0, -1, 1, 2**31, 2**48 + 1, 2**63, -(2**63), 2**64 - 1, 1.5, -0.0,
                    math.inf, -math.inf, math.nan, 1e308, "", "x" * 10_000, D, D.upper(), "12D3KooW", b"", b"\x00" * 64,
                    [], {}, [None] * 5000, list(range(100_000)), {str(i): i for i in range(64)}, [[[[[]]]]],
                    PEERS[0], PEERS[::-1], [PEERS[0]] * 2, KEYS[::-1], [KEYS[0]] * 2, KEYS[0][:31]]


def mutate(value: Any, rng: random.Random, depth: int = 0) -> Any:
    """One random change somewhere in ``value`` (changed containers are copies; parsers never
    mutate their input, so the unchanged parts and the nasty values are shared)."""
    if depth > 6 or rng.random() < 0.3:
        return rng.choice(NASTY) if rng.random() < 0.8 else rng.randbytes(rng.randint(0, 80))
    if isinstance(value, dict) and value:
        out = dict(value)
        key = rng.choice(list(out))
        action = rng.random()
        if action < 0.2:
            del out[key]
        elif action < 0.3:
            out[rng.choice(["_n", "x", key.upper(), ""])] = rng.choice(NASTY)
        else:
            out[key] = mutate(out[key], rng, depth + 1)
        return out
    if isinstance(value, list) and value:
        out = list(value)
        i = rng.randrange(len(out))
        action = rng.random()
        if action < 0.15:
            del out[i]
        elif action < 0.3:
            out.append(out[i])
        elif action < 0.4 and len(out) < 64:
            out = out * rng.randint(2, 400)
        else:
            out[i] = mutate(out[i], rng, depth + 1)
        return out
    return rng.choice(NASTY)


def inputs(valid: Any, seed: int) -> list[Any]:
    """N inputs: mutants of ``valid`` (1 to 3 mutations each) and random msgpack decodings."""
    rng = random.Random(seed)
    out = []
    for i in range(N):
        if i % 10 == 9:  # random bytes through msgpack, as a DHT value or RPC header would arrive
            try:
                out.append(msgpack.unpackb(rng.randbytes(rng.randint(1, 64)), raw=False, strict_map_key=False))
            except Exception:  # not decodable: the transport drops it before any parser
                out.append(rng.randbytes(8))
            continue
        v = valid
        for _ in range(rng.randint(1, 3)):
            v = mutate(v, rng)
        out.append(v)
    return out


def run_fuzz(decode: Callable[[Any], Any], cases: list[Any], allowed: tuple[type[BaseException], ...]) -> dict:
    """Feed every case; returns {"ok": n, "refused": n}; fails on any other exception, a slow
    call or a memory peak over the bound."""
    counts = {"ok": 0, "refused": 0}
    tracemalloc.start()
    try:
        for case in cases:
            t0 = time.thread_time()  # CPU time: a busy machine's preemption is not the decoder's
            try:
                decode(case)
                counts["ok"] += 1
            except allowed:
                counts["refused"] += 1
            except Exception as e:  # noqa: BLE001 - this is what the fuzzer looks for
                pytest.fail(f"{type(e).__name__}: {e} on input {repr(case)[:300]}")
            dt = time.thread_time() - t0
            assert dt < SLOW_S, f"{dt:.3f} s on input {repr(case)[:300]}"
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BYTES, f"peak {peak / 2**20:.1f} MiB"
    return counts


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_record_and_message_decoders_survive_10000_hostile_inputs(name: str) -> None:
    valid = VALID[name.removesuffix("_any_count")]
    DECODERS[name](valid)  # the valid value itself parses
    counts = run_fuzz(DECODERS[name], inputs(valid, seed=sum(map(ord, name))),
                      (ProtocolError,))
    assert counts["ok"] + counts["refused"] == N and counts["refused"] > N // 2


def payloads(good: dict[str, bytes], rng: random.Random, head: int = 0) -> list[tuple[bytes, str]]:
    """N (bytes, precision) cases from valid payloads: cut short, bytes overwritten (half of
    them within the first ``head`` bytes, where counts and scales sit, when ``head``), bytes
    appended, or random bytes."""
    cases = []
    for _ in range(N):
        p = rng.choice(sorted(good))
        data = bytearray(good[p])
        action = rng.random()
        if action < 0.3 and data:
            del data[rng.randrange(len(data)):]
        elif action < 0.6 and data:
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(min(len(data), head) if head and rng.random() < 0.5 else len(data))] = \
                    rng.randrange(256)
        elif action < 0.8:
            data += rng.randbytes(rng.randint(1, 64))
        else:
            data = bytearray(rng.randbytes(rng.randint(0, 2000)))
        cases.append((bytes(data), p))
    return cases


def test_wire_decoder_survives_10000_hostile_payloads() -> None:
    shapes = [(16, 8), (8,), (3, 5)]
    rng = random.Random(7)
    good = {p: wire.encode([__import__("torch").randn(s) for s in shapes], p) for p in wire.WIRE_DTYPES}
    counts = run_fuzz(lambda c: wire.decode(c[0], shapes, c[1]), payloads(good, rng), (ProtocolError,))
    assert counts["refused"] > N // 3


def test_merged_slice_decoder_survives_10000_hostile_payloads() -> None:
    """A reducer's answer at every precision (topk2's has its own layout, with counts)."""
    torch = __import__("torch")
    shapes = [(70, 70), (8,), (3, 5)]  # 4900 elements: topk2 chunks of 4096 and 804
    rng = random.Random(8)
    good = {p: wire.encode_merged([torch.randn(s) * (torch.rand(s) < 0.1) for s in shapes], p)
            for p in wire.WIRE_DTYPES}
    counts = run_fuzz(lambda c: wire.decode_merged(c[0], shapes, c[1]), payloads(good, rng, head=64),
                      (ProtocolError,))
    assert counts["refused"] > N // 3


def test_certificate_and_revocation_decoders_survive_10000_hostile_inputs() -> None:
    key = SwarmKey.generate()
    cert = key.admit(Identity.generate().public_key, valid_for=3600).encode()
    revs = key.revoke([Identity.generate().public_key]).encode()
    rng = random.Random(11)
    for good, decode in ((cert, Certificate.decode), (revs, lambda b: RevocationList.decode(b, key.public_key))):
        structure = msgpack.unpackb(good, raw=False)
        cases = []
        for i in range(N):
            if i % 2:
                data = bytearray(good)
                for _ in range(rng.randint(1, 6)):
                    data[rng.randrange(len(data))] = rng.randrange(256)
                cases.append(bytes(data))
            else:
                cases.append(msgpack.packb(mutate(structure, rng), use_bin_type=True))
        counts = run_fuzz(decode, cases, (CertificateError,))
        assert counts["refused"] > N // 2
