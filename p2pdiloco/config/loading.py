"""Loading the settings: defaults < TOML file < environment ``P2PDILOCO_<SECTION>_<FIELD>``
(``P2PDILOCO_<FIELD>`` for top-level fields such as ``P2PDILOCO_DATA_DIR``) < command-line
``--set section.field=value`` (and the dedicated flags that map onto them), into the schema
of :mod:`p2pdiloco.config.schema`. Every problem is reported as one line ``section.field:
what is wrong (where it was set)`` in a single :class:`ConfigError`; nothing starts with an
invalid config."""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import typing
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, Literal

from p2pdiloco.config.schema import SECTIONS, TOP_LEVEL, Invalid, NodeConfig
from p2pdiloco.errors import ConfigError

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Convert a TOML/env/flag value to the field's annotated type (bool, int, float, str,
    a ``Literal`` of strings, tuple[T, ...] or a fixed tuple); strings are parsed, a comma-separated string gives a tuple.

    Raises:
        ValueError: ``where: expected ..., got ...``.
    """
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError(f"{where}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ValueError(f"{where}: expected an integer, got {value!r}")
    if hint is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                pass
        if number is None:
            raise ValueError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(number):
            raise ValueError(f"{where}: expected a finite number, got {value!r}")
        return number
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected a string, got {value!r}")
        return value
    if typing.get_origin(hint) is Literal:
        if isinstance(value, str) and value.strip() in typing.get_args(hint):
            return value.strip()
        raise ValueError(f"{where}: expected one of {', '.join(typing.get_args(hint))}, got {value!r}")
    if typing.get_origin(hint) is tuple:
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
    raise ValueError(f"{where}: unsupported type {hint}")


def _build(cls: type, values: Mapping[str, Any], section: str, sources: Mapping[tuple[str, str], str],
           problems: list[str]) -> Any:
    """``cls(**values)`` after coercion; appends one line per problem and returns None on any."""
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls) if not (section == "" and f.name in SECTIONS)]

    def where(name: str) -> str:
        return f"{section}.{name}" if section else name

    def origin(name: str) -> str:
        source = sources.get((section, name))
        return f" ({source})" if source else ""

    kwargs: dict[str, Any] = {}
    before = len(problems)
    for name, value in values.items():
        if not section and name in SECTIONS:
            problems.append(f"{name}: is a section; set its fields as {name}.FIELD{origin(name)}")
        elif name not in fields:
            also = f"; or SECTION.FIELD with a section among {', '.join(SECTIONS)}" if not section else ""
            problems.append(f"{where(name)}: unknown setting; known: {', '.join(sorted(fields))}{also}{origin(name)}")
        else:
            try:
                kwargs[name] = _coerce(value, hints[name], where(name))
            except ValueError as e:
                problems.append(f"{e}{origin(name)}")
    try:
        built = cls(**kwargs)
    except Invalid as e:
        problems.extend(f"{where(name)}: {message}{origin(name)}" for name, message in e.problems)
        return None
    except ValueError as e:  # sections that validate themselves (model, inner): one message, "field: ..." if it can
        name, _, message = str(e).partition(": ")
        problems.append(f"{where(name)}: {message}{origin(name)}" if name in fields and message
                        else f"{section or 'config'}: {e}")
        return None
    return built if len(problems) == before else None


def _read_toml(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a folder, not a TOML file") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not valid TOML: it is not UTF-8 text") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    overrides_source: str = "from the command line",
    run: Mapping[str, Any] | None = None,
    run_source: str = "the run's manifest",
    skip: Collection[str] = (),
) -> NodeConfig:
    """Build a NodeConfig from a TOML file, the environment and ``section.field`` overrides.

    Args:
        path: TOML file with top-level fields and ``[model]``, ``[inner]``, ``[outer]``,
            ``[swarm]``, ``[data]``, ``[trust]`` tables.
        env: environment (default ``os.environ``); ``P2PDILOCO_LOG`` is not a setting.
        overrides: ``{"section.field" or "field": value}``, applied last.
        overrides_source: how problems in ``overrides`` say where the value came from.
        run: ``{"section.field" or "field": value}`` of a run's settings
            (:mod:`p2pdiloco.manifest`), applied first, above the defaults; none of the other
            layers may give one of them another value.
        skip: dotted names (``data.path``, ``data_dir``) the file and the environment may hold
            that are not read (``run init`` leaves out the per-node settings of a node's file,
            :func:`p2pdiloco.manifest.per_node_settings`); ``overrides`` are always read.

    Raises:
        ConfigError: one line per problem found (unreadable file, unknown setting, wrong type,
            out-of-range value), each naming the setting and where it was set; or one line
            naming the first run setting another layer changed.
    """
    layered, sources, problems = _layers(path, env, overrides, overrides_source, run, run_source, skip)
    hints = typing.get_type_hints(NodeConfig)
    parts = {s: _build(hints[s], layered[s], s, sources, problems) for s in SECTIONS}
    node = _build(NodeConfig, layered[""], "", sources, problems)
    if not problems:
        try:  # checks across sections run on the whole config
            built = dataclasses.replace(node, **parts)
            if built.data.tokenizer:  # digest and vocabulary from the file (p2pdiloco.tokenizer)
                from p2pdiloco.tokenizer import resolve  # noqa: PLC0415

                built = resolve(built, pinned=bool(run))
            if run:
                _check_run(built, run, sources, run_source)
            return built
        except Invalid as e:
            for name, message in e.problems:
                section, _, fld = name.rpartition(".")
                source = sources.get((section, fld))
                problems.append(f"{name}: {message}" + (f" ({source})" if source else ""))
    if len(problems) == 1:
        raise ConfigError(f"invalid configuration: {problems[0]}")
    raise ConfigError(f"invalid configuration, {len(problems)} problems:\n  " + "\n  ".join(problems))


def _layers(path: str | Path | None, env: Mapping[str, str] | None, overrides: Mapping[str, Any] | None,
            overrides_source: str, run: Mapping[str, Any] | None, run_source: str, skip: Collection[str],
            ) -> tuple[dict[str, dict[str, Any]], dict[tuple[str, str], str], list[str]]:
    """The raw values of :func:`load_config`'s layers, later ones winning: ({section ("" for
    the top level): {field: value}}, {(section, field): where it was set}, problems found)."""
    layered: dict[str, dict[str, Any]] = {"": {}, **{s: {} for s in SECTIONS}}
    sources: dict[tuple[str, str], str] = {}
    problems: list[str] = []

    def put(section: str, name: str, value: Any, source: str) -> None:
        layered[section][name] = value
        sources[(section, name)] = source

    for dotted, value in (run or {}).items():
        section, _, fld = dotted.rpartition(".")
        put(section if section in SECTIONS else "", fld, value, f"from {run_source}")
    if path is not None:
        for key, value in _read_toml(path).items():
            if key in SECTIONS and isinstance(value, dict):
                for name, v in value.items():
                    if f"{key}.{name}" not in skip:
                        put(key, name, v, f"in {path}")
            elif key in SECTIONS:
                problems.append(f"{key}: expected a [{key}] table (in {path})")
            elif key not in skip:
                put("", key, value, f"in {path}")
    for name, value in (os.environ if env is None else env).items():
        if not name.startswith("P2PDILOCO_") or name == "P2PDILOCO_LOG":
            continue
        rest = name[len("P2PDILOCO_"):].lower()
        section, _, fld = rest.partition("_")
        if rest in TOP_LEVEL or section not in SECTIONS or not fld:
            section, fld = "", rest
        if (f"{section}.{fld}" if section else fld) not in skip:
            put(section, fld, value, f"from environment variable {name}")
    for dotted, value in (overrides or {}).items():
        section, _, fld = dotted.rpartition(".")
        if section and section not in SECTIONS:
            problems.append(f"{dotted}: unknown section {section!r} ({overrides_source}; "
                            f"known: {', '.join(SECTIONS)})")
            continue
        put(section, fld, value, overrides_source)
    return layered, sources, problems


def setting_names() -> list[str]:
    """Every setting's dotted name: the top-level fields (``seed``, ``data_dir``...), then each
    section's (``model.n_embd``...), in declaration order."""
    hints = typing.get_type_hints(NodeConfig)
    return [*TOP_LEVEL, *(f"{s}.{f.name}" for s in SECTIONS for f in dataclasses.fields(hints[s]))]


