"""Pushed values as patches: a push carries only what changed since the value its receiver
acknowledged last (the control plane's bytes: docs/benchmarks/control_plane.md).

A node pushes the same small value (its heads record, ``st.heads``; its gathering
announcement, ``mm.gather``) to each peer again and again, and most fields do not change
between two pushes: after a round, one fragment's version, digest and round ID and a few
figures; in a heartbeat, the figures alone. A heads record of 4 fragments is pushed as 373
bytes of msgpack header, a round's patch of it as 148, a heartbeat's as 68
(``tests/test_patches.py``; digests as 32 bytes, ``records.wire_digest``).

Wire form. Every push of ``net.records.pushes.Pusher`` names its value by the pusher's change counter,
``"_v"`` (an int). A peer that acknowledged value ``b`` gets ``{"_v": v, "_b": b, "_p":
patch}`` instead of the value; the receiver applies ``patch`` to the value it holds from that
author if, and only if, that value is ``b`` (:meth:`Received.expand`), and otherwise answers
``{"resend": true}``, upon which the pusher sends the whole value at once. A receiver that
restarted, forgot the author (``MAX_KEPT`` authors) or missed a push thus costs one round trip
more, never a wrong value. What a patch gives is parsed by its owner exactly as a whole value
(``records.parse_heads``, ``records.parse_gathering``): the patch itself is checked here, at one
boundary.

A patch of map ``old`` into ``new`` (:func:`patch_of`) is a map of at most four entries:
``"s"``, the keys set (whole new values); ``"e"``, per key of a list of the same length in
both, the changed elements as ``[index, new element]`` pairs; ``"n"``, per key of a map in
both, that map's own patch (one level deep at most, ``MAX_DEPTH``); ``"x"``, the keys removed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from p2pdiloco.errors import ProtocolError
from p2pdiloco.net.transport import framing

__all__ = ["MAX_DEPTH", "MAX_KEPT", "MAX_KEPT_BYTES", "Received", "apply_patch", "keepable", "patch_of"]

MAX_DEPTH = 1  # maps within maps a patch may reach into
MAX_KEPT = 1024  # authors whose last value a receiver keeps as a base (the least recent go first)
MAX_KEPT_BYTES = 8 << 10  # bytes (msgpack) of a value kept as a base at most; a larger one is not kept (and
# pushed whole: keepable), so that the bases of MAX_KEPT authors take MAX_KEPT_BYTES each at most, as sent
_ENVELOPE = ("_v", "_b", "_p", "hello")  # keys of the push, not of the value
_MISSING = object()


def patch_of(old: dict[str, Any], new: dict[str, Any], depth: int = MAX_DEPTH) -> dict[str, Any]:
    """The patch that turns map ``old`` into map ``new`` (:func:`apply_patch`; module docstring).
    A list of which more than half the elements changed is set whole."""
    s: dict[str, Any] = {}
    e: dict[str, list] = {}
    n: dict[str, dict] = {}
    for k, v in new.items():
        o = old.get(k, _MISSING)
        if o == v:
            continue
        if depth > 0 and isinstance(o, dict) and isinstance(v, dict):
            n[k] = patch_of(o, v, depth - 1)
        elif isinstance(o, (list, tuple)) and isinstance(v, (list, tuple)) and len(o) == len(v):
            changed = [[i, x] for i, (a, x) in enumerate(zip(o, v)) if a != x]
            if 2 * len(changed) <= len(v):
                e[k] = changed
            else:
                s[k] = v
        else:
            s[k] = v
    x = [k for k in old if k not in new]
    return {name: part for name, part in (("s", s), ("e", e), ("n", n), ("x", x)) if part}


def apply_patch(old: dict[str, Any], patch: Any, depth: int = MAX_DEPTH) -> dict[str, Any]:
    """``old`` with ``patch`` applied (a new map; ``old`` is left as it is).

    Raises:
        ProtocolError: ``patch`` is not a patch of ``old`` (a part that is not a map, a key that
            is not a string, an element of a list ``old`` lacks, a map deeper than ``MAX_DEPTH``).
    """
    if not isinstance(patch, dict) or not set(patch) <= {"s", "e", "n", "x"}:
        raise ProtocolError("a patch is a map of s, e, n and x")
    s, e, n, x = (patch.get(name, {} if name != "x" else []) for name in ("s", "e", "n", "x"))
    if not (isinstance(s, dict) and isinstance(e, dict) and isinstance(n, dict) and isinstance(x, list)):
        raise ProtocolError("a patch's parts are maps (s, e, n) and a list (x)")
    out = dict(old)
    for k in x:
        if not isinstance(k, str) or k not in out:
            raise ProtocolError("a patch removes a key the value lacks")
        del out[k]
    out.update(s)
    for k, changes in e.items():
        base = out.get(k)
        if not isinstance(base, (list, tuple)) or not isinstance(changes, list):
            raise ProtocolError("a patch changes elements of what is not a list")
        elements = list(base)
        for change in changes:
            if not (isinstance(change, list) and len(change) == 2 and type(change[0]) is int
                    and 0 <= change[0] < len(elements)):
                raise ProtocolError("a patch changes an element the list lacks")
            elements[change[0]] = change[1]
        out[k] = elements
    for k, sub in n.items():
        if depth <= 0 or not isinstance(out.get(k), dict):
            raise ProtocolError("a patch reaches into what is not a map, or too deep")
        out[k] = apply_patch(out[k], sub, depth - 1)
    return out


def keepable(value: dict[str, Any]) -> bool:
    """Whether a receiver keeps ``value`` (a pushed value, without the push's own keys) as a
    base: at most ``MAX_KEPT_BYTES`` of msgpack. A pusher sends a larger value whole, always: a
    patch of it would only be answered with ``{"resend": true}``."""
    return len(framing.pack(value)) <= MAX_KEPT_BYTES


class Received:
    """The last value each author pushed us under a change counter: the bases its patches
    apply to (module docstring). One per pushed RPC, owned by its handler's owner.

    Args:
        drop: called with (peer, reason) for a malformed patch (``Swarm.drop``: counted).
    """

    def __init__(self, drop: Callable[[str, str], None]):
        self._drop = drop
        self._kept: OrderedDict[str, tuple[int, bytes]] = OrderedDict()  # author -> (counter, value as msgpack)
        self.patches = 0  # patches expanded
        self.resends = 0  # patches answered with "resend" (no base, or another one)

    def expand(self, peer: str, header: dict[str, Any]) -> dict[str, Any] | None:
        """The whole value a push of ``peer`` carries: ``header`` itself when it is whole, the
        patched base when it is a patch of the base we hold, None when we hold another base or
        none (answer ``{"resend": True}``).

        Raises:
            ProtocolError: a malformed patch (dropped and counted as ``push_patch``).
        """
        if "_p" not in header:
            return header
        base, version = header.get("_b"), header.get("_v")
        if type(base) is not int or type(version) is not int:
            self._drop(peer, "push_patch")
            raise ProtocolError("a patch names its base and value by ints")
        held = self._kept.get(peer)
        if held is None or held[0] != base:
            self.resends += 1
            return None
        try:
            value = apply_patch(framing.unpack(held[1]), header["_p"])
        except ProtocolError:
            self._drop(peer, "push_patch")
            raise
        self.patches += 1
        return dict(value, _v=version)

    def keep(self, peer: str, header: dict[str, Any]) -> None:
        """Keep ``header``, a whole value of ``peer`` its owner parsed and took, as the base of
        ``peer``'s next patch (when it has a change counter and is at most ``MAX_KEPT_BYTES``).
        It is kept as msgpack, the size it came in: decoded, a hostile value of many small
        parts that its owner's parser never reads takes tens of times more memory."""
        version = header.get("_v")
        self._kept.pop(peer, None)
        packed = framing.pack({k: v for k, v in header.items() if k not in _ENVELOPE})
        if type(version) is not int or len(packed) > MAX_KEPT_BYTES:
            return
        self._kept[peer] = (version, packed)
        while len(self._kept) > MAX_KEPT:
            self._kept.popitem(last=False)
