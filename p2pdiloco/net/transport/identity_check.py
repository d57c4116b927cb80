"""Whether an identity is already running in the swarm: a node that starts with the identity
file of a running node would steal its connections (``Swarm.start`` checks with
:func:`own_identity`, which asks :func:`identity_in_use` through a throwaway daemon).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from hivemind.p2p import P2P, PeerID

from p2pdiloco.net.transport.daemon import private_sockets
from p2pdiloco.net.transport.framing import close_stream, short_error
from p2pdiloco.trust.errors import IdentityError
from p2pdiloco.trust.identity import Identity

log = logging.getLogger(__name__)


async def identity_in_use(peer_id: str, initial_peers: Sequence[str], timeout: float = 8.0) -> bool:
    """Whether a running peer reachable through ``initial_peers`` already has ``peer_id``.

    Starts a throwaway daemon with a random identity and asks libp2p's routing for the peer:
    a connection that fails only at protocol negotiation means the peer is up ("routing:
    not found" or a dial failure means it is not; see :func:`probe_verdict`). While the
    throwaway daemon has no peer in its routing table yet, the answer says nothing, so it asks
    again until ``timeout`` seconds. The throwaway daemon is always shut down. Any failure of
    the check itself counts as "not in use" (logged).
    """
    probe = None
    try:
        with private_sockets():
            probe = await P2P.create(initial_peers=list(initial_peers), dht_mode="client", startup_timeout=15,
                                     check_if_identity_free=False)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    try:
                        _, _, writer = await probe.call_binary_stream_handler(PeerID.from_base58(peer_id),
                                                                              "p2pdiloco.identity-probe")
                        close_stream(writer)
                        return True  # nobody serves this name, but an answer means someone is there
                    except Exception as e:
                        verdict = probe_verdict(str(e))
                        if verdict is not None:
                            return verdict
                    await asyncio.sleep(0.2)
        except TimeoutError:
            log.info("could not check whether identity %s is in use: no answer within %g s", peer_id[-8:], timeout)
            return False
    except Exception as e:
        log.info("could not check whether identity %s is in use: %s", peer_id[-8:], short_error(e))
        return False
    finally:
        if probe is not None:
            try:
                await asyncio.wait_for(probe.shutdown(), 10)
            except Exception as e:
                log.debug("probe shutdown: %s", e)


async def own_identity(identity: Identity | None, identity_path: str | None, initial_peers: Sequence[str]) -> Identity:
    """The identity a node starts p2pd with (``Swarm.start``): ``identity``, else the one loaded
    from (or created at) ``identity_path``, else a new one held in memory. Raises
    IdentityError: the file is unusable, or (one loaded from an existing file) a running peer
    of the swarm already uses it (:func:`identity_in_use`, through ``initial_peers``)."""
    if identity is None:
        identity = Identity.load_or_create(identity_path)[0] if identity_path else Identity.generate()
    if identity.path is not None and not identity.created and initial_peers:
        if await identity_in_use(identity.peer_id, initial_peers):
            raise IdentityError(
                f"identity {identity.path} (peer ID {identity.peer_id}) is already used by a running node of "
                "this swarm; a second node with the same identity would steal its connections. Stop the "
                "other node, or give this one its own --data-dir (or trust.identity) to get a new identity")
    return identity


def probe_verdict(error: str) -> bool | None:
    """What a failed dial of the identity probe says: True (the peer is up: only the protocol
    was refused), False (it is not: "routing: not found", or every dial failed), None (nothing
    yet: the probe's routing table is still empty, seen when the check ran right after the
    probe daemon started on a loaded machine)."""
    text = error.lower()
    if "protocol" in text and "not supported" in text:
        return True
    if "failed to find any peer in table" in text:
        return None
    return False
