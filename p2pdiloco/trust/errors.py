"""Errors of the trust layer; all are :class:`p2pdiloco.errors.P2PDilocoError`, so the CLI
prints them as one ``p2pdiloco: ...`` line."""

from __future__ import annotations

from p2pdiloco.errors import ConfigError, P2PDilocoError, ProtocolError


class TrustError(P2PDilocoError):
    """Base class: a key, certificate, signature or membership check failed."""


class IdentityError(TrustError, ConfigError):
    """The node's identity file is missing, unreadable, exposed or malformed, or the identity
    is already used by a running node."""


class CertificateError(TrustError, ConfigError):
    """A membership certificate, swarm key or revocation list is invalid for this swarm.

    Attributes:
        reason: one word for counting: ``missing``, ``malformed``, ``wrong_swarm``,
            ``wrong_member``, ``bad_signature``, ``not_yet_valid``, ``expired``, ``revoked``.
    """

    def __init__(self, message: str, reason: str = "invalid"):
        super().__init__(message)
        self.reason = reason


class AccessDenied(TrustError, ProtocolError):
    """A private swarm's member refused us (or we refused a peer): not a member, expired or
    revoked certificate. A :class:`ProtocolError`, so callers that drop bad peers drop it.

    Attributes:
        reason: as :class:`CertificateError`'s, or ``not_member`` when unknown.
    """

    def __init__(self, message: str, reason: str = "not_member"):
        super().__init__(message)
        self.reason = reason
