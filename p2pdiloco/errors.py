"""The one exception hierarchy of p2pdiloco.

Foreign errors (hivemind, libp2p daemon, OS, TOML, msgpack) are translated into these at
the boundary where they occur, so callers catch ``P2PDilocoError`` and nothing else.
"""

from __future__ import annotations


class P2PDilocoError(Exception):
    """Base class of every error this project raises on purpose."""


class ConfigError(P2PDilocoError):
    """A config file, environment variable or flag is malformed or out of range."""


class AddressError(ConfigError):
    """A multiaddr is malformed or cannot be used (wrong protocol, missing /p2p/, port 0...)."""


class NetworkError(P2PDilocoError):
    """A network operation failed: daemon start, DHT access, an RPC or its deadline."""


class PeerUnreachable(NetworkError):
    """A specific peer did not answer before its deadline."""


class PeerTimeout(PeerUnreachable):
    """A specific peer did not answer in full before its deadline (as opposed to a broken or
    refused connection): the peer is there but slow, stopped, or stalling on purpose."""


class PeerSilent(PeerTimeout):
    """A peer did not begin its answer (the reply's header) within the call's first-reply
    deadline, which is shorter than the whole call's: nothing came back at all."""


class ClockSkewError(NetworkError):
    """This machine's clock is too far from its peers' for the swarm's records to work
    (``p2pdiloco.net.transport.clock``); ``offset_s``: the swarm's time minus this machine's, seconds."""

    def __init__(self, message: str, offset_s: float):
        super().__init__(message)
        self.offset_s = offset_s


class ProtocolError(NetworkError):
    """A peer sent a message that does not follow the wire protocol; the message is dropped."""


class ReplyTooLarge(ProtocolError):
    """A peer's reply declared more payload bytes than the call accepts (its ``max_reply``)."""


class RoundFailed(P2PDilocoError):
    """An outer round could not complete on every member; its result is discarded (invariant I2)."""


class StateSyncError(P2PDilocoError):
    """Downloading the global state from a peer failed or did not match the swarm's records."""
