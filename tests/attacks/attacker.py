"""An attacker peer built on the project's own library, and the attacks it runs.

The attacker is an ordinary :class:`p2pdiloco.net.transport.swarm.Swarm` (its own p2pd, an
in-process DHT node, a fresh :class:`~p2pdiloco.trust.identity.Identity`) that joins the
honest swarm through its bootstrap peer. It computes every DHT key exactly as the nodes do
(from the same ``--set`` settings, :func:`p2pdiloco.config.load_config`,
:func:`node.runtime.protocol_tag`, :class:`p2pdiloco.net.rounds.matchmaking.GroupKey`), reads the
honest nodes' records to learn their versions and digests, and then publishes hostile records
(signed by itself: the DHT accepts them) and answers RPCs with hostile replies.

Attacks below the RPC layer write the transport's framing by hand on a raw libp2p stream
(``P2P.call_binary_stream_handler``): a 4-byte big-endian header length, a msgpack map header
whose ``_n`` is the payload length, then ``_n`` payload bytes (p2pdiloco/net/transport/framing.py).

Every attack is a coroutine ``attack(atk, targets, until)`` that runs until the monotonic
deadline ``until`` and counts what it did in ``atk.stats``; the version claims and digests it
publishes go to ``atk.claims`` so the test can tell whether an honest node followed them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import random
import secrets
import struct
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from p2pdiloco.config import NodeConfig, load_config
from p2pdiloco.core.fragments import assign_parts, balanced_fragments
from p2pdiloco.core.outer import FragmentState, fragment_digest
from p2pdiloco.core.periods import Ledger
from p2pdiloco.errors import NetworkError, P2PDilocoError, ProtocolError
from p2pdiloco.model import build_model
from p2pdiloco.net.records import parse as rec
from p2pdiloco.net.transport import framing
from p2pdiloco.net.codecs import wire
from p2pdiloco.net.rounds.matchmaking import Group, GroupKey
from p2pdiloco.net.records.patches import Received
from p2pdiloco.net.rounds.results import group_fingerprint
from p2pdiloco.net.transport.swarm import Swarm
from p2pdiloco.trust import signing
from p2pdiloco.trust.identity import Identity, is_peer_id, public_key_of

from node.runtime import protocol_tag

HEAD_TTL = 8.0  # seconds the attacker's records live: short, so one attack does not leak into the next test
TAKEOVER_AHEAD = 10**9  # versions ahead claimed by the takeover attack
FOLLOW_LIMIT = 10**6  # an honest node at a version this high followed an attacker's claim
NO_LEDGER = [-1, 0, 0.0, 0, 0]  # a state answer's ledger before any round (core.periods.Ledger())
_LENGTH = struct.Struct(">I")


def new_framing() -> bool:
    """Whether the transport speaks the raw-stream framing (length-prefixed msgpack header)."""
    return hasattr(framing, "read_header")


@dataclass(frozen=True)
class World:
    """What the attacker knows about the run: the same config the honest nodes built."""

    run_id: str
    cfg: NodeConfig
    tag: str
    shapes: tuple[tuple[tuple[int, ...], ...], ...]  # per fragment, the slot shapes
    maddr: str

    @classmethod
    def from_settings(cls, settings: dict[str, str], run_id: str, maddr: str) -> World:
        cfg = load_config(None, env={}, overrides={**settings, "swarm.run_id": run_id})
        model = build_model(cfg.model, cfg.seed)
        named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        frags = balanced_fragments(named, cfg.outer.fragments, model.embedding_names())
        shapes = tuple(tuple(tuple(s.shape) for s in f.slots) for f in frags)
        return cls(run_id, cfg, protocol_tag(cfg, frags), shapes, maddr)

    @property
    def fragments(self) -> int:
        return len(self.shapes)

    @property
    def run(self) -> str:
        """``{run_id}/{protocol tag}``: the matchmaking prefix and the signatures' run field."""
        return f"{self.run_id}/{self.tag}"

    @property
    def heads_key(self) -> str:
        return f"{self.run_id}/heads"

    @property
    def gathering_run(self) -> str:
        """The run's name as gathering pushes carry it (``net.rounds.gatherings``)."""
        return self.run

    def mm_key(self, p: int, version: int, digest: str) -> str:
        return GroupKey(p, version, digest).dht_key(self.run)

    def numels(self, p: int) -> list[int]:
        return [math.prod(s) for s in self.shapes[p]]

    def state_bytes(self, p: int) -> int:
        return 2 * 4 * sum(self.numels(p))

    def slots(self, p: int, members: int) -> tuple[int, ...]:
        """The slots reducer 0.. of a ``members``-member round owns (``assign_parts``), per reducer."""
        return _parts(tuple(self.numels(p)), members)


@functools.lru_cache(maxsize=64)
def _parts(numels: tuple[int, ...], members: int) -> tuple[tuple[int, ...], ...]:
    return assign_parts(list(numels), members)  # about a second for 100,000 members: computed once


def as_sent(d: str) -> bytes:
    """A digest (64 hex digits) as nodes send it: 32 bytes (``records.wire_digest``)."""
    return bytes.fromhex(d)


