"""Run a bootstrap peer: join (or start) the DHT, print the multiaddrs to join with, serve
until SIGINT/SIGTERM. It holds no model and merges nothing: peers only use it to find
each other, so the swarm has no central server.

A bootstrap peer of a private swarm holds no certificate, but given the swarm's public key
(``--swarm-key``) it stores only members' DHT records: it checks each record's certificate as
a member does (docs/trust.md, "Public and private swarms"). It follows no revocation list, so
it may still hold a revoked member's records; members drop those entry by entry on reading.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import signal
from pathlib import Path

from p2pdiloco.errors import ConfigError
from p2pdiloco.net.transport.addresses import check_announce_maddr, check_any_reachable, check_listen_port, check_peer_maddr
from p2pdiloco.trust.certificates import decode_swarm_key

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0", help="IPv4 address to listen on (default: all)")
    parser.add_argument("--port", type=int, default=31337, help="TCP port to listen on (0: any free port)")
    parser.add_argument("--initial-peers", nargs="*", default=[], metavar="MULTIADDR",
                        help="other bootstrap peers to link with (optional)")
    parser.add_argument("--announce", nargs="*", default=[], metavar="MULTIADDR",
                        help="public multiaddrs to announce when behind NAT")
    parser.add_argument("--no-relay", action="store_true",
                        help="do not serve as a circuit relay for nodes behind NAT (default: serve; docs/operating.md)")
    parser.add_argument("--identity", default=None, help="private key file: keeps the same peer ID across restarts")
    parser.add_argument("--maddrs-file", type=Path, default=None, help="also write the multiaddrs to this file")
    parser.add_argument("--swarm-key", default=None, metavar="HEX_OR_PATH",
                        help="a private swarm's public key (64 hex digits or its swarm.pub): store only its "
                             "members' DHT records (default: any signed record)")


def check_arguments(args: argparse.Namespace) -> None:
    """Raises ConfigError (AddressError) for a malformed address, host or port, or a
    ``--swarm-key`` that is not a public key."""
    for m in args.initial_peers:
        check_peer_maddr(m)
    for m in args.announce:
        check_announce_maddr(m)
    try:
        ipaddress.IPv4Address(args.host)
    except ValueError:
        raise ConfigError(f"--host {args.host!r}: not an IPv4 address (0.0.0.0: every interface)") from None
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: must be in 0..65535 (0: any free port)")
    if args.swarm_key is not None:
        try:
            decode_swarm_key(args.swarm_key)
        except ConfigError:
            raise ConfigError(f"--swarm-key {args.swarm_key[:70]!r}: expected the swarm's public key (64 hex digits, "
                              "printed by `p2pdiloco swarm init`) or the path of its swarm.pub") from None


async def serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM. Raises ConfigError for bad arguments, NetworkError when the
    port is taken, no initial peer is reachable, or the daemon cannot start."""
    check_arguments(args)
    check_listen_port(args.host, args.port)
    await asyncio.to_thread(check_any_reachable, args.initial_peers)
    from p2pdiloco.net.transport.swarm import Swarm  # noqa: PLC0415  (imports hivemind: over a second)

    # public: nodes must be able to dial a bootstrap peer, and p2pd serves relays only when public
    swarm = await Swarm.start(initial_peers=args.initial_peers, host_maddrs=[f"/ip4/{args.host}/tcp/{args.port}"],
                              announce_maddrs=args.announce, identity_path=args.identity, reachability="public",
                              relay=not args.no_relay,
                              record_swarm=decode_swarm_key(args.swarm_key) if args.swarm_key else None)
    try:
        maddrs = await swarm.visible_maddrs()
        if args.maddrs_file:
            tmp = args.maddrs_file.with_suffix(".tmp")
            tmp.write_text("\n".join(maddrs) + "\n")
            tmp.replace(args.maddrs_file)
        print("bootstrap peer running (" + ("no relay" if args.no_relay else "circuit relay for nodes behind NAT")
              + (f"; stores records of {swarm.records.membership.name} only" if args.swarm_key else "")
              + "); nodes join with:", flush=True)
        for m in maddrs:
            print(f"  --initial-peers {m}", flush=True)
        if all("/127.0.0.1/" in m for m in maddrs):
            print("note: only loopback addresses are announced; peers on other machines need "
                  "--host 0.0.0.0 or --announce", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        return 0
    finally:
        await swarm.shutdown()
