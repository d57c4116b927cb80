"""Admission to a swarm: before a node takes part, it asks owners of the swarm's records
whether they accept it (``trust.hello``, answered by every node's :class:`~p2pdiloco.net.transport.swarm.Swarm`
with its swarm's name, or refused with AccessDenied by a private swarm's members when the
node has no valid certificate: docs/trust.md). A node accepts an answer to its own call only
from a member of its swarm (:func:`check_answer`)."""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING

from p2pdiloco.errors import NetworkError, ProtocolError
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


def check_answer(swarm: Swarm, peer_id: str, name: str, reply: dict) -> None:
    """Accept ``peer_id``'s answer ``reply`` (its header) to our call ``name``
    (``Swarm.call``): not a refusal, and from a member of ``swarm``'s swarm (its ``_cert``,
    popped from ``reply``, checked by ``swarm.membership``; a dropped answer counted in
    ``swarm.refused``).

    Raises:
        AccessDenied: the peer refused us, or its answer is dropped (not a member).
        ProtocolError: the peer answered with an error.
    """
    if "error" in reply:
        if "denied" in reply:
            raise AccessDenied(f"{peer_id[-8:]} refused {name}: {reply['error']}", str(reply["denied"]))
        raise ProtocolError(f"{peer_id[-8:]} refused {name}: {reply['error']}")
    cert = reply.pop("_cert", None)
    try:
        if cert is not None and not isinstance(cert, bytes):
            raise AccessDenied("its _cert is not bytes", "malformed")
        swarm.membership.check(peer_id, cert)
    except AccessDenied as e:
        swarm.refused[e.reason] += 1
        raise AccessDenied(f"answer of {peer_id[-8:]} to {name} dropped: {e}", e.reason) from None