def _claim(item: Any) -> tuple[int, str] | None:
    """A heads record's [version, digest] entry as (version, hex digest), None if it is not one."""
    if isinstance(item, list) and len(item) == 2 and type(item[0]) is int and isinstance(item[1], bytes) \
            and len(item[1]) == 32:
        return item[0], item[1].hex()
    return None


def _hex_claim(item: Any) -> bool:
    """Whether ``item`` is a well-formed [version, 64 hex digits] claim in the node's own form."""
    return isinstance(item, list) and len(item) == 2 and type(item[0]) is int and isinstance(item[1], str) \
        and len(item[1]) == 64


def random_digest() -> str:
    return secrets.token_hex(32)


def grind_identity(below: Sequence[str] = (), above: Sequence[str] = (), tries: int = 20000) -> Identity:
    """A fresh identity whose peer ID sorts below every ID of ``below`` and above every ID of
    ``above`` (an attacker can make as many identities as it likes: peer IDs are free)."""
    best = None
    for _ in range(tries):
        ident = Identity.generate()
        pid = ident.peer_id
        if all(pid < b for b in below) and all(pid > a for a in above):
            if not below:
                return ident
            if best is None or pid < best.peer_id:
                best = ident
            if pid[:10] < min(below)[:10]:
                return ident
    if best is None:
        raise RuntimeError("could not grind a suitable peer ID")
    return best


