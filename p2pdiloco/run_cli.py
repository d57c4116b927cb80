"""``p2pdiloco run``: a training run's manifest: ``init`` (its owner makes and signs it, once)
and ``show`` (check its signature, pin its owner on first use: :mod:`p2pdiloco.owners`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from p2pdiloco.cli_common import interrupted, report_error, sigint_held
from p2pdiloco.errors import ConfigError, P2PDilocoError


def add_run_parser(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="a training run's manifest: init (the owner, once), show")
    rsub = run.add_subparsers(dest="run_cmd", required=True, metavar="{init,show}")
    init = rsub.add_parser("init", help="make and sign a run's manifest: what nodes need to join it",
                           description="Write RUN_ID.manifest and print its one-string form. Every node started "
                                       "with `p2pdiloco node run --join MANIFEST` takes the run ID, the run's "
                                       "settings (model, optimizers, fragments, H, codec, seed, batch size, "
                                       "swarm key) and initial peers from it.")
    init.add_argument("--run-id", required=True, help="the run's name")
    init.add_argument("--initial-peers", nargs="+", default=None, metavar="MULTIADDR",
                      help="multiaddrs nodes join through (from `p2pdiloco bootstrap`)")
    init.add_argument("--config", type=Path, default=None,
                      help="TOML config with the run's settings (a node's own config works too: its per-node "
                           "settings, such as data.path or swarm.port, are left out, as with --set)")
    init.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                      help="a run setting, e.g. --set outer.sync_every=50")
    init.add_argument("--target-tokens", type=int, default=0, help="tokens the run means to train on (0: none)")
    init.add_argument("--identity", type=Path, default=Path("run-owner.key"),
                      help="the owner's Ed25519 key file, created if missing (default run-owner.key)")
    init.add_argument("--out", type=Path, default=None, help="manifest file to write (default RUN_ID.manifest)")
    show = rsub.add_parser("show", help="check a manifest's signature and print what it holds")
    show.add_argument("manifest", metavar="MANIFEST", help="a manifest file or its p2pdiloco-run:... string")
    show.add_argument("--json", action="store_true", help="print JSON (for scripts)")


def pin_owner(m: Any) -> bool:
    """Pin the owner of manifest ``m`` for its run on first use (:mod:`p2pdiloco.owners`), saying
    so on stderr; returns whether it was new. Raises ConfigError: the run is pinned to another
    owner."""
    from p2pdiloco import owners  # noqa: PLC0415

    newly = owners.pin(m.run_id, m.owner_id)
    if newly:
        print(f"p2pdiloco: owner {m.owner_id} pinned for run {m.run_id!r} (first use on this machine; "
              f"a manifest of this run from another key will be refused)", file=sys.stderr)
    return newly


def run_command(args: argparse.Namespace) -> int:
    from p2pdiloco import manifest  # noqa: PLC0415
    from p2pdiloco.config import load_config, parse_overrides, settings_in  # noqa: PLC0415
    from p2pdiloco.trust.identity import Identity  # noqa: PLC0415

    try:
        if args.run_cmd == "show":
            m = manifest.load(args.manifest, "run show")
            newly = pin_owner(m)
            view = {"run_id": m.run_id, "owner": m.owner_id, "owner_pinned": "new" if newly else "same",
                    "digest": m.digest, "created": m.created, "initial_peers": list(m.initial_peers),
                    "target_tokens": m.target_tokens, "settings": dict(m.settings)}
            print(json.dumps(view, indent=1) if args.json else "\n".join(
                f"{k}: {v}" for k, v in view.items() if k != "settings") + "\n" + "\n".join(
                f"  {k} = {v}" for k, v in m.settings.items()))
            return 0
        overrides: dict[str, Any] = {**parse_overrides(args.set), "swarm.run_id": args.run_id}
        if args.initial_peers:
            overrides["swarm.initial_peers"] = args.initial_peers
        # a node's own config (file or --set) works too: its per-node settings (data.path,
        # swarm.port...) are left out, said in one line; data.tokenizer gives the run its digest
        per_node = set(manifest.per_node_settings()) - {"data.tokenizer"}
        skipped = [*(settings_in(args.config) if args.config is not None else []), *overrides]
        skipped = list(dict.fromkeys(k for k in skipped if k in per_node))
        overrides = {k: v for k, v in overrides.items() if k not in per_node}
        with sigint_held() as held:  # initial peers' multiaddrs are parsed with hivemind (and torch)
            cfg = load_config(args.config, overrides=overrides, skip=per_node)
        if held:
            return interrupted()
        if args.target_tokens < 0:
            raise ConfigError("--target-tokens must be >= 0")
        identity, created = Identity.load_or_create(args.identity)
        m = manifest.RunManifest.create(identity, cfg, target_tokens=args.target_tokens)
        out = args.out or Path(f"{cfg.swarm.run_id}.manifest")
        m.save(out)
    except P2PDilocoError as e:
        return report_error(e)
    except OSError as e:
        print(f"p2pdiloco: {e}", file=sys.stderr)
        return 1
    if skipped:
        print(f"p2pdiloco: left out of the manifest: {', '.join(skipped)} (per-node settings: each node sets its "
              f"own)", file=sys.stderr)
    if created:
        print(f"p2pdiloco: made the run owner's key {args.identity}: keep it private", file=sys.stderr)
    if not m.initial_peers:
        print("p2pdiloco: the manifest names no initial peers: joining nodes will need --initial-peers",
              file=sys.stderr)
    print(f"wrote {out} (run {m.run_id!r}, digest {m.digest}); nodes join with:\n"
          f"  p2pdiloco node run --join {out}\nor with the string:\n{m.to_string()}")
    return 0