def settings_in(path: str | Path) -> list[str]:
    """The dotted names a TOML config file sets, in file order (a section that is not a table
    counts as its name). Raises ConfigError (one line) when the file cannot be read or parsed."""
    return [f"{key}.{name}" if key in SECTIONS and isinstance(value, dict) else key
            for key, value in _read_toml(path).items()
            for name in (value if key in SECTIONS and isinstance(value, dict) else [None])]


def _check_run(cfg: NodeConfig, run: Mapping[str, Any], sources: Mapping[tuple[str, str], str],
               run_source: str) -> None:
    """Raise ConfigError naming the first of ``run``'s settings that another layer changed."""
    base = load_config(env={}, overrides=run, overrides_source=f"from {run_source}")
    for dotted in run:
        section, _, fld = dotted.rpartition(".")
        mine, theirs = (getattr(getattr(c, section), fld) if section else getattr(c, fld) for c in (cfg, base))
        if mine != theirs:
            where = sources.get((section, fld), "")
            raise ConfigError(f"{dotted} = {_show(mine)} ({where}) differs from the run's {_show(theirs)} "
                              f"({run_source}): every node of the run uses the run's settings; drop yours")


def _show(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else repr(value) if isinstance(value, str) else str(value)


def parse_overrides(items: list[str]) -> dict[str, str]:
    """Parse ``--set section.field=value`` items (later items win).

    Raises:
        ConfigError: one line per item without ``=`` or without a name before it.
    """
    out: dict[str, str] = {}
    bad: list[str] = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            bad.append(f"--set {item!r}: expected SECTION.FIELD=VALUE, for example --set outer.sync_every=50")
            continue
        out[key.strip()] = value.strip()
    if bad:
        raise ConfigError("\n".join(bad))
    return out
