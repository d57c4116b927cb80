"""Run owners pinned on this machine: trust on first use of a run ID (docs/trust.md, threat table).

Any key may sign a manifest for any run ID (:mod:`p2pdiloco.manifest`), so the first manifest of
a run this user accepts (``node run --join``, ``run show``) pins its owner's peer ID for that run
ID, in a small per-user JSON file ``{"runs": {run_id: owner peer ID}}``:
``$XDG_CONFIG_HOME/p2pdiloco/owners.json`` (default ``~/.config``; tests point
XDG_CONFIG_HOME at a folder of their own; ``P2PDILOCO_*`` variables are node settings). Later, a
manifest of that run signed by another key is refused, and readers of the run's published
manifests take only the pinned owner's (:func:`p2pdiloco.manifest.published`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from p2pdiloco.errors import ConfigError
from p2pdiloco.atomic import write_json_atomic
from p2pdiloco.trust.identity import is_peer_id

__all__ = ["path", "load", "owner_of", "check", "pin"]

MAX_BYTES = 1 << 20  # the file at most (tens of thousands of runs)


def path() -> Path:
    """Where the pins live: ``$XDG_CONFIG_HOME/p2pdiloco/owners.json`` (``~/.config`` when
    XDG_CONFIG_HOME is unset or empty, as the XDG base directory spec says)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "p2pdiloco" / "owners.json"


def load() -> dict[str, str]:
    """{run ID: owner peer ID} pinned on this machine ({} when there is no file yet).

    Raises:
        ConfigError: the file cannot be read or is not what :func:`pin` writes (one line naming it)."""
    p = path()
    try:
        if p.stat().st_size > MAX_BYTES:
            raise ConfigError(f"the pinned run owners file {p} is larger than {MAX_BYTES} bytes: move it away")
        data = json.loads(p.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"cannot read the pinned run owners file {p}: {getattr(e, 'strerror', None) or e}; "
                          "fix or move it away") from None
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, dict) or not all(isinstance(k, str) and isinstance(v, str) and is_peer_id(v)
                                             for k, v in runs.items()):
        raise ConfigError(f"the pinned run owners file {p} is damaged (expected {{\"runs\": {{RUN_ID: PEER_ID}}}}); "
                          "fix or move it away")
    return dict(runs)


def owner_of(run_id: str) -> str | None:
    """The owner pinned for ``run_id`` on this machine, or None. Raises what :func:`load` raises."""
    return load().get(run_id)


def check(run_id: str, owner: str) -> bool:
    """Whether ``run_id`` is pinned already (True) or not yet (False).

    Raises:
        ConfigError: it is pinned to another owner than ``owner`` (one line, what to do)."""
    pinned = owner_of(run_id)
    if pinned is not None and pinned != owner:
        raise ConfigError(f"run {run_id!r} belongs to owner {pinned} on this machine, but this manifest is signed by "
                          f"{owner}: it is not from the run's owner; ask the owner for the run's manifest (if the "
                          f"owner really changed keys, remove the run from {path()})")
    return pinned is not None


def pin(run_id: str, owner: str) -> bool:
    """Pin ``owner`` for ``run_id`` unless it is already; returns whether it was new. The file
    is written atomically (a temporary file in its folder, then ``os.replace``), mode 0600.

    Raises:
        ConfigError: ``run_id`` is pinned to another owner (:func:`check`), or the file cannot
            be read or written."""
    if check(run_id, owner):
        return False
    runs = {**load(), run_id: owner}
    p = path()
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(p, {"runs": runs}, sort_keys=True)
    except OSError as e:
        raise ConfigError(f"cannot write the pinned run owners file {p}: {e.strerror or e}") from None
    return True
