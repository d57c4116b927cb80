"""Typed, validated configuration: frozen dataclasses loaded from TOML, environment and flags.

Precedence (later wins): defaults < TOML file < environment ``P2PDILOCO_<SECTION>_<FIELD>``
< command-line ``--set section.field=value`` (and the dedicated flags that map onto them).
Every problem is reported as one line ``section.field: what is wrong`` in a single
:class:`ConfigError`; nothing starts with an invalid config.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2pdiloco.core.learner import InnerConfig
from p2pdiloco.errors import ConfigError
from p2pdiloco.model import ModelConfig
from p2pdiloco.net.wire import WIRE_DTYPES


@dataclass(frozen=True)
class OuterConfig:
    """Outer loop (brief section 1; DiLoCo arXiv 2311.08105 defaults lr 0.7, momentum 0.9;
    Decoupled DiLoCo arXiv 2604.21428 defaults P = 24, H = 24, tau = 2)."""

    lr: float = 0.7
    momentum: float = 0.9
    fragments: int = 24  # P
    sync_every: int = 24  # H, inner steps between two syncs of one fragment
    overlap: int = 2  # tau, inner steps a merge may take before it is applied
    min_quorum: int = 1  # K
    grace_gamma: float = 0.5
    grace_min: float = 0.5  # seconds
    grace_max: float = 5.0  # seconds
    quorum_timeout: float = 10.0  # seconds to wait for K members
    liveness_timeout: float = 10.0  # seconds a reducer waits for a missing member
    wire_precision: str = "fp32"

    def __post_init__(self) -> None:
        _check(self.lr > 0, "lr must be > 0")
        _check(0 <= self.momentum < 1, "momentum must be in [0, 1)")
        _check(self.fragments >= 1, "fragments must be >= 1")
        _check(self.sync_every >= 1, "sync_every must be >= 1")
        _check(self.overlap >= 0, "overlap must be >= 0")
        _check(self.min_quorum >= 1, "min_quorum must be >= 1")
        _check(0 < self.grace_gamma < 1, "grace_gamma must be in (0, 1)")
        _check(0 <= self.grace_min <= self.grace_max, "need 0 <= grace_min <= grace_max")
        _check(self.quorum_timeout > 0 and self.liveness_timeout > 0, "timeouts must be > 0")
        _check(self.wire_precision in WIRE_DTYPES, f"wire_precision must be one of {sorted(WIRE_DTYPES)}")


@dataclass(frozen=True)
class SwarmConfig:
    """Where the node listens and whom it asks to join."""

    run_id: str = "p2pdiloco"
    initial_peers: tuple[str, ...] = ()
    host: str = "0.0.0.0"
    port: int = 0  # 0: any free port
    announce: tuple[str, ...] = ()  # multiaddrs others should dial, when behind NAT

    def __post_init__(self) -> None:
        from p2pdiloco.net.addresses import check_peer_maddr, check_announce_maddr  # noqa: PLC0415

        _check(bool(self.run_id) and "/" not in self.run_id and " " not in self.run_id,
               "run_id must be a non-empty name without '/' or spaces")
        _check(0 <= self.port <= 65535, "port must be in 0..65535")
        for m in self.initial_peers:
            check_peer_maddr(m)
        for m in self.announce:
            check_announce_maddr(m)


@dataclass(frozen=True)
class DataConfig:
    """Training text: the standard library's source by default, or the user's files."""

    path: str = ""  # file or folder; "" = the Python standard library's .py files
    shard_index: int = -1  # -1: derived from the peer ID
    num_shards: int = 8
    batch_size: int = 16
    max_bytes: int = 8_000_000  # training bytes read per node (0 = all)
    heldout_fraction: float = 0.05
    eval_batches: int = 8

    def __post_init__(self) -> None:
        _check(self.num_shards >= 1, "num_shards must be >= 1")
        _check(-1 <= self.shard_index < self.num_shards, "shard_index must be -1 or in [0, num_shards)")
        _check(self.batch_size >= 1, "batch_size must be >= 1")
        _check(self.max_bytes >= 0, "max_bytes must be >= 0")
        _check(0 < self.heldout_fraction < 1, "heldout_fraction must be in (0, 1)")
        _check(self.eval_batches >= 1, "eval_batches must be >= 1")
        _check(not self.path or Path(self.path).exists(), f"path {self.path!r} does not exist")


@dataclass(frozen=True)
class NodeConfig:
    """Everything one node needs. ``seed`` is the run seed: every node of a run must use the
    same one, so that all start from identical global weights (invariant I8)."""

    seed: int = 0
    max_steps: int = 0  # 0: until stopped
    duration: float = 0.0  # seconds; 0: until stopped
    eval_every: int = 200  # inner steps between held-out evaluations
    data_dir: str = ""  # "" = a temporary folder
    threads: int = 1  # torch intra-op threads
    trace_dir: str = ""  # when set, every committed round's inputs and result are saved here
    model: ModelConfig = field(default_factory=ModelConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self) -> None:
        _check(self.max_steps >= 0 and self.duration >= 0, "max_steps and duration must be >= 0")
        _check(self.eval_every >= 1, "eval_every must be >= 1")
        _check(self.threads >= 1, "threads must be >= 1")


SECTIONS = ("model", "inner", "outer", "swarm", "data")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Convert a TOML/env/flag value to the field's annotated type."""
    origin = typing.get_origin(hint)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise ValueError(f"{where}: expected true or false, got {value!r}")
    if hint in (int, float, str):
        if isinstance(value, bool) or (hint is str and not isinstance(value, (str, int, float))):
            raise ValueError(f"{where}: expected {hint.__name__}, got {value!r}")
        if hint is int and isinstance(value, float):
            raise ValueError(f"{where}: expected an integer, got {value!r}")
        try:
            return hint(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: expected {hint.__name__}, got {value!r}") from None
    if origin is tuple:
        args = typing.get_args(hint)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], where) for v in value)
        if len(value) != len(args):
            raise ValueError(f"{where}: expected {len(args)} values, got {len(value)}")
        return tuple(_coerce(v, a, where) for v, a in zip(value, args))
    if origin in (typing.Union, types.UnionType):
        return value
    raise ValueError(f"{where}: unsupported type {hint}")


