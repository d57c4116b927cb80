"""The ``p2pdiloco model`` command line (export, eval, sample): parsed without torch; run by
:func:`node.export.run_model_command`."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_model_parser"]


def add_model_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``model export|eval|sample`` to ``sub`` (the ``p2pdiloco`` subcommands)."""
    model = sub.add_parser("model", help="the trained model: export it from a node's data dir, evaluate it, sample it")
    msub = model.add_subparsers(dest="model_cmd", required=True, metavar="{export,eval,sample}")
    export = msub.add_parser("export", help="write the swarm's global model: from a node's checkpoint, or from the swarm",
                             description="Write OUT/model.safetensors (the global parameters of every fragment, "
                                         "fp32), OUT/config.json (the model settings and run seed), OUT/export.json "
                                         "(versions, digests) and, for a transformers model, OUT/hf (Hugging Face's "
                                         "layout). From --data-dir: the versions the node's checkpoint holds (exit 2 "
                                         "with one line when there is none). From the swarm (--join, or "
                                         "--initial-peers with --run-id): the claimed global state with the lowest "
                                         "held-out loss among those downloaded and verified (docs/operating.md).")
    source = export.add_mutually_exclusive_group(required=True)
    source.add_argument("--data-dir", default=None, help="the node's --data-dir (running or stopped)")
    source.add_argument("--join", default=None, metavar="MANIFEST",
                        help="from the swarm of a run: its manifest file or p2pdiloco-run:... string (run ID, "
                             "settings, initial peers)")
    source.add_argument("--initial-peers", nargs="+", default=None, metavar="MULTIADDR",
                        help="from the swarm: multiaddrs of peers to join through (with --run-id and the run's "
                             "settings as --config/--set)")
    export.add_argument("--run-id", default=None, help="with --initial-peers: the run's name")
    export.add_argument("--data", default=None, metavar="PATH",
                        help="from the swarm: text whose held-out split scores the claimed states (default: "
                             "data.path of the settings, else the Python standard library, the nodes' default)")
    export.add_argument("--wait", type=float, default=30.0, help="from the swarm: seconds to wait for the run's "
                                                                  "records (default 30)")
    export.add_argument("--candidates", type=int, default=4,
                        help="from the swarm: claimed global states to download and score at most (default 4)")
    export.add_argument("--out", required=True, help="folder to write the export to (made if missing)")
    export.add_argument("--config", type=Path, default=None,
                        help="the node's TOML config (default: node-config.json the node wrote in its data dir; from the "
                             "swarm: the run's settings, unless --join gives them)")
    export.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="a node setting, as for node run (instead of node-config.json)")
    ev = msub.add_parser("eval", help="held-out loss of an exported model (nats per byte or per token, and bits per byte)")
    ev.add_argument("--model", required=True, metavar="EXPORT_DIR", help="a folder written by model export")
    ev.add_argument("--data", default=None, metavar="PATH",
                    help="text file or folder whose held-out split to use (default: what the node trained on)")
    ev.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    sample = msub.add_parser("sample", help="text written by an exported model after a prompt")
    sample.add_argument("--model", required=True, metavar="EXPORT_DIR", help="a folder written by model export")
    sample.add_argument("--prompt", default="", help="text to continue (default: none)")
    sample.add_argument("--tokens", type=int, default=200, help="bytes to generate (default 200)")
    sample.add_argument("--temperature", type=float, default=0.8,
                        help="sampling temperature (default 0.8; 0: always the most likely byte)")
    sample.add_argument("--seed", type=int, default=0, help="random seed: the same text for the same seed (default 0)")
