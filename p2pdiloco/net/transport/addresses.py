"""Checks of the addresses a user gives, each failing with one line that names the mistake.

- :func:`check_peer_maddr` / :func:`check_announce_maddr`: the text of a multiaddr (host
  protocol, port, peer ID), before anything is started.
- :func:`check_listen_port` and :func:`check_any_reachable`: the two preflight checks run
  before the libp2p daemon starts (port already taken; every initial peer offline), so these
  common mistakes end with a clear line instead of a daemon start-up log.

hivemind is imported only when a multiaddr is parsed: importing it takes over a second
(it loads torch and its averager), which every command that never reads an address would
otherwise pay.
"""

from __future__ import annotations

import errno
import ipaddress
import re
import socket
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from p2pdiloco.errors import AddressError, NetworkError

_HOSTS = ("ip4", "ip6", "dns", "dns4", "dns6")
_EXAMPLE = "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW..."
NEW_SWARM_HINT = ("to start a new swarm instead, run `p2pdiloco bootstrap` and pass the multiaddr it "
                  "prints to --initial-peers")
# for a node joining an existing run (--join): its peers come from the run's manifest
JOIN_HINT = ("the run's nodes are not reachable: check with the run's owner that the run is still going, or that "
             "this machine's network lets it reach them")


def _components(text: str) -> list[str]:
    return text.strip("/").split("/")


def _check_parts(text: str, what: str) -> None:
    """Checks the multiaddr library reports poorly: host protocol, ports, peer IDs."""
    parts = _components(text)
    if parts[0] not in _HOSTS:
        raise AddressError(f"{what} {text!r}: /{parts[0]} is not a host protocol; a multiaddr starts with "
                           f"one of /{', /'.join(_HOSTS)}, for example {_EXAMPLE}")
    if len(parts) < 2 or not parts[1]:
        raise AddressError(f"{what} {text!r}: /{parts[0]} needs a host after it, for example {_EXAMPLE}")
    host = parts[1]
    if parts[0] in ("ip4", "ip6"):
        try:
            ip = ipaddress.IPv4Address(host) if parts[0] == "ip4" else ipaddress.IPv6Address(host)
        except ValueError:
            raise AddressError(f"{what} {text!r}: {host!r} is not an IPv{parts[0][-1]} address") from None
        if ip.is_unspecified:
            raise AddressError(f"{what} {text!r}: {host} means 'every interface' and cannot be dialed; "
                               "give this machine's real IP address")
    for i, name in enumerate(parts):
        value = parts[i + 1] if i + 1 < len(parts) else ""
        if name in ("tcp", "udp") and i >= 2:
            if not value.isdigit() or not 0 <= int(value) <= 65535:
                raise AddressError(f"{what} {text!r}: /{name}/ needs a port number in 1..65535, got {value!r}")
            if int(value) == 0:
                raise AddressError(f"{what} {text!r}: port 0 cannot be dialed; give the real port")
        if name in ("p2p", "ipfs") and i >= 2 and not _is_peer_id(value):
            raise AddressError(f"{what} {text!r}: {value!r} after /{name}/ is not a valid peer ID (copy the whole "
                               f"address the bootstrap peer printed, for example {_EXAMPLE})")


def _is_peer_id(text: str) -> bool:
    """True for a base58 peer ID whose multihash is consistent (Qm..., 12D3KooW...)."""
    from hivemind.p2p import PeerID  # noqa: PLC0415  (slow import, see the module docstring)
    from hivemind.utils.multiaddr import Multiaddr  # noqa: PLC0415

    try:
        Multiaddr(f"/p2p/{text}")  # checks the multihash; PeerID.from_base58 only decodes base58
        PeerID.from_base58(text)
    except Exception:  # base58, multihash and multiaddr raise several unrelated types
        return False
    return True