class Attacker:
    """One attacking peer. Create with :meth:`start`, always :meth:`close`."""

    def __init__(self, world: World, swarm: Swarm):
        self.world, self.swarm = world, swarm
        self.peer_id = swarm.peer_id
        self.stats: Counter[str] = Counter()
        self.claims: set[str] = set()  # digests this attacker claimed (full hex)
        self.pushed: dict[str, dict] = {}  # honest records pushed to it (st.heads): it reads them as a node does
        self.known: set[str] = set()  # honest nodes in its last read of the records
        self.max_claim = 0  # highest version it claimed
        self._handlers: set[str] = set()
        self._held: list[asyncio.StreamWriter] = []

    @classmethod
    async def start(cls, world: World, identity: Identity | None = None, membership=None) -> Attacker:
        swarm = await Swarm.start(initial_peers=[world.maddr], identity=identity or Identity.generate(),
                                  membership=membership)
        atk = cls(world, swarm)
        bases = Received(swarm.drop)  # honest pushes are patches of the last record it took (net.records.patches)

        async def on_heads(peer: str, header: dict, payload: bytes) -> tuple[dict, bytes]:
            if (header := bases.expand(peer, header)) is None:
                return {"resend": True}, b""
            record = header.get("r") if isinstance(header, dict) else None
            if isinstance(record, dict) and len(atk.pushed) < 1024:
                atk.pushed[peer] = record
                bases.keep(peer, header)
            return {}, b""

        await swarm.add_handler("st.heads", on_heads)  # honest nodes push their records to it once they see it
        return atk

    async def close(self) -> None:
        for w in self._held:
            try:
                w.close()
            except Exception:
                pass
        await self.swarm.shutdown()

    # ---- reading the honest swarm ---------------------------------------------------------
    async def honest_records(self) -> dict[str, dict]:
        try:
            recs = await self.swarm.get(self.world.heads_key)
        except NetworkError:
            recs = {}
        for p, r in self.pushed.items():  # the newer of the stored and the pushed record, as a node reads them
            if not isinstance(recs.get(p), dict) or r.get("t", 0) > recs[p].get("t", 0):
                recs[p] = r
        out = {p: r for p, r in recs.items() if p != self.peer_id and is_peer_id(p) and isinstance(r, dict)}
        self.known = set(list(out)[:1024])  # the nodes it pushes its records to, as a node its audience
        return out

    async def newest(self) -> list[tuple[int, str]]:
        """Per fragment, the highest (version, digest) any honest record holds ((0, "") if none)."""
        best = [(0, "")] * self.world.fragments
        for rec in (await self.honest_records()).values():
            frags = rec.get("f")
            if not isinstance(frags, list) or len(frags) != self.world.fragments:
                continue
            for p, item in enumerate(frags):
                if (claim := _claim(item)) is not None:
                    best[p] = max(best[p], claim)
        return best

    async def honest_keys(self) -> set[tuple[int, int, str]]:
        """(fragment, version, digest) keys honest learners hold now (where they gather next)."""
        keys = set()
        for rec in (await self.honest_records()).values():
            frags = rec.get("f")
            for p, item in enumerate(frags if isinstance(frags, list) else ()):
                if (claim := _claim(item)) is not None:
                    keys.add((p, *claim))
        return {k for k in keys if 0 <= k[0] < self.world.fragments}

    # ---- writing --------------------------------------------------------------------------
    async def publish(self, key: str, value: Any, ttl: float = HEAD_TTL) -> bool:
        try:
            ok = await self.swarm.store(key, self.peer_id, value, ttl)
        except (NetworkError, TypeError, ValueError, OverflowError) as e:
            self.stats["store_failed"] += 1
            self.stats[f"store_error:{type(e).__name__}"] += 1
            if self.stats["store_failed"] == 1:  # the first message, for the window's summary
                self.stats[f"first_store_error:{str(e)[:160]}"] += 1
            return False
        self.stats["stored" if ok else "store_refused"] += 1
        return ok

    async def publish_heads(self, frags: Any, **extra: Any) -> bool:
        """Store and push a heads record of ``frags``: its well-formed claims ([version, 64 hex
        digits]) go as nodes send them (the digest as 32 bytes), anything else as given."""
        claims = [item for item in frags if _hex_claim(item)] if isinstance(frags, list) else []
        if claims:
            frags = [[item[0], as_sent(item[1])] if _hex_claim(item) else item for item in frags]
        record = {"f": frags, "t": time.time(), "name": "attacker", "state": "training", "done": False,
                  "step": 100, "tps": 1000.0, "loss": 1.0, "r": [""] * self.world.fragments, **extra}
        for v, d in claims:
            self.claims.add(d)
            self.max_claim = max(self.max_claim, v)
        stored = await self.publish(self.world.heads_key, record)
        await self.push_heads(record)
        return stored

    async def push_heads(self, record: Any, also: Sequence[str] = ()) -> None:
        """Push ``record`` as a node does (st.heads) to the nodes that push to it and those it read
        in the DHT (a joining node greets them: StateSync.greet): nodes that receive pushes read
        the DHT every ``heads_records.READ_QUIET_S`` only; ``also``: more peer IDs."""
        for peer in dict.fromkeys([*self.pushed, *self.known, *also]):
            try:
                await self.swarm.call(peer, "st.heads", {"r": record, "run": self.world.run_id}, timeout=1.0)
                self.stats["pushed"] += 1
            except (NetworkError, ProtocolError, TypeError, ValueError, OverflowError):
                self.stats["push_failed"] += 1

    def zero_state(self, p: int, version: int) -> tuple[str, bytes]:
        """Digest and wire bytes of a fragment state whose Θ and momentum are all zero."""
        zeros = [torch.zeros(s) for s in self.world.shapes[p]]
        return fragment_digest(p, version, zeros, zeros), wire.encode(zeros + zeros, "fp32")

    @contextlib.contextmanager
    def signing_as(self, identity: Identity):
        """DHT records stored inside this block are signed by ``identity`` (a made-up peer that
        runs no daemon), as ``SignedRecords.sign_value`` signs them: identities are free, and a
        record only proves that whoever holds the key signed it."""
        records = self.swarm.records
        own, records.identity = records.identity, identity
        try:
            yield
        finally:
            records.identity = own

    async def honest_state(self, peer: str, p: int) -> FragmentState:
        """Fragment ``p``'s state as honest node ``peer`` holds it now (``state.get``, as a
        joining node asks; parsed and digest-checked as ``StateSync`` does).

        Raises:
            NetworkError, ProtocolError: no answer, or not a state."""
        reply, body = await self.swarm.call(peer, "state.get", {"f": p}, timeout=5.0,
                                            max_reply=self.world.state_bytes(p))
        answer = rec.parse_state_answer(reply)
        shapes = list(self.world.shapes[p])
        tensors = wire.decode(body, shapes + shapes, "fp32")
        state = FragmentState.create(p, answer.version, tensors[:len(shapes)], tensors[len(shapes):], answer.ledger)
        if state.digest != answer.digest:
            raise ProtocolError(f"{peer[-8:]}'s state does not match its digest")
        return state

    async def serve_states(self, forged: dict[int, FragmentState]) -> None:
        """Answer ``state.get`` with ``forged[p]`` as it is at the time of asking (correct
        digest, so only what the state *is* can give it away)."""

        async def on_get(peer: str, header: dict, payload: bytes) -> tuple[dict, bytes]:
            p = header.get("f") if type(header.get("f")) is int and header["f"] in forged else min(forged)
            st = forged[p]
            self.stats["state_answers"] += 1
            self.stats[f"state_answers:{peer}"] += 1
            return ({"v": st.version, "d": as_sent(st.digest), "l": st.ledger.to_list()},
                    wire.encode(list(st.theta) + list(st.momentum), "fp32"))

        await self.serve("state.get", on_get)

    async def serve(self, name: str, handler) -> None:
        """Answer RPC ``name`` with ``handler(peer, header, payload) -> (header, payload)``."""
        if name in self._handlers:
            raise RuntimeError(f"{name} already served")
        self._handlers.add(name)
        await self.swarm.add_handler(name, handler)

    # ---- contributions --------------------------------------------------------------------
    def reduce_request(self, round_id: str, p: int, version: int, digest: str, members: Sequence[str],
                       reducer: int, *, tokens: int = 1000, steps: int = 10, span: int = 1,
                       position: int = 0, name_members: bool = False) -> tuple[dict, bytes]:
        """A properly signed ``ar.reduce`` request (header, payload) from this attacker, for
        the group of ``members`` it makes up (no honest reducer holds that group). With
        ``name_members``, the header also lists the members (as requests did before they
        named their group by fingerprint), which the reducer must not even read."""
        slots = self.world.slots(p, len(members))[reducer]
        shapes = [self.world.shapes[p][i] for i in slots]
        payload = wire.encode([torch.zeros(s) for s in shapes], self.world.cfg.outer.wire_precision)
        fields = signing.contribution_fields(self.world.run, p, version, digest, round_id, list(members), reducer,
                                             tokens, steps, span, position, signing.sha256(payload))
        group = Group(round_id, GroupKey(p, version, digest), tuple(members), 0.0)
        header = {"round": round_id, "g": group_fingerprint(group), "tokens": tokens, "steps": steps, "span": span,
                  "pos": position, "r": reducer,
                  "sig": signing.sign(self.swarm.identity, "ar.contrib", fields)}
        if name_members:
            header["members"] = list(members)
        return header, payload

    # ---- raw streams ----------------------------------------------------------------------
    async def raw_stream(self, peer: str, name: str):
        """Open a raw libp2p stream to ``peer``'s handler ``name``: (reader, writer)."""
        from hivemind.p2p import PeerID  # noqa: PLC0415

        _, reader, writer = await self.swarm._p2p.call_binary_stream_handler(PeerID.from_base58(peer), name)
        return reader, writer

    @staticmethod
    def frame(header: dict, payload_size: int) -> bytes:
        """The transport's framing, written by hand: no size limit is applied."""
        head = msgpack.packb(dict(header, _n=payload_size), use_bin_type=True)
        return _LENGTH.pack(len(head)) + head

    async def call(self, peer: str, name: str, header: dict, payload: bytes = b"", *,
                   timeout: float) -> tuple[dict | None, str]:
        """Send one request; (reply header or None, outcome). Oversized headers are framed by
        hand on a raw stream (the library would refuse to send them)."""
        try:
            async with asyncio.timeout(timeout):
                if new_framing() and len(msgpack.packb(header, use_bin_type=True)) > 60_000:
                    reader, writer = await self.raw_stream(peer, name)
                    try:
                        writer.write(self.frame(header, len(payload)))
                        writer.write(payload)
                        await writer.drain()
                        size = _LENGTH.unpack(await reader.readexactly(4))[0]
                        reply = msgpack.unpackb(await reader.readexactly(size), raw=False)
                    finally:
                        writer.close()
                else:
                    reply, _ = await self.swarm.call(peer, name, header, payload, timeout=timeout)
        except TimeoutError:
            return None, "timeout"
        except P2PDilocoError as e:
            return None, type(e).__name__
        except (OSError, EOFError, asyncio.IncompleteReadError, ValueError) as e:
            return None, type(e).__name__
        except Exception as e:  # a hostile peer tolerates every failure
            return None, type(e).__name__
        if isinstance(reply, dict) and "error" in reply:
            return reply, "error"
        return reply, "ok"