def _build(cls: type, values: Mapping[str, Any], section: str, problems: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        where = f"{section}.{name}" if section else name
        if name not in fields:
            problems.append(f"{where}: unknown setting (known: {', '.join(sorted(fields))})")
            continue
        try:
            kwargs[name] = _coerce(value, hints[name], where)
        except ValueError as e:
            problems.append(str(e))
    try:
        return cls(**kwargs)
    except ValueError as e:
        problems.append(f"{section or 'node'}: {e}")
    except ConfigError as e:
        problems.append(f"{section or 'node'}: {e}")
    return None


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> NodeConfig:
    """Build a NodeConfig from a TOML file, the environment and ``section.field`` overrides.

    Raises:
        ConfigError: with one line per problem found (unreadable file, unknown setting,
            wrong type, out-of-range value).
    """
    layered: dict[str, dict[str, Any]] = {"": {}, **{s: {} for s in SECTIONS}}
    problems: list[str] = []
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        for key, value in data.items():
            if key in SECTIONS and isinstance(value, dict):
                layered[key].update(value)
            elif key in SECTIONS:
                problems.append(f"{key}: expected a [{key}] table")
            else:
                layered[""][key] = value
    env = os.environ if env is None else env
    for name, value in env.items():
        if name.startswith("P2PDILOCO_") and name not in ("P2PDILOCO_LOG",):
            rest = name[len("P2PDILOCO_"):].lower()
            section, _, fld = rest.partition("_")
            if section in SECTIONS and fld:
                layered[section][fld] = value
            else:
                layered[""][rest] = value
    for dotted, value in (overrides or {}).items():
        section, _, fld = dotted.rpartition(".")
        if section and section not in SECTIONS:
            problems.append(f"{dotted}: unknown section {section!r} (known: {', '.join(SECTIONS)})")
            continue
        layered[section][fld] = value
    classes = {f.name: f.type for f in dataclasses.fields(NodeConfig)}
    hints = typing.get_type_hints(NodeConfig)
    parts = {s: _build(hints[s], layered[s], s, problems) for s in SECTIONS if s in classes}
    node = None
    if not problems:
        node = _build(NodeConfig, {**layered[""]}, "", problems)
        if node is not None:
            node = dataclasses.replace(node, **parts)
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
    return node


def parse_overrides(items: list[str]) -> dict[str, str]:
    """Parse ``--set section.field=value`` items; ConfigError for items without '='."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected section.field=value")
        out[key.strip()] = value.strip()
    return out
