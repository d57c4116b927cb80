"""The heads rule: which state of each fragment the swarm holds, from the peers' records.

Readers pick, per fragment, the newest version; at a version held with two digests (two
groups merged the same version: split brain, invariant I7) the digest held by more peers wins,
ties to the smaller digest, so every node resolves it the same way and the losers re-sync.
Records are signed (``net.records.signed``), but a signature proves who claims a state, not
that the claim is honest, so a claim has to be earned (docs/trust.md):

* **Corroborated versions.** A version counts only up to ``LEAD`` versions above the larger
  of this node's own version and the highest version that at least two *other* peers hold
  (:func:`claim_ceiling`), once at least two other peers publish a claim for the fragment.
  One peer claiming a billion versions ahead is looked past (and, more than ``ROLLBACK_MAX``
  above, its whole record ignored for ``IGNORE_S`` seconds); an honest node that committed a
  round others have not followed yet is within the lead. With a single other peer nothing can be corroborated and its claim
  counts. The converse case, this node ahead alone (lone rounds while the others were busy,
  so they look past it), falls back to the newest state two other peers hold, at most
  ``ROLLBACK_MAX`` versions lower (:func:`runaway_heads`), as a split brain's losing side does.
* **Whose records count** is not decided here: identities are free, so counting holders
  decides nothing. The node passes only the records of itself and the peers it trusts
  (``node.vetting.trusted_records``; docs/trust.md, "Earned claims"). ``min_holders`` of
  :func:`newest_heads` is kept for callers that want it; the node no longer uses it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from p2pdiloco.core.outer import FragmentState
from p2pdiloco.errors import ProtocolError
from p2pdiloco.net.records import parse as rec
from p2pdiloco.net.records.parse import HeadsRecord

LEAD = 1  # versions a claim may run ahead of the highest version two other peers hold
ROLLBACK_MAX = 8  # versions a node ahead alone falls back at most (runaway_heads)


@dataclass(frozen=True)
class Head:
    """The swarm's newest state of one fragment, and who holds it."""

    version: int
    digest: str
    holders: tuple[str, ...]


def _as_record(value: Any, num_fragments: int) -> HeadsRecord | None:
    if isinstance(value, HeadsRecord):
        return value if len(value.fragments) == num_fragments else None
    try:
        return rec.parse_heads(value, num_fragments)
    except ProtocolError:
        return None


def claim_ceiling(versions: Mapping[str, int], me: str | None, mine: int | None) -> float:
    """The highest version of one fragment this node counts as corroborated: ``LEAD`` above
    the larger of its own version (``mine``, else ``me``'s claim in ``versions``) and the
    second-highest version among the other peers' claims; unbounded with fewer than two
    other claims (nothing to corroborate with). ``versions``: {peer: claimed version}."""
    others = sorted((v for p, v in versions.items() if p != me), reverse=True)
    if len(others) < 2:
        return math.inf
    own = mine if mine is not None else versions.get(me, -1) if me is not None else -1
    return max(others[1], own) + LEAD


def newest_heads(records: Mapping[str, HeadsRecord | dict], num_fragments: int, *, me: str | None = None,
                 mine: Sequence[int] | None = None, min_holders: int = 1) -> list[Head | None]:
    """Per fragment, the winning (version, digest) among peers' records and its holders.

    Rule (invariant I7): highest version; at equal versions, most holders, then the smaller
    digest. Records that do not parse (raw dicts are parsed here) are ignored.
    Corroboration (module docstring): claims above :func:`claim_ceiling` (``me``: this
    node's peer ID, ``mine``: its own versions) are ignored; with ``min_holders`` > 1 (a
    joining node), states held by fewer peers are ignored too, where at least that many other
    peers claim one.
    """
    parsed = {p: r for p, v in records.items() if (r := _as_record(v, num_fragments)) is not None}
    heads: list[Head | None] = []
    for f in range(num_fragments):
        claims = {p: r.fragments[f] for p, r in parsed.items() if r.fragments[f] is not None}
        ceiling = claim_ceiling({p: c[0] for p, c in claims.items()}, me, mine[f] if mine is not None else None)
        votes: dict[tuple[int, str], list[str]] = {}
        for p, claim in claims.items():
            if claim[0] <= ceiling:
                votes.setdefault(claim, []).append(p)
        others = sum(p != me for p in claims)
        if min_holders > 1 and others >= min_holders:
            votes = {k: h for k, h in votes.items() if len(h) >= min_holders} or votes
        heads.append(_winner(votes))
    return heads


def runaway_heads(records: Mapping[str, HeadsRecord], states: Sequence[FragmentState], me: str) -> list[Head | None]:
    """Per fragment, the state this node should fall back to because it is ahead alone, else
    None. A node whose version is more than ``LEAD`` above the second-highest version of the
    other peers (two or more of them) made its last versions without anyone corroborating them
    (lone rounds while the others were busy): the others look past its claims, and it would
    merge alone forever. It then takes the newest state at least two other peers hold, at most
    ``ROLLBACK_MAX`` versions below its own (a lower state is not a fallback but a stale or
    hostile claim), as the losing side of a split brain does (invariant I7)."""
    out: list[Head | None] = []
    for f, mine in enumerate(states):
        claims = {p: r.fragments[f] for p, r in records.items() if p != me and r.fragments[f] is not None}
        versions = sorted((c[0] for c in claims.values()), reverse=True)
        if len(versions) < 2 or mine.version <= versions[1] + LEAD:
            out.append(None)
            continue
        votes: dict[tuple[int, str], list[str]] = {}
        for p, claim in claims.items():
            if mine.version - ROLLBACK_MAX <= claim[0] <= versions[1]:
                votes.setdefault(claim, []).append(p)
        out.append(_winner({k: h for k, h in votes.items() if len(h) >= 2}))
    return out


def _winner(votes: dict[tuple[int, str], list[str]]) -> Head | None:
    """The heads rule's choice among (version, digest) -> holders: highest version, then most
    holders, then the smaller digest (invariant I7); None without votes."""
    if not votes:
        return None
    (version, digest), holders = max(votes.items(), key=lambda kv: (kv[0][0], len(kv[1]), _neg(kv[0][1])))
    return Head(version, digest, tuple(sorted(holders)))


def _neg(digest: str) -> tuple[int, ...]:
    return tuple(-ord(c) for c in digest)


def is_behind(mine: FragmentState, head: Head | None) -> bool:
    """True when ``head`` should replace ``mine`` (newer version, or same version, other digest)."""
    if head is None:
        return False
    return head.version > mine.version or (head.version == mine.version and head.digest != mine.digest)
