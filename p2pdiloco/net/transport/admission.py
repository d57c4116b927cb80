"""Admission to a swarm: before a node takes part, it asks owners of the swarm's records
whether they accept it (``trust.hello``, answered by every node's :class:`~p2pdiloco.net.transport.swarm.Swarm`
with its swarm's name, or refused with AccessDenied by a private swarm's members when the
node has no valid certificate: docs/trust.md)."""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING

from p2pdiloco.errors import NetworkError
from p2pdiloco.trust.errors import AccessDenied
from p2pdiloco.trust.identity import is_peer_id

if TYPE_CHECKING:
    from p2pdiloco.net.transport.swarm import Swarm

log = logging.getLogger(__name__)


async def check_admission(swarm: Swarm, key: str, tries: int = 3) -> None:
    """Ask up to ``tries`` owners of records under ``key`` (random order) whether they accept
    ``swarm``'s node (``Swarm.hello``). Returns at the first acceptance (``swarm.admitted`` is
    then set), when nobody published a record or answered, or at once when an earlier check
    passed.

    Raises:
        AccessDenied: every peer that answered refused us (for instance: this node has no
            valid certificate of the private swarm those peers belong to).
    """
    if swarm.admitted:
        return
    try:
        peers = [p for p in await swarm.get(key) if is_peer_id(p) and p != swarm.peer_id]
    except NetworkError:
        return
    random.shuffle(peers)
    refusal: AccessDenied | None = None
    for peer in peers[:tries]:
        try:
            await swarm.hello(peer)
            swarm.admitted = True
            return
        except AccessDenied as e:
            refusal = e
        except NetworkError as e:
            log.debug("hello to %s: %s", peer[-8:], e)
    if refusal is not None:
        raise AccessDenied(f"the swarm refused this node ({swarm.peer_id}): {refusal}", refusal.reason)
