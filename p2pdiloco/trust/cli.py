"""``p2pdiloco swarm init | admit | revoke | identity``: the keys of a private swarm, offline.

The owner runs ``init`` once (a swarm key pair), every node shows its public key with
``identity``, the owner signs a certificate for it with ``admit`` and hands the file over,
and may later revoke members with ``revoke``. None of these needs the network, except
``revoke --publish``, which also stores the new list in the swarm's DHT, where running members
pick it up (:mod:`p2pdiloco.net.state.revocation`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from p2pdiloco.trust import CERTIFICATE_FILE, IDENTITY_FILE
from p2pdiloco.trust.certificates import RevocationList, SwarmKey, fingerprint, parse_public_key
from p2pdiloco.errors import ConfigError, P2PDilocoError
from p2pdiloco.trust.errors import TrustError
from p2pdiloco.trust.identity import Identity, peer_id_of

__all__ = ["add_swarm_key_parsers", "run_swarm_key_command", "COMMANDS"]

COMMANDS = ("init", "admit", "revoke", "identity")
DAY = 86400


def add_swarm_key_parsers(swarm_subparsers: argparse._SubParsersAction) -> None:
    """Add ``init``, ``admit``, ``revoke`` and ``identity`` to the ``p2pdiloco swarm`` subcommands."""
    init = swarm_subparsers.add_parser("init", help="create the key pair of a new private swarm")
    init.add_argument("--dir", type=Path, default=Path("."), help="folder for swarm.key and swarm.pub (default: .)")

    admit = swarm_subparsers.add_parser("admit", help="sign a membership certificate for a node's public key")
    admit.add_argument("public_key", metavar="PUBLIC_KEY",
                       help="the node's peer ID (12D3KooW..., from `p2pdiloco swarm identity`) or 64 hex digits")
    admit.add_argument("--swarm-key", type=Path, default=Path("swarm.key"), help="the swarm's private key file")
    admit.add_argument("--days", type=float, default=90, help="validity in days (default 90)")
    admit.add_argument("--out", type=Path, default=None,
                       help=f"certificate file to write (default: PEERID.cert; nodes read {CERTIFICATE_FILE} in their data dir)")

    revoke = swarm_subparsers.add_parser("revoke", help="add nodes to the swarm's signed revocation list")
    revoke.add_argument("public_keys", metavar="PUBLIC_KEY", nargs="+", help="peer IDs or 64-hex public keys")
    revoke.add_argument("--swarm-key", type=Path, default=Path("swarm.key"), help="the swarm's private key file")
    revoke.add_argument("--list", type=Path, default=Path("revocations.txt"),
                        help="revocation list to create or extend (default revocations.txt); nodes read it "
                             "from trust.revocations")
    revoke.add_argument("--publish", action="store_true",
                        help="also publish the list in the swarm's DHT: running members adopt it within their "
                             "poll interval (20 s) and refuse the revoked nodes from then on")
    revoke.add_argument("--initial-peers", nargs="+", default=None, metavar="MULTIADDR",
                        help="with --publish: multiaddrs of peers of the swarm to join through")
    revoke.add_argument("--wait", type=float, default=60.0, metavar="SECONDS",
                        help="with --publish: seconds to wait for the DHT and for a member's copy (default 60)")

    ident = swarm_subparsers.add_parser("identity", help="show (creating if needed) this node's public key")
    ident.add_argument("--data-dir", type=Path, default=None, help=f"the node's data dir (identity in {IDENTITY_FILE})")
    ident.add_argument("--identity", type=Path, default=None, help="the identity file itself")


def run_swarm_key_command(args: argparse.Namespace) -> int:
    """Run the subcommand in ``args.swarm_cmd``; 0 on success, 2 (with one line on stderr)
    for a bad key, certificate or file."""
    try:
        return {"init": _init, "admit": _admit, "revoke": _revoke, "identity": _identity}[args.swarm_cmd](args)
    except TrustError as e:
        print(f"p2pdiloco: {e}", file=sys.stderr)
        return 2
    except P2PDilocoError as e:  # revoke --publish: addresses (2) and the network (1)
        print(f"p2pdiloco: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1


def _init(args: argparse.Namespace) -> int:
    key = SwarmKey.generate()
    key_path, pub_path = key.save(args.dir)
    print(f"private swarm {fingerprint(key.public_key)} created")
    print(f"  private key: {key_path} (keep it offline; it admits and revokes members)")
    print(f"  public key:  {pub_path}: {key.public_key.hex()}")
    print(f"members run with --set trust.swarm_key={key.public_key.hex()}")
    print("admit a node with `p2pdiloco swarm admit PEER_ID` (the node prints its peer ID with "
          "`p2pdiloco swarm identity --data-dir DIR`)")
    return 0


def _admit(args: argparse.Namespace) -> int:
    if not args.days > 0:
        print("p2pdiloco: --days must be > 0", file=sys.stderr)
        return 2
    member = parse_public_key(args.public_key)
    cert = SwarmKey.load(args.swarm_key).admit(member, valid_for=args.days * DAY)
    out = args.out or Path(f"{peer_id_of(member)}.cert")
    cert.save(out)
    expires = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(cert.expires))
    print(f"certificate for {peer_id_of(member)} in swarm {fingerprint(cert.swarm)}, valid until {expires}: {out}")
    print(f"copy it to the node's data dir as {CERTIFICATE_FILE} (or point trust.certificate at it)")
    return 0


def _revoke(args: argparse.Namespace) -> int:
    if args.publish and not args.initial_peers:
        print("p2pdiloco: --publish needs --initial-peers MULTIADDR (a peer of the swarm, from `p2pdiloco bootstrap`)",
              file=sys.stderr)
        return 2
    if args.initial_peers and not args.publish:
        print("p2pdiloco: --initial-peers is only used with --publish", file=sys.stderr)
        return 2
    if args.publish and not args.wait > 0:
        print("p2pdiloco: --wait must be > 0", file=sys.stderr)
        return 2
    if args.publish:
        from p2pdiloco.net.transport.addresses import check_any_reachable, check_peer_maddr  # noqa: PLC0415

        for m in args.initial_peers:  # AddressError (2), NetworkError (1): before anything is written
            check_peer_maddr(m)
        check_any_reachable(args.initial_peers)
    key = SwarmKey.load(args.swarm_key)
    members = [parse_public_key(k) for k in args.public_keys]
    previous = RevocationList.load(args.list, key.public_key) if args.list.exists() else None
    revocations = key.revoke(members, previous)
    revocations.save(args.list)
    print(f"revocation list #{revocations.serial} of swarm {fingerprint(key.public_key)}: "
          f"{len(revocations.revoked)} revoked, written to {args.list}")
    if not args.publish:
        print("give it to every member (trust.revocations); they refuse the revoked nodes from their next start "
              "(or publish it to the running members with --publish --initial-peers MULTIADDR)")
        return 0
    return _publish(revocations, key, args.initial_peers, args.wait)


def _publish(revocations: RevocationList, key: SwarmKey, initial_peers: list[str], wait: float) -> int:
    from p2pdiloco.net.state.revocation import PUBLISH_TTL, publish_revocations  # noqa: PLC0415  (hivemind)

    try:
        done = asyncio.run(publish_revocations(revocations, key, initial_peers, wait=wait))
    except KeyboardInterrupt:
        print("p2pdiloco: interrupted (the transient peer was shut down)", file=sys.stderr)
        return 130
    held = (f"{len(done.holders)} member(s) hold a copy" if done.holders else
            f"no member re-published it within {wait:g} s (its own copy lives {PUBLISH_TTL // 60} minutes)")
    print(f"published revocation list #{revocations.serial} in the DHT of swarm {fingerprint(key.public_key)} "
          f"(key {done.key}); {held}; running members adopt it within their poll interval")
    return 0


def _identity(args: argparse.Namespace) -> int:
    if args.identity is None and args.data_dir is None:
        print("p2pdiloco: give --data-dir DIR (the node's) or --identity FILE", file=sys.stderr)
        return 2
    path = args.identity or args.data_dir / IDENTITY_FILE
    ident, created = Identity.load_or_create(path)
    print(ident.peer_id)
    print(f"{'created' if created else 'identity'} {path}; public key {ident.public_key.hex()}", file=sys.stderr)
    return 0
