"""Trust: node identities, signed updates and records, private swarms, robust merging.

See docs/trust.md. This package holds the keys, certificates and signature layouts and
imports no networking code; ``p2pdiloco.net`` applies them to the DHT and the RPCs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pdiloco.trust.certificates import Certificate, Membership, RevocationList, SwarmKey, decode_swarm_key
from p2pdiloco.trust.errors import AccessDenied, CertificateError, IdentityError, TrustError
from p2pdiloco.trust.identity import Identity, is_peer_id, peer_id_of, public_key_of

__all__ = ["AccessDenied", "Certificate", "CertificateError", "Identity", "IdentityError", "Membership",
           "NodeTrust", "RevocationList", "SwarmKey", "TrustError", "is_peer_id", "load_node_trust",
           "peer_id_of", "public_key_of", "IDENTITY_FILE", "CERTIFICATE_FILE"]

IDENTITY_FILE = "p2p.key"  # in the data dir: the Ed25519 key, also p2pd's identity
CERTIFICATE_FILE = "member.cert"  # in the data dir: this node's membership certificate


@dataclass(frozen=True)
class NodeTrust:
    """What a node needs from the trust layer to start its swarm."""

    identity: Identity
    membership: Membership


def load_node_trust(cfg: Any, data_dir: Path | None) -> NodeTrust:
    """Load (or create) the node's identity and its membership from ``cfg`` (``[trust]``).

    Identity: ``cfg.identity``, else ``{data_dir}/p2p.key``, else a key held only in memory.
    Private swarm when ``cfg.swarm_key`` is set: the certificate from ``cfg.certificate``,
    else ``{data_dir}/member.cert``, and the revocation list from ``cfg.revocations``.

    Raises:
        IdentityError: the identity file is unusable.
        CertificateError: private swarm, and this node's own certificate is missing, expired,
            revoked or for another swarm or key; the message says what to ask the owner for.
    """
    path = Path(cfg.identity).expanduser() if cfg.identity else (Path(data_dir) / IDENTITY_FILE if data_dir else None)
    identity = Identity.load_or_create(path)[0] if path is not None else Identity.generate()
    if not cfg.swarm_key:
        return NodeTrust(identity, Membership())
    swarm = decode_swarm_key(cfg.swarm_key)
    cert_path = Path(cfg.certificate).expanduser() if cfg.certificate else (
        Path(data_dir) / CERTIFICATE_FILE if data_dir else None)
    cert = None
    if cert_path is not None and cert_path.exists():
        cert = Certificate.load(cert_path)
    revocations = RevocationList.load(Path(cfg.revocations).expanduser(), swarm) if cfg.revocations else None
    membership = Membership(swarm, cert, revocations)
    if cert is None:
        where = f" at {cert_path}" if cert_path else " (set trust.certificate)"
        raise CertificateError(f"this node is not a member of {membership.name}: no membership certificate{where}. "
                               f"Its public key is its peer ID {identity.peer_id}; ask the swarm owner to run "
                               f"`p2pdiloco swarm admit {identity.peer_id}` and put the certificate there",
                               "missing")
    try:
        membership.check_own(identity.peer_id)
    except CertificateError as e:
        raise CertificateError(f"this node cannot join {membership.name}: {e}", e.reason) from None
    return NodeTrust(identity, membership)
