"""Validation of multiaddrs given by users, with one clear line per mistake."""

from __future__ import annotations

from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from p2pdiloco.errors import AddressError

_HOSTS = ("ip4", "ip6", "dns", "dns4", "dns6")
_EXAMPLE = "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW..."


def _parse(text: str, what: str) -> Multiaddr:
    if not isinstance(text, str) or not text.strip():
        raise AddressError(f"{what}: empty multiaddr")
    if any(c.isspace() for c in text):
        raise AddressError(f"{what} {text!r}: multiaddrs contain no spaces (use one flag or comma per address)")
    if not text.startswith("/"):
        raise AddressError(f"{what} {text!r}: a multiaddr starts with '/', for example {_EXAMPLE}")
    try:
        maddr = Multiaddr(text)
        protocols = [p.name for p in maddr.protocols()]
    except Exception as e:  # the multiaddr package raises several types
        raise AddressError(f"{what} {text!r} is not a valid multiaddr: {e}") from None
    if not protocols or protocols[0] not in _HOSTS:
        raise AddressError(f"{what} {text!r}: must start with one of /{', /'.join(_HOSTS)}")
    if "tcp" not in protocols and "udp" not in protocols:
        raise AddressError(f"{what} {text!r}: needs a /tcp/PORT or /udp/PORT/quic part")
    port = maddr.value_for_protocol("tcp" if "tcp" in protocols else "udp")
    if int(port) == 0:
        raise AddressError(f"{what} {text!r}: port 0 cannot be dialed; give the real port")
    return maddr


def check_peer_maddr(text: str) -> str:
    """Validate a peer's full multiaddr (host, port and /p2p/PEER_ID); returns it unchanged.

    Raises:
        AddressError: with the reason and an example of a valid address.
    """
    maddr = _parse(text, "initial peer")
    if "p2p" not in [p.name for p in maddr.protocols()]:
        raise AddressError(f"initial peer {text!r}: missing the /p2p/PEER_ID part (copy the whole "
                           f"address the bootstrap peer printed, for example {_EXAMPLE})")
    try:
        PeerID.from_base58(maddr.value_for_protocol("p2p"))
    except Exception:
        raise AddressError(f"initial peer {text!r}: the /p2p/ part is not a valid peer ID") from None
    return text


def check_announce_maddr(text: str) -> str:
    """Validate an address to announce (host and a non-zero port; /p2p/ optional)."""
    _parse(text, "announce address")
    return text