class Coalition:
    """``k`` attackers acting together, each its own identity and its own p2pd (identities
    are free: docs/trust.md). Create with :meth:`start`, always :meth:`close` (every daemon
    ends, also when one of them failed to start). Attacks that take a coalition are marked
    with :func:`coalition_attack`; the others run on its first member."""

    def __init__(self, members: Sequence[Attacker]):
        self.members = list(members)

    @classmethod
    async def start(cls, world: World, k: int, identity: Identity | None = None) -> Coalition:
        """Start ``k`` >= 1 attackers at once (the first with ``identity`` when given).

        Raises:
            whatever the first failed :meth:`Attacker.start` raised, once every started one is closed."""
        if k < 1:
            raise ValueError(f"a coalition needs at least one member, not {k}")
        started = await asyncio.gather(*(Attacker.start(world, identity if i == 0 else None) for i in range(k)),
                                       return_exceptions=True)
        members = [a for a in started if isinstance(a, Attacker)]
        failed = [e for e in started if not isinstance(e, Attacker)]
        if failed:
            await cls(members).close()
            raise failed[0]
        return cls(members)

    async def close(self) -> None:
        """Close every member (their daemons end), whatever the others' closing raised."""
        outcomes = await asyncio.gather(*(m.close() for m in self.members), return_exceptions=True)
        errors = [e for e in outcomes if isinstance(e, BaseException)]
        if errors:
            raise errors[0]

    def __getitem__(self, i: int) -> Attacker:
        return self.members[i]

    def __len__(self) -> int:
        return len(self.members)

    @property
    def peer_ids(self) -> list[str]:
        return [m.peer_id for m in self.members]

    @property
    def stats(self) -> Counter[str]:
        """Every member's counts added up."""
        return sum((m.stats for m in self.members), Counter())

    @property
    def claims(self) -> set[str]:
        return set().union(*(m.claims for m in self.members))

    @property
    def max_claim(self) -> int:
        return max(m.max_claim for m in self.members)


def coalition_attack(fn):
    """Mark ``fn(coalition, targets, until, **kwargs)`` as an attack that takes the whole
    :class:`Coalition` (the runner passes the first member to the others)."""
    fn.coalition = True
    return fn


# ---- the attacks --------------------------------------------------------------------------
async def _every(seconds: float, until: float) -> Any:
    """Yield once now and then every ``seconds`` until ``until`` (monotonic)."""
    while time.monotonic() < until:
        yield
        await asyncio.sleep(max(0.0, min(seconds, until - time.monotonic())))


async def idle(atk: Attacker, targets: Sequence[str], until: float) -> None:
    """A bystander: joins and does nothing (the baseline runs with one)."""
    await asyncio.sleep(max(0.0, until - time.monotonic()))


