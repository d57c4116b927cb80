"""``p2pdiloco data``: the run's text, read as a node reads it, and its tokenizer.

``p2pdiloco data tokenizer --input PATH --vocab-size N --output tok.json`` trains a byte-level
BPE tokenizer (:func:`p2pdiloco.tokenizer.train`) on the text under PATH, read as
``--format`` says (:mod:`p2pdiloco.formats`); the run's owner names it in ``run init``
(``--set data.tokenizer=tok.json``) and hands the file to every node (docs/data.md).
Bad input: one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from p2pdiloco.errors import ConfigError
from p2pdiloco.formats import FORMATS

__all__ = ["add_data_parser", "run_data_command"]


def add_data_parser(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="the run's text: train its tokenizer")
    dsub = data.add_subparsers(dest="data_cmd", required=True, metavar="{tokenizer}")
    tok = dsub.add_parser("tokenizer", help="train a byte-level BPE tokenizer on local text",
                          description="Train a byte-level BPE tokenizer (the tokenizers package) on the text "
                                      "under --input and write it as a tokenizers JSON file. Give it to "
                                      "`run init --set data.tokenizer=FILE` and to every node.")
    tok.add_argument("--input", required=True, type=Path, help="text file or folder (as data.path)")
    tok.add_argument("--vocab-size", required=True, type=int, help="tokens in the vocabulary (257..1048576)")
    tok.add_argument("--output", required=True, type=Path, help="tokenizer JSON file to write")
    tok.add_argument("--format", choices=FORMATS, default="auto", help="as data.format (default auto)")
    tok.add_argument("--text-field", default="text", help="as data.text_field (default text)")
    tok.add_argument("--json", action="store_true", help="print JSON (for scripts)")


def run_data_command(args: argparse.Namespace) -> str:
    """Run ``p2pdiloco data tokenizer``: train the tokenizer and return the line to print (JSON
    with ``--json``). Raises ConfigError for bad input (the CLI prints one line, exit 2) and
    OSError when the output cannot be written (exit 1)."""
    from p2pdiloco import tokenizer  # noqa: PLC0415
    from p2pdiloco.formats import collect_files  # noqa: PLC0415

    try:
        files = collect_files(args.input, args.format)
        vocab, digest = tokenizer.train(files, args.vocab_size, args.output, fmt=args.format, field=args.text_field)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from None
    view = {"output": str(args.output), "vocab_size": vocab, "sha256": digest, "files": len(files)}
    return json.dumps(view) if args.json else (
        f"wrote {args.output}: {vocab} tokens, sha256 {digest} (from {len(files)} file(s)); name it in the run "
        f"with: p2pdiloco run init ... --set data.tokenizer={args.output}")