def _parse(text: str, what: str):
    """Returns the parsed ``Multiaddr``; AddressError with the reason otherwise."""
    if not isinstance(text, str) or not text.strip():
        raise AddressError(f"{what}: empty multiaddr")
    if any(c.isspace() for c in text):
        raise AddressError(f"{what} {text!r}: multiaddrs contain no spaces (use one flag or comma per address)")
    if not text.startswith("/"):
        raise AddressError(f"{what} {text!r}: a multiaddr starts with '/', for example {_EXAMPLE}")
    _check_parts(text, what)
    from hivemind.utils.multiaddr import Multiaddr  # noqa: PLC0415  (slow import, see the module docstring)

    try:
        maddr = Multiaddr(text)
        protocols = [p.name for p in maddr.protocols()]
    except Exception as e:  # the multiaddr package raises several types
        reason = re.sub(r"^Invalid MultiAddr '.*?':? ?", "", str(e)) or type(e).__name__
        raise AddressError(f"{what} {text!r} is not a valid multiaddr: {reason}") from None
    if "tcp" not in protocols and "udp" not in protocols:
        raise AddressError(f"{what} {text!r}: needs a /tcp/PORT or /udp/PORT/quic-v1 part")
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
    return text


def check_announce_maddr(text: str) -> str:
    """Validate an address to announce (host and a non-zero port; /p2p/ optional)."""
    _parse(text, "announce address")
    return text


def check_listen_port(host: str, port: int) -> None:
    """Fail fast when this machine cannot listen on ``host``:``port`` (TCP; port 0 always can).

    The probe binds with SO_REUSEADDR, as the daemon does, so a port in TIME_WAIT passes and
    a port another process listens on does not.

    Raises:
        NetworkError: the port is taken, privileged, or ``host`` is not an address of this machine.
    """
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise NetworkError(f"port {port} on {host} is already in use (another bootstrap peer or node?); "
                                   "choose another --port, or --port 0 for any free port") from None
            if e.errno == errno.EADDRNOTAVAIL:
                raise NetworkError(f"cannot listen on {host}: not an address of this machine; "
                                   "use --host 0.0.0.0 to listen on every interface") from None
            if e.errno == errno.EACCES:
                raise NetworkError(f"port {port} needs administrator rights; choose a port above 1023") from None
            raise NetworkError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _tcp_endpoint(text: str) -> tuple[str, int] | None:
    """(host, port) of a /ip4|ip6|dns*/HOST/tcp/PORT address; None for any other transport."""
    parts = _components(text)
    if len(parts) >= 4 and parts[0] in _HOSTS and parts[2] == "tcp" and parts[3].isdigit():
        return parts[1], int(parts[3])
    return None


def _probe(endpoint: tuple[str, int], timeout: float) -> str | None:
    """None when a TCP connection to ``endpoint`` opens; otherwise why not."""
    try:
        with socket.create_connection(endpoint, timeout=timeout):
            return None
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as e:
        return e.strerror or str(e) or type(e).__name__


def check_any_reachable(maddrs: Sequence[str], timeout: float = 5.0, hint: str = "") -> None:
    """Fail fast when not one of the initial peers accepts a TCP connection.

    Only decides when every address is a TCP one (QUIC and others cannot be probed this way;
    then the daemon's own bootstrap decides). Probes run concurrently, ``timeout`` seconds each.

    Raises:
        NetworkError: naming each address with its reason, and ``hint`` (default: check the
            addresses, or how to start a new swarm; :data:`JOIN_HINT` for a node joining a run).
    """
    endpoints = [_tcp_endpoint(m) for m in maddrs]
    if not maddrs or any(e is None for e in endpoints):
        return
    with ThreadPoolExecutor(max_workers=min(16, len(endpoints))) as pool:
        reasons = list(pool.map(lambda e: _probe(e, timeout), endpoints))
    if any(r is None for r in reasons):
        return
    details = "; ".join(f"{m}: {r}" for m, r in zip(maddrs, reasons))
    raise NetworkError(f"none of the initial peers is reachable ({details}); "
                       f"{hint or 'check the addresses, or ' + NEW_SWARM_HINT}")
