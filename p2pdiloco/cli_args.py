"""The arguments of ``p2pdiloco node`` (run, status) and ``p2pdiloco swarm`` (status, and the
private-swarm key commands of :mod:`p2pdiloco.trust.cli`); :mod:`p2pdiloco.cli` runs them."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_node_parser(sub: argparse._SubParsersAction) -> None:
    node = sub.add_parser("node", help="run or inspect a training node")
    nsub = node.add_subparsers(dest="node_cmd", required=True, metavar="{run,status}")
    run = nsub.add_parser("run", help="run a node that joins a swarm and trains")
    run.add_argument("--join", default=None, metavar="MANIFEST",
                     help="join a run: its manifest file or its p2pdiloco-run:... string (from `p2pdiloco run "
                          "init`); gives the run ID, the run's settings and its initial peers")
    run.add_argument("--initial-peers", nargs="+", default=None, metavar="MULTIADDR",
                     help="multiaddrs of peers to join through (from `p2pdiloco bootstrap`)")
    run.add_argument("--config", type=Path, default=None, help="TOML config file")
    run.add_argument("--data", default=None, help="text file or folder to train on (default: Python's stdlib source)")
    run.add_argument("--run-id", default=None, help="name of the training run (all nodes of a run share it)")
    run.add_argument("--host", default=None, help="IPv4 address to listen on")
    run.add_argument("--port", type=int, default=None, help="TCP port to listen on (0: any)")
    run.add_argument("--data-dir", default=None, help="folder for the node's identity, status and report")
    run.add_argument("--device", default=None, help="auto (CUDA, else Apple MPS, else CPU), cpu, cuda, cuda:N or mps")
    run.add_argument("--threads", type=int, default=None, help="CPU threads torch may use (default 1)")
    run.add_argument("--memory-limit", type=int, default=None, metavar="MIB",
                     help="refuse to start when training would need more memory than this (MiB); warn when over it")
    run.add_argument("--max-steps", type=int, default=None, help="stop after this many inner steps")
    run.add_argument("--duration", type=float, default=None,
                     help="stop after this many seconds of training (default: the config's duration, 0: until stopped)")
    run.add_argument("--name", default=None, help="a label for logs and status (default: the data dir's name, "
                                                  "else this machine's host name)")
    run.add_argument("--status-file", type=Path, default=None,
                     help="write a JSON status snapshot here every status_every seconds (default 5; every second "
                          "while the live view shows)")
    run.add_argument("--report-file", type=Path, default=None, help="write the final JSON report here")
    run.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                     help="override any config value, e.g. --set outer.sync_every=50")
    run.add_argument("--no-progress", action="store_true",
                     help="no live view in the terminal (it is shown only when stdout is a terminal)")
    run.add_argument("-v", "--verbose", action="count", default=1)
    status = nsub.add_parser("status", help="show what a running node on this machine is doing",
                             description="Read a running node over its local control socket (control.sock in its "
                                         "data dir). Exit 1 with one line when no node answers within a few seconds.")
    where = status.add_mutually_exclusive_group()
    where.add_argument("--data-dir", default=None, help="the node's --data-dir (default: the only node without one)")
    where.add_argument("--socket", default=None, help="path of the node's control socket")
    status.add_argument("--json", action="store_true", help="print the raw JSON snapshot (for scripts)")
    status.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
                        help="refresh every SECONDS (default 2) until Ctrl+C")
    status.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the node's answer (default 3)")


def add_swarm_parser(sub: argparse._SubParsersAction) -> None:
    swarm = sub.add_parser("swarm", help="swarm status (without joining), private-swarm keys: init, admit, revoke, identity")
    ssub = swarm.add_subparsers(dest="swarm_cmd", required=True, metavar="{init,admit,revoke,identity,status}")
    from p2pdiloco.trust.cli import add_swarm_key_parsers  # noqa: PLC0415

    add_swarm_key_parsers(ssub)  # init, admit, revoke, identity: private-swarm keys (docs/trust.md)
    status = ssub.add_parser("status", help="every node's record in the DHT: state, step, tokens/s, versions",
                             description="Join the DHT as a light peer (no model, no training), print every node's "
                                         "record under the run, then leave.")
    status.add_argument("--initial-peers", nargs="+", default=None, metavar="MULTIADDR",
                        help="multiaddrs of peers to join through (from `p2pdiloco bootstrap`)")
    status.add_argument("--run-id", default=None, help="name of the training run (default: from --config, else "
                                                       "'p2pdiloco')")
    status.add_argument("--config", type=Path, default=None, help="a node's TOML config: its peers and run ID")
    status.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    status.add_argument("--wait", type=float, default=10.0,
                        help="seconds to wait for records to appear (default 10)")
    status.add_argument("-v", "--verbose", action="count", default=0)