async def gathering_crash(atk: Attacker, targets: Sequence[str], until: float) -> None:
    """Attack 1: gathering announcements whose entries hold a float infinity, then an empty map,
    pushed (``mm.gather``) to every target under the run's name, as honest learners push theirs."""
    run = atk.world.gathering_run
    d = as_sent("ab" * 32)
    records = [{"g": [[0, float("inf"), d]], "t": time.time(), "run": run},
               {"g": [{}], "t": time.time(), "run": run},
               {"g": [[float("inf"), 0, d], {}, [], "x"], "t": time.time(), "run": run}]
    i = 0
    async for _ in _every(1.0, until):
        for target in targets:
            _, outcome = await atk.call(target, "mm.gather", records[i % len(records)], timeout=5)
            atk.stats[f"gathering_push_{outcome}"] += 1
        i += 1


async def heads_garbage(atk: Attacker, targets: Sequence[str], until: float) -> None:
    """Heads records of the wrong types, unbounded numbers and huge lists (no state served),
    stored in the DHT and pushed."""
    P = atk.world.fragments
    d = "cd" * 32
    records = [
        {"f": [[float("inf"), d]] * P, "t": "later", "step": "many", "done": "no", "r": [{}, 7], "loss": float("nan")},
        {"f": [[2**64 - 1, d]] * P, "t": float("inf"), "step": 2**63, "r": [[1] * 1000] * P},
        {"f": [[-(2**63), d], [True, d]] + [[1, d]] * (P - 2), "name": ["x"] * 1000, "tps": float("-inf")},
        {"f": {"0": [1, d]}, "r": "x" * 10000},
        {"f": [[1, "ab"]] * 50_000},
        {"f": [[{}, []]] * P, "step": None, "done": {"x": 1}},
        {"f": [[1, d * 1000]] * P},
        {"f": [[2**62, "ZZ" * 32]] * P},
    ]
    values: list[Any] = ["not a map", 12345, [1, 2, 3], None, b"\x00" * 100]
    i = 0
    async for _ in _every(0.7, until):
        item = (records + values)[i % (len(records) + len(values))]
        item = {"t": time.time(), **item} if isinstance(item, dict) else item
        await atk.publish(atk.world.heads_key, item)
        await atk.push_heads(item, targets)  # and pushed: a node that receives pushes reads the DHT seldom
        atk.stats["heads_records"] += 1
        i += 1


async def _claim_ahead(atk: Attacker, until: float, ahead: int, every: float, fresh_digest: bool,
                       current: dict[int, tuple[int, str]]) -> None:
    """Publish heads ``ahead`` versions past the honest newest, into ``current`` {p: (v, d)}."""
    async for _ in _every(every, until):
        newest = await atk.newest()
        frags = []
        for p, (v, d) in enumerate(newest):
            old = current.get(p)
            if old is None or old[0] <= v or fresh_digest:
                current[p] = (v + ahead, random_digest())
            frags.append([current[p][0], current[p][1]])
        await atk.publish_heads(frags)
        atk.stats["claims"] += 1


def _asked(atk: Attacker, peer: str, header: dict, current: dict[int, tuple[int, str]]) -> tuple[int, int, str, int]:
    """(fragment asked for, the version and digest we claim for it, answers given so far),
    counting this one (in all, and ``state_answers:{peer}`` for the node that asked)."""
    p = header.get("f") if type(header.get("f")) is int and 0 <= header["f"] < atk.world.fragments else 0
    n = atk.stats["state_answers"]
    atk.stats["state_answers"] += 1
    atk.stats[f"state_answers:{peer}"] += 1
    return (p, *current.get(p, (1, random_digest())), n)


async def state_answer_crash(atk: Attacker, targets: Sequence[str], until: float) -> None:
    """Attack 2: heads one version ahead; ``state.get`` answered with version infinity or 2**63."""
    current: dict[int, tuple[int, str]] = {}

    async def on_get(peer: str, header: dict, payload: bytes) -> tuple[dict, bytes]:
        p, v, d, n = _asked(atk, peer, header, current)
        bad = float("inf") if n % 2 == 0 else 2**63
        return {"v": bad, "d": as_sent(d), "l": NO_LEDGER}, bytes(atk.world.state_bytes(p))

    await atk.serve("state.get", on_get)
    await _claim_ahead(atk, until, 1, 0.5, False, current)


