"""The key and certificate files of private swarms (``p2pdiloco/trust/certificates.py`` says
their layout): public keys as hex or peer IDs, fingerprints, private key files (mode 0600) and
text files of comment lines and one base64 line."""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path

from p2pdiloco.trust.errors import CertificateError
from p2pdiloco.trust.identity import public_key_of


def fingerprint(public_key: bytes) -> str:
    """Short name of a swarm key: the first 16 hex digits of its sha256."""
    return hashlib.sha256(public_key).hexdigest()[:16]


def hex_key(text: str) -> bytes | None:
    """32 bytes from exactly 64 hex digits, else None."""
    if len(text) != 64:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return None


def parse_public_key(text: str) -> bytes:
    """A raw Ed25519 public key from 64 hex digits or from a peer ID ("12D3KooW...").

    Raises:
        CertificateError: neither form (reason ``malformed``).
    """
    text = text.strip()
    if (key := hex_key(text)) is not None:
        return key
    try:
        return public_key_of(text)
    except ValueError:
        pass
    raise CertificateError(f"{text[:70]!r} is not a public key: give 64 hex digits or a node's peer ID "
                           "(12D3KooW..., printed by `p2pdiloco swarm identity`)", "malformed")


def iso_time(t: float) -> str:
    """Unix seconds as a UTC date and time, for the comment lines of key and certificate files."""
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def write_private(path: Path, data: bytes) -> None:
    """Write a new private key file (mode 0600, never over an existing one; OSError if it exists)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: Path, comments: Iterable[str], data: bytes) -> None:
    """Write ``#`` comment lines and one base64 line of ``data``, atomically (a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text("".join(f"# {c}\n" for c in comments) + base64.b64encode(data).decode() + "\n")
    tmp.replace(path)


def read_text(path: Path, what: str) -> bytes:
    """The bytes of a file :func:`write_text` wrote. Raises CertificateError: missing, unreadable, not base64."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise CertificateError(f"{what} file {path} does not exist", "missing") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CertificateError(f"{what} file {path} cannot be read: {e}", "malformed") from None
    body = "".join(line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#"))
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise CertificateError(f"{what} file {path} is not base64 text", "malformed") from None


def decode_swarm_key(text: str) -> bytes:
    """The swarm public key from ``trust.swarm_key``: 64 hex digits, or a path to ``swarm.pub``.

    Raises:
        CertificateError: neither.
    """
    text = text.strip()
    if (key := hex_key(text)) is not None:
        return key
    path = Path(text).expanduser()
    if path.is_file() and path.stat().st_size < 200 and (key := hex_key(path.read_text().strip())) is not None:
        return key
    raise CertificateError(f"trust.swarm_key {text[:70]!r}: expected the swarm's public key (64 hex digits, "
                           "printed by `p2pdiloco swarm init`) or the path of its swarm.pub", "malformed")
