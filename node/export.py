"""``p2pdiloco model export | eval | sample``: the model a node's data dir holds, taken out.
(``model export --join``/``--initial-peers``: from the swarm itself, node/swarm_export.py.)

``export`` writes the swarm's global state Θ (every fragment at the version the node's
checkpoint holds, not the node's local weights θ) as an export folder
(:mod:`p2pdiloco.exported`); ``eval`` measures an export's held-out loss on the nodes' split;
``sample`` writes text the model generates. The module is rebuilt from the settings the node
saved in its data dir at its start (``node-config.json``, :func:`node.checkpoint.save_node_config`),
or from ``--config``/``--set`` as ``node run`` takes them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from torch import nn

from p2pdiloco.config import NodeConfig, load_config, parse_overrides
from p2pdiloco.core.fragments import balanced_fragments
from p2pdiloco.core.outer import FragmentState
from p2pdiloco.data import bits_per_byte, evaluate, loss_unit
from p2pdiloco.errors import ConfigError, P2PDilocoError
from p2pdiloco.exported import (MODEL_FILE, data_path_of, generate, heldout_with_bytes, load_export, load_global,
                                read_json, settings_config, write_export)
from p2pdiloco.model import build_model

from node.checkpoint import NODE_CONFIG, NODE_CONFIG_FORMAT, checkpoint_path, read_global_states
from node.committed import global_digest

__all__ = ["node_settings", "global_state_model", "export", "run_model_command", "sample_lines"]


class NoCheckpoint(ConfigError):
    """The data dir holds no checkpoint to export."""

    @classmethod
    def of(cls, data_dir: Path) -> NoCheckpoint:
        return cls(f"{data_dir} holds no checkpoint ({checkpoint_path(data_dir).name}): a node writes one "
                   "every checkpoint_every seconds and when it stops")


def node_settings(data_dir: Path, config: Path | None = None,
                  sets: list[str] | None = None) -> tuple[NodeConfig, str]:
    """The settings of the node of ``data_dir`` and the text it trained on (``data.path``, ""
    = the Python standard library's source): from ``config``/``sets`` when either is given
    (read as ``node run`` reads them, environment included), else from the ``node-config.json``
    the node wrote at its start. Raises ConfigError (none recorded, malformed, invalid)."""
    if config is not None or sets:
        cfg = load_config(config, overrides=parse_overrides(sets or []))
        return cfg, cfg.data.path
    path = data_dir / NODE_CONFIG
    if not path.is_file():
        raise ConfigError(f"{data_dir} has no {NODE_CONFIG} (written by a node at its start); "
                          "give the node's settings with --config/--set")
    saved = read_json(path, "--data-dir")
    if saved.get("format") != NODE_CONFIG_FORMAT:
        raise ConfigError(f"{path}: format {saved.get('format')!r}, expected {NODE_CONFIG_FORMAT}")
    return settings_config(saved.get("settings"), str(path)), data_path_of(saved.get("settings"), str(path))


def global_state_model(data_dir: Path, cfg: NodeConfig) -> tuple[nn.Module, list[FragmentState]]:
    """The module of ``cfg`` (CPU, fp32) holding the global state Θ of ``data_dir``'s
    checkpoint, and those states (fragment order).

    Raises:
        NoCheckpoint: there is no checkpoint.
        ConfigError: the checkpoint's fragments do not fit the module of ``cfg``.
        P2PDilocoError: the checkpoint cannot be read (corrupt, another format).
    """
    try:
        states = read_global_states(data_dir)
    except ValueError as e:
        raise P2PDilocoError(str(e)) from None
    if states is None:
        raise NoCheckpoint.of(data_dir)
    try:
        model = build_model(cfg.model, cfg.seed)
        shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        fragments = balanced_fragments(shapes, len(states), model.embedding_names())
        load_global(model, fragments, states)
    except ValueError as e:
        raise ConfigError(f"the checkpoint's {len(states)} fragments do not fit the model of these settings: {e}") \
            from None
    return model, states


def export(data_dir: Path, out: Path, cfg: NodeConfig, data_path: str) -> dict[str, Any]:
    """Write the export folder ``out`` of ``data_dir``'s checkpoint (see
    :mod:`p2pdiloco.exported`; ``data_path``: the text the node trained on); returns
    export.json's content. Raises what
    :func:`global_state_model` raises, and OSError."""
    model, states = global_state_model(data_dir, cfg)
    info = {"fragments": [{"fragment": s.index, "version": s.version, "digest": s.digest} for s in states],
            "global_digest": global_digest(states), "parameters": sum(p.numel() for p in model.parameters()),
            "source": str(data_dir.absolute())}
    return write_export(out, model, cfg, data_path, info)


def _export(args: argparse.Namespace) -> int:
    if args.data_dir is None:
        return _export_from_swarm(args)
    data_dir = Path(args.data_dir)
    if not data_dir.is_dir():
        raise ConfigError(f"--data-dir: {data_dir} is not a folder")
    if not checkpoint_path(data_dir).exists():  # before the settings: the likelier mistake
        raise NoCheckpoint.of(data_dir)
    _print_export(Path(args.out), export(data_dir, Path(args.out), *node_settings(data_dir, args.config, args.set)))
    return 0


def _print_export(out: Path, meta: dict[str, Any]) -> None:
    versions = ",".join(str(f["version"]) for f in meta["fragments"])
    loss = f", held-out loss {meta['heldout_loss']:.4f}" if "heldout_loss" in meta else ""
    hf = f"; Hugging Face layout in {out / meta['hf']}" if "hf" in meta else ""
    print(f"wrote {out / MODEL_FILE}: {meta['parameters']:,} parameters, {len(meta['fragments'])} "
          f"fragments at versions {versions}, global digest {meta['global_digest']}{loss}{hf}")


def swarm_settings(args: argparse.Namespace) -> tuple[NodeConfig, str]:
    """The run's settings and the held-out text's path for an export from the swarm: from the
    manifest of ``--join`` (its owner checked against the one pinned on this machine, its
    initial peers added) with ``--config``/``--set`` as ``node run`` takes them, or from
    ``--initial-peers``, ``--run-id`` and ``--config``/``--set``; ``--data`` else ``data.path``.
    Raises ConfigError (usage, settings, a manifest of another owner) or NetworkError (no
    initial peer reachable)."""
    from p2pdiloco.net.transport.addresses import check_any_reachable  # noqa: PLC0415

    if not 1 <= args.candidates <= 64:
        raise ConfigError(f"--candidates: must be in 1..64, got {args.candidates}")
    if not 0 <= args.wait <= 3600:
        raise ConfigError(f"--wait: must be in 0..3600 seconds, got {args.wait}")
    overrides: dict[str, Any] = parse_overrides(args.set)
    run = None
    if args.join is not None:
        from p2pdiloco import manifest, owners  # noqa: PLC0415

        run = manifest.load(args.join)
        owners.check(run.run_id, run.owner_id)
        cfg = load_config(args.config, overrides=overrides, run=manifest.pinned(run),
                          run_source=f"the manifest of run {run.run_id!r}")
        peers = tuple(dict.fromkeys(cfg.swarm.initial_peers + run.initial_peers))
    else:
        if args.run_id is None:
            raise ConfigError("--initial-peers needs --run-id (the run's name), or use --join MANIFEST")
        cfg = load_config(args.config, overrides={**overrides, "swarm.run_id": args.run_id,
                                                  "swarm.initial_peers": args.initial_peers})
        peers = cfg.swarm.initial_peers
    cfg = dataclasses.replace(cfg, swarm=dataclasses.replace(cfg.swarm, initial_peers=peers))
    check_any_reachable(cfg.swarm.initial_peers)
    return cfg, cfg.data.path if args.data is None else args.data


def _export_from_swarm(args: argparse.Namespace) -> int:
    import uvloop  # noqa: PLC0415

    from node.swarm_export import export_from_swarm  # noqa: PLC0415

    cfg, data_path = swarm_settings(args)
    out = Path(args.out)  # errors reach p2pdiloco.cli's handler as from the data-dir export: one line
    _print_export(out, uvloop.run(export_from_swarm(cfg, data_path, out, wait=args.wait, candidates=args.candidates)))
    return 0


def _eval(args: argparse.Namespace) -> int:
    exported = load_export(Path(args.model))
    data = exported.data_path if args.data is None else args.data
    batches, bytes_per_token = heldout_with_bytes(exported.cfg, data)
    loss = evaluate(exported.model, batches)
    unit = loss_unit(exported.cfg.data.tokenizer)
    view = {"model": str(args.model), "data": data or "python-stdlib", "loss": loss, "loss_unit": unit,
            "bits_per_byte": bits_per_byte(loss, bytes_per_token), "global_digest": exported.info.get("global_digest")}
    print(json.dumps(view, indent=1) if args.json else
          f"held-out loss {loss:.4f} {unit} ({view['bits_per_byte']:.4f} bits/byte) on {view['data']}")
    return 0


def _sample(args: argparse.Namespace) -> int:
    if not 0 <= args.tokens <= 100_000:
        raise ConfigError(f"--tokens: must be in 0..100000, got {args.tokens}")
    if not args.temperature >= 0 or args.temperature == float("inf"):
        raise ConfigError(f"--temperature: must be a finite number >= 0, got {args.temperature}")
    if not 0 <= args.seed < 2**63:
        raise ConfigError(f"--seed: must be in 0..2**63-1, got {args.seed}")
    exported = load_export(Path(args.model))
    prompt = args.prompt.encode()
    out = generate(exported.model, prompt, args.tokens, block_size=exported.cfg.model.block_size,
                   temperature=args.temperature, seed=args.seed)
    sys.stdout.write((prompt + out).decode("utf-8", errors="replace") + "\n")
    return 0


def run_model_command(args: argparse.Namespace) -> int:
    """``p2pdiloco model export|eval|sample``; returns 0. Raises ConfigError (settings, usage,
    no checkpoint: exit 2 in p2pdiloco.cli), P2PDilocoError (an unreadable checkpoint) or
    OSError (a file that cannot be written)."""
    return {"export": _export, "eval": _eval, "sample": _sample}[args.model_cmd](args)


def sample_lines(text: str, width: int = 80, indent: str = "  | ") -> list[str]:
    """``text`` as lines of at most ``width`` columns for a terminal: each line prefixed with
    ``indent``, long lines cut into pieces, tabs as spaces, other control characters as '·'
    (an untrained model writes any byte)."""
    clean = "".join(c if c == "\n" or c.isprintable() else " " * 4 if c == "\t" else "·" for c in text)
    room = max(1, width - len(indent))
    return [indent + line[i:i + room] for line in clean.split("\n") for i in range(0, max(1, len(line)), room)]


def before_after(data_dir: Path, cfg: NodeConfig, prompt: str, tokens: int = 120, seed: int = 0,
                 temperature: float = 0.8, width: int = 80) -> list[str]:
    """Lines that show what training changed: ``tokens`` bytes after ``prompt`` from the run's
    initial model (:func:`p2pdiloco.model.build_model` of ``cfg``: every node's start) and from
    the global model in ``data_dir``'s checkpoint, same prompt, seed and temperature, each at
    most ``width`` columns (:func:`sample_lines`). Raises what :func:`global_state_model` raises."""
    trained, states = global_state_model(data_dir, cfg)
    lines = [f"what the model writes after {prompt!r} ({tokens} bytes, seed {seed}, temperature {temperature:g}):"]
    for label, model in (("the initial model", build_model(cfg.model, cfg.seed)),
                         (f"the trained global model (fragments at versions "
                          f"{','.join(str(s.version) for s in states)})", trained)):
        out = generate(model, prompt.encode(), tokens, block_size=cfg.model.block_size, temperature=temperature,
                       seed=seed)
        lines += [f" {label}:", *sample_lines((prompt.encode() + out).decode("utf-8", errors="replace"), width)]
    return lines