async def state_answer_garbage(atk: Attacker, targets: Sequence[str], until: float) -> None:
    """Heads one version ahead; ``state.get`` answered with a wrong byte count, a digest that
    does not match the bytes, or a version/digest of the wrong type."""
    current: dict[int, tuple[int, str]] = {}

    async def on_get(peer: str, header: dict, payload: bytes) -> tuple[dict, bytes]:
        p, v, d, n = _asked(atk, peer, header, current)
        size = atk.world.state_bytes(p)
        mode = n % 5
        if mode == 0:
            return {"v": v, "d": as_sent(d), "l": NO_LEDGER}, bytes(size // 2)  # too short
        if mode == 1:
            return {"v": v, "d": as_sent(d), "l": NO_LEDGER}, bytes(size + 4096)  # too long
        if mode == 2:
            return {"v": v, "d": as_sent(d), "l": NO_LEDGER}, random.randbytes(size)  # right size, wrong digest
        if mode == 3:
            return {"v": -5, "d": as_sent(d), "l": NO_LEDGER}, bytes(size)
        return {"v": [v], "d": {"x": d}}, b"\x00"

    await atk.serve("state.get", on_get)
    await _claim_ahead(atk, until, 1, 0.5, False, current)


async def takeover(atk: Attacker, targets: Sequence[str], until: float) -> None:
    """Attack 3: heads a billion versions ahead, serving a zeroed state and momentum with its
    correct digest."""
    states: dict[int, tuple[int, str, bytes]] = {}
    newest = await atk.newest()
    for p, (v, _) in enumerate(newest):
        version = v + TAKEOVER_AHEAD
        digest, body = atk.zero_state(p, version)
        states[p] = (version, digest, body)

    async def on_get(peer: str, header: dict, payload: bytes) -> tuple[dict, bytes]:
        p = header.get("f") if type(header.get("f")) is int and header["f"] in states else 0
        version, digest, body = states[p]
        atk.stats["state_answers"] += 1
        return {"v": version, "d": as_sent(digest), "l": NO_LEDGER}, body

    await atk.serve("state.get", on_get)
    async for _ in _every(1.0, until):
        await atk.publish_heads([[states[p][0], states[p][1]] for p in range(atk.world.fragments)])
        atk.stats["claims"] += 1


async def stall(atk: Attacker, targets: Sequence[str], until: float) -> None:
    """Attack 5: every 3 s, heads one version ahead with a new random digest; ``state.get``
    never answered."""
    current: dict[int, tuple[int, str]] = {}

    async def on_get(peer: str, header: dict, payload: bytes) -> tuple[dict, bytes]:
        atk.stats["state_requests_held"] += 1
        await asyncio.Event().wait()  # never answers
        return {}, b""

    await atk.serve("state.get", on_get)
    await _claim_ahead(atk, until, 1, 3.0, True, current)


def _mm_reply(mode: str, joiner: str, ghost: str, fakes: list[bytes], joiner_sig: object = b"") -> dict:
    """A hostile join answer; members as nodes send them, public keys (``records.wire_members``)."""
    round_id = secrets.token_hex(8)
    key = public_key_of
    if mode == "ghost":  # the joiner's own join signature, and a made-up one for the ghost
        members = sorted([joiner, ghost])
        sigs = [joiner_sig if m == joiner else secrets.token_bytes(64) for m in members]
        return {"members": [key(m) for m in members], "round": round_id, "t": 0.5, "js": sigs}
    elif mode == "unsorted":
        members = [key(m) for m in sorted([joiner, ghost], reverse=True)]
    elif mode == "huge":
        members = [key(joiner), *fakes]
    elif mode == "duplicate":
        members = [key(joiner), key(joiner)]
    elif mode == "nonstr":
        members = [0, key(joiner)]
    else:
        raise ValueError(mode)
    return {"members": members, "round": round_id, "t": 0.5}


async def mm_hijack(atk: Attacker, targets: Sequence[str], until: float, *,
                    modes: Sequence[str] = ("ghost",)) -> None:
    """Attack 4: an identity sorting below the honest ones declares itself open under every
    matchmaking key the honest nodes hold or gather at, and answers ``mm.join`` with a member
    list of the joiner and a peer that does not exist (``modes``: also unsorted lists, 10,000
    members, duplicates, members that are not keys, in turn)."""
    ghost = Identity.generate().peer_id
    fakes = [secrets.token_bytes(32) for _ in range(9_999)]  # made-up members (public keys)

    async def on_join(peer: str, header: dict, payload: bytes) -> tuple[dict, bytes]:
        mode = modes[atk.stats["joins"] % len(modes)]
        atk.stats["joins"] += 1
        atk.stats[f"joins_{mode}"] += 1
        return _mm_reply(mode, peer, ghost, fakes, header.get("sig") if isinstance(header, dict) else b""), b""

    await atk.serve("mm.join", on_join)
    declared: dict[tuple[int, int, str], float] = {}
    async for _ in _every(0.15, until):
        now = time.monotonic()
        for key in await atk.honest_keys():
            if declared.get(key, 0) > now:
                continue
            p, v, d = key
            if await atk.publish(atk.world.mm_key(p, v, d), {"open": True, "t": time.time()}, ttl=30):
                declared[key] = now + 10  # re-declare before the 30 s record lapses
                atk.stats["declared"] += 1
        for key in [k for k, t in declared.items() if t < now - 60]:
            del declared[key]


async def memory_flood(atk: Attacker, targets: Sequence[str], until: float, *,
                       total: int = 1 << 30, declared: int = 1 << 40) -> None:
    """Attack 6: one stream to the first target declaring a 2**40-byte payload, then sending
    up to ``total`` bytes (1 GiB) as fast as the target takes them."""
    chunk = bytes(1 << 20)
    sent = 0
    try:
        reader, writer = await atk.raw_stream(targets[0], "ar.reduce")
        atk._held.append(writer)
        writer.write(atk.frame({"round": "x" * 16, "f": 0, "v": 0, "d": "ab" * 32, "members": []}, declared))
        while sent < total and time.monotonic() < until:
            writer.write(chunk)
            async with asyncio.timeout(max(0.1, until - time.monotonic())):
                await writer.drain()
            sent += len(chunk)
        atk.stats["flood_done"] += 1
    except TimeoutError:
        atk.stats["flood_stalled"] += 1  # the target stopped reading: back-pressure
    except (OSError, ConnectionError, asyncio.IncompleteReadError, P2PDilocoError, Exception) as e:
        atk.stats[f"flood_error:{type(e).__name__}"] += 1
    atk.stats["flood_bytes"] = sent
    await asyncio.sleep(max(0.0, until - time.monotonic()))


async def idle_streams(atk: Attacker, targets: Sequence[str], until: float, *, n: int = 300) -> None:
    """Attack 7: ``n`` raw streams to the first target's ``state.get`` that never send a byte."""
    for i in range(n):
        if time.monotonic() >= until:
            break
        try:
            async with asyncio.timeout(5):
                _, writer = await atk.raw_stream(targets[0], ("state.get", "mm.join", "ar.reduce")[i % 3])
            atk._held.append(writer)
            atk.stats["streams_opened"] += 1
        except Exception as e:
            atk.stats[f"stream_error:{type(e).__name__}"] += 1
    await asyncio.sleep(max(0.0, until - time.monotonic()))


async def reduce_many_members(atk: Attacker, targets: Sequence[str], until: float, *,
                              members: int = 100_000) -> None:
    """Attack 7: a signed ``ar.reduce`` request naming ``members`` made-up members (plus the
    target and the attacker), to every target, a few times."""
    newest = await atk.newest()
    fakes = [f"z{i:05d}" for i in range(members)]

    async def one(target: str, k: int) -> None:
        p = k % atk.world.fragments
        v, d = newest[p]
        names = sorted([target, atk.peer_id, *fakes])
        reducer = names.index(target)
        header, payload = atk.reduce_request(f"many{k:04d}{secrets.token_hex(4)}", p, v, d or "ab" * 32, names,
                                             reducer, name_members=True)
        _, outcome = await atk.call(target, "ar.reduce", header, payload, timeout=20)
        atk.stats[f"reduce_{outcome}"] += 1

    k = 0
    async for _ in _every(6.0, until):
        await asyncio.gather(*(one(t, k + i) for i, t in enumerate(targets)))
        k += len(targets)


def _prepare_many_members(world: World) -> None:
    for p in range(world.fragments):  # the attacker's own CPU is not the attack: pay it before the window
        for n in (100_002,):
            world.slots(p, n)


reduce_many_members.prepare = _prepare_many_members  # type: ignore[attr-defined]


async def many_rounds(atk: Attacker, targets: Sequence[str], until: float, *, n: int = 2000,
                      concurrency: int = 200) -> None:
    """Attack 7: ``n`` signed ``ar.reduce`` requests with ``n`` different round IDs from one peer
    to the first target (each one a round the target would hold until its deadline)."""
    target = targets[0]
    newest = await atk.newest()
    names = sorted([target, atk.peer_id])
    reducer = names.index(target)
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            if time.monotonic() >= until:
                return
            p = i % atk.world.fragments
            v, d = newest[p]
            header, payload = atk.reduce_request(f"r{i:05d}{secrets.token_hex(4)}", p, v, d or "ab" * 32, names,
                                                 reducer)
            _, outcome = await atk.call(target, "ar.reduce", header, payload, timeout=1.0)
            atk.stats[f"rounds_{outcome}"] += 1

    await asyncio.gather(*(one(i) for i in range(n)))
    await asyncio.sleep(max(0.0, until - time.monotonic()))


async def junk_flood(atk: Attacker, targets: Sequence[str], until: float, *, workers: int = 3) -> None:
    """A flood of malformed calls to every RPC the nodes serve, from one peer."""
    junk: list[tuple[str, dict]] = [
        ("mm.join", {"f": "x"}), ("mm.join", {"f": 0, "v": float("inf"), "d": 5}),
        ("ar.reduce", {"round": 5}), ("ar.reduce", {"round": "x", "f": 0, "v": 0, "d": "", "members": "abc", "r": 0}),
        ("ar.final", {"st": "x"}), ("ar.final", {"round": "x", "r": 0, "st": [[0, [0], b"x", b"y"]] * 100}),
        ("state.get", {"f": -1}), ("state.get", {"f": float("nan")}), ("state.get", {}),
        ("trust.hello", {"x": [1] * 1000}),
    ]

    async def worker(w: int) -> None:
        i = w
        while time.monotonic() < until:
            name, header = junk[i % len(junk)]
            target = targets[i % len(targets)]
            _, outcome = await atk.call(target, name, header, random.randbytes(random.randrange(0, 2048)),
                                        timeout=2.0)
            atk.stats[f"junk_{outcome}"] += 1
            i += workers

    await asyncio.gather(*(worker(w) for w in range(workers)))


# ---- coalitions of free identities ------------------------------------------------------------
SHRINK = 0.5  # the "shrunk" forged state: the honest Θ times this


async def _forged(atk: Attacker, targets: Sequence[str], p: int, version: int, kind: str,
                  shrink: float = SHRINK) -> FragmentState:
    """Fragment ``p`` at ``version``: all-zero Θ and momentum (``kind`` "zero"), or the state
    an honest node holds now with Θ times ``shrink`` ("shrunk"; its momentum and ledger kept)."""
    if kind == "zero":
        zeros = [torch.zeros(s) for s in atk.world.shapes[p]]
        return FragmentState.create(p, version, zeros, zeros, Ledger())
    if kind != "shrunk":
        raise ValueError(kind)
    honest = await atk.honest_state(targets[p % len(targets)], p)
    return FragmentState.create(p, version, [t * shrink for t in honest.theta], honest.momentum, honest.ledger)


async def _claim_forged(members: Sequence[Attacker], forged: dict[int, FragmentState]) -> None:
    """Every member publishes (stores and pushes) a heads record of ``forged``."""
    frags = [[forged[p].version, forged[p].digest] for p in sorted(forged)]
    await asyncio.gather(*(m.publish_heads(frags) for m in members))
    for m in members:
        m.stats["claims"] += 1


@coalition_attack
async def coalition_takeover(coal: Coalition, targets: Sequence[str], until: float, *, ahead: int,
                             kind: str, every: float = 0.3) -> None:
    """Every member of the coalition publishes heads ``ahead`` versions past the honest newest,
    each with the digest of one forged state per fragment (``kind``: all-zero Θ and momentum,
    or the honest Θ shrunk by ``SHRINK``), and serves that state with its correct digest over
    ``state.get``. Every ``every`` s the forged states move on with the honest newest (the
    honest swarm makes several versions a second here: a claim one version ahead is stale
    within a round)."""
    forged: dict[int, FragmentState] = {}
    first = True
    async for _ in _every(every, until):
        newest = await coal[0].newest()
        for m in coal.members[1:]:  # every member pushes its claims to the honest nodes coal[0] read
            m.known = set(coal[0].known)
        for p, (v, _) in enumerate(newest):
            if p not in forged or forged[p].version < v + ahead:
                try:
                    forged[p] = await _forged(coal[0], targets, p, v + ahead, kind)
                except (NetworkError, ProtocolError):
                    coal[0].stats["honest_state_failed"] += 1
        if len(forged) < coal[0].world.fragments:
            continue
        if first:
            await asyncio.gather(*(m.serve_states(forged) for m in coal.members))
            first = False
        await _claim_forged(coal.members, forged)


async def ratchet(atk: Attacker, targets: Sequence[str], until: float, *, every: float = 0.7,
                  step: float = 0.02) -> None:
    """One identity, every ``every`` s: download the state an honest node holds (version v,
    ``state.get``) and claim and serve v + 1 with Θ shrunk by ``step`` more than the time
    before (x0.98, x0.96, ...), each with its correct digest: every move small, the sum not."""
    forged: dict[int, FragmentState] = {}
    n, first = 0, True
    async for _ in _every(every, until):
        n += 1
        await atk.honest_records()  # whom to push its claims to (a node reads the DHT seldom)
        for p in range(atk.world.fragments):
            try:
                honest = await atk.honest_state(targets[(n + p) % len(targets)], p)
            except (NetworkError, ProtocolError):
                atk.stats["honest_state_failed"] += 1
                continue
            forged[p] = FragmentState.create(p, honest.version + 1, [t * max(0.0, 1 - step * n) for t in honest.theta],
                                             honest.momentum, honest.ledger)
        if len(forged) < atk.world.fragments:
            continue
        if first:
            await atk.serve_states(forged)
            first = False
        await _claim_forged([atk], forged)


async def free_records(atk: Attacker, targets: Sequence[str], until: float, *, n: int = 300,
                       ahead: int = 20) -> None:
    """``n`` heads records stored by one attacker through its DHT node, each signed by a
    made-up identity that runs no daemon (:meth:`Attacker.signing_as`), all claiming an
    all-zero state ``ahead`` versions past the honest newest: a count of signed records is
    no evidence (identities are free). Spread over the window."""
    identities = [Identity.generate() for _ in range(n)]
    gap = max(0.0, until - time.monotonic()) / n
    newest, read_at = [], 0.0
    for ident in identities:
        if time.monotonic() >= until:
            break
        if time.monotonic() - read_at >= 1.0:  # the honest newest, read once a second
            newest, read_at = await atk.newest(), time.monotonic()
        frags = []
        for p, (v, _) in enumerate(newest):
            digest, _ = atk.zero_state(p, v + ahead)
            frags.append([v + ahead, as_sent(digest)])
            atk.claims.add(digest)
            atk.max_claim = max(atk.max_claim, v + ahead)
        record = {"f": frags, "t": time.time(), "name": "sybil", "state": "training", "done": False,
                  "step": 100, "tps": 1000.0, "loss": 1.0, "r": [""] * atk.world.fragments}
        with atk.signing_as(ident):
            try:
                ok = await atk.swarm.store(atk.world.heads_key, ident.peer_id, record, HEAD_TTL)
            except NetworkError:
                ok = False
        atk.stats["free_records_stored" if ok else "free_records_refused"] += 1
        await asyncio.sleep(gap)
    await asyncio.sleep(max(0.0, until - time.monotonic()))
