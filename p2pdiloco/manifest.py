"""Run manifests: one signed handle that says how to join a training run.

The run's owner makes it once (``p2pdiloco run init``): the run ID, every setting that must be
equal on all nodes of the run (:data:`RUN_SETTINGS`: the seed, the model, the inner and outer
optimizers, fragments, H, the wire codec, the batch size, the tokenizer's sha256, the
robust-merge policy, the private swarm's key), the initial peers to join through and an
optional target, signed with the owner's Ed25519 identity key (purpose ``run.manifest``, :mod:`p2pdiloco.trust.signing`). It travels
as a file or as one string (``p2pdiloco-run:`` + base64url(zlib(msgpack))), and every node
that runs with it republishes it in the swarm's DHT.

``p2pdiloco node run --join MANIFEST`` takes everything from it; a node's own setting that
differs from the run's is refused with one line naming it (:func:`pinned`,
``p2pdiloco.config.load_config(run=...)``). Per-node settings
(address, port, data dir, threads, device, the node's own text, its budget) stay the node's.

Every manifest from outside (a file, a string, a DHT record) is hostile until :func:`decode`
accepted it: at most :data:`MAX_BYTES`, typed, every setting known, signature valid.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from p2pdiloco.errors import ConfigError
from p2pdiloco.trust import signing
from p2pdiloco.trust.identity import Identity, peer_id_of, public_key_of

__all__ = ["RunManifest", "PREFIX", "MAX_BYTES", "run_settings", "per_node_settings", "decode", "load", "pinned",
           "published", "check_factory", "TRUSTED_FACTORIES"]

PREFIX = "p2pdiloco-run:"
FORMAT = 1
MAX_BYTES = 16384  # a manifest's msgpack form (and its decompressed size) at most
_PURPOSE = "run.manifest"

# Settings every node of one run must share: whole sections, then single fields.
RUN_SECTIONS = ("model", "inner", "outer")
RUN_FIELDS = ("seed", "data.batch_size", "data.num_shards", "data.max_bytes", "data.heldout_fraction",
              "data.tokenizer_sha256", "trust.swarm_key", "trust.outliers", "trust.outlier_factor")


def _fields(cfg: Any) -> list[str]:
    out = list(RUN_FIELDS[:1])
    for section in RUN_SECTIONS:
        out += [f"{section}.{f.name}" for f in dataclasses.fields(getattr(cfg, section))]
    return out + list(RUN_FIELDS[1:])


def _get(cfg: Any, dotted: str) -> Any:
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return list(obj) if isinstance(obj, tuple) else obj


def run_settings(cfg: Any) -> dict[str, Any]:
    """{dotted name: value} of every run setting of ``cfg`` (a ``NodeConfig``), in a fixed
    order (seed, model.*, inner.*, outer.*, then single fields); tuples become lists."""
    return {name: _get(cfg, name) for name in _fields(cfg)}


CARRIED_SWARM = ("swarm.run_id", "swarm.initial_peers")  # carried too, outside the settings


def per_node_settings() -> list[str]:
    """Dotted names of every setting a manifest does not carry (``data.path``, ``swarm.port``,
    ``data_dir``, ``duration``...): each node sets its own. ``run init`` leaves them out of a
    node's config file (docs/operating.md, "Start a node")."""
    from p2pdiloco.config import setting_names  # noqa: PLC0415

    carried = {*run_settings(_defaults()), *CARRIED_SWARM}
    return [name for name in setting_names() if name not in carried]


@dataclass(frozen=True)
class RunManifest:
    """A run's signed manifest.

    Attributes:
        run_id: the run's name (``swarm.run_id``).
        settings: {dotted name: value} of every run setting (:func:`run_settings`).
        initial_peers: multiaddrs to join through (may be empty: nodes then need their own).
        target_tokens: tokens the run means to train on, swarm-wide (0: no target).
        created: Unix time (seconds) the owner made it.
        owner: the owner's Ed25519 public key (32 bytes); its peer ID is :attr:`owner_id`.
        signature: the owner's signature over :meth:`fields` (64 bytes).
    """

    run_id: str
    settings: Mapping[str, Any]
    initial_peers: tuple[str, ...]
    target_tokens: int
    created: int
    owner: bytes
    signature: bytes = b""

    def fields(self) -> list[Any]:
        """What the owner signs: [format, run_id, [[name, value]...] of the run settings that
        differ from the defaults, the first 16 bytes of sha256 over msgpack([[name, value]...])
        of all of them (:func:`settings_digest`), initial_peers, target_tokens, created,
        owner]. The digest makes a node whose version has other defaults refuse the manifest
        instead of joining with other settings."""
        defaults = run_settings(_defaults())
        changed = [[k, v] for k, v in self.settings.items() if defaults.get(k) != v or type(defaults.get(k)) is not type(v)]
        return [FORMAT, self.run_id, changed, settings_digest(self.settings), list(self.initial_peers),
                self.target_tokens, self.created, self.owner]

    @property
    def owner_id(self) -> str:
        return peer_id_of(self.owner)

    @property
    def digest(self) -> str:
        """First 16 hex digits of sha256 of the signed bytes: names this manifest in logs and status."""
        return signing.sha256(self.encode()).hex()[:16]

    @classmethod
    def create(cls, identity: Identity, cfg: Any, *, target_tokens: int = 0, now: float | None = None) -> RunManifest:
        """The manifest of ``cfg``'s run (run ID, run settings, initial peers), signed by
        ``identity``. Raises ValueError on a negative target."""
        if target_tokens < 0:
            raise ValueError(f"target tokens must be >= 0, got {target_tokens}")
        unsigned = cls(cfg.swarm.run_id, run_settings(cfg), tuple(cfg.swarm.initial_peers), int(target_tokens),
                       int(time.time() if now is None else now), identity.public_key)
        return dataclasses.replace(unsigned, signature=signing.sign(identity, _PURPOSE, unsigned.fields()))

    def encode(self) -> bytes:
        """msgpack of [fields..., signature]."""
        return msgpack.packb([*self.fields(), self.signature], use_bin_type=True)

    def to_string(self) -> str:
        """The one-string form: ``p2pdiloco-run:`` + base64url(zlib(:meth:`encode`)), unpadded."""
        return PREFIX + base64.urlsafe_b64encode(zlib.compress(self.encode(), 9)).decode().rstrip("=")

    def save(self, path: Path) -> None:
        """Write the string form with ``#`` comment lines (what it holds) to ``path``,
        atomically (a temporary file renamed into place)."""
        lines = [f"# p2pdiloco run manifest: run {self.run_id!r}, owner {self.owner_id}, digest {self.digest}",
                 "# join with: p2pdiloco node run --join THIS_FILE (or the string below)",
                 *(f"# {k} = {v!r}" for k, v in self.settings.items()),
                 *(f"# initial peer {m}" for m in self.initial_peers),
                 *([f"# target tokens {self.target_tokens}"] if self.target_tokens else []),
                 self.to_string(), ""]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("\n".join(lines))
        tmp.replace(path)


def _defaults() -> Any:
    from p2pdiloco.config import NodeConfig  # noqa: PLC0415  (config imports nothing from here)

    return NodeConfig()


def settings_digest(settings: Mapping[str, Any]) -> bytes:
    """First 16 bytes of sha256 over msgpack([[name, value]...]) of ``settings`` in their order."""
    return signing.sha256(msgpack.packb([[k, v] for k, v in settings.items()], use_bin_type=True))[:16]


def _bad(why: str) -> ConfigError:
    return ConfigError(f"not a valid run manifest: {why}")


def _unpack(data: bytes) -> Any:
    """msgpack of at most :data:`MAX_BYTES`, with bounded strings, bins and arrays and no maps.
    Raises ConfigError (one line) on anything else."""
    if len(data) > MAX_BYTES:
        raise _bad(f"more than {MAX_BYTES} bytes")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=64, max_str_len=4096,
                               max_array_len=512, max_map_len=0, max_ext_len=0)
    except Exception:  # msgpack raises several types on hostile input
        raise _bad("its bytes are damaged or incomplete") from None


def decode(data: bytes) -> RunManifest:
    """Parse and verify a manifest's msgpack form (:meth:`RunManifest.encode`): its settings
    over this version's defaults must give the digest the owner signed.

    Raises ConfigError (one line) on anything malformed, oversized, of another format, with a
    setting this version does not know or of another type, made over other defaults, or not
    signed by its owner."""
    f = _unpack(data)
    if not isinstance(f, list) or len(f) != 9 or f[0] != FORMAT:
        raise _bad(f"expected format {FORMAT} with 9 fields")
    _, run_id, pairs, digest, peers, target, created, owner, sig = f
    if not (isinstance(run_id, str) and run_id and isinstance(pairs, list) and isinstance(peers, list)
            and isinstance(digest, bytes) and all(isinstance(p, str) for p in peers) and type(target) is int
            and target >= 0 and type(created) is int and isinstance(owner, bytes) and len(owner) == 32
            and isinstance(sig, bytes) and len(sig) == 64):
        raise _bad("a field has the wrong type")
    settings = run_settings(_defaults())
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
            raise _bad("a setting is not a [name, value] pair")
        name, value = pair
        if name not in settings:
            raise _bad(f"unknown setting {name!r} (made by another version of p2pdiloco?)")
        if type(value) is not type(settings[name]):
            raise _bad(f"setting {name} has the wrong type")
        settings[name] = value
    m = RunManifest(run_id, settings, tuple(peers), target, created, owner, sig)
    if settings_digest(settings) != digest:
        raise _bad("its settings over this version's defaults are not the run's (made by another version of "
                   "p2pdiloco? install the run's version)")
    if not signing.verify(owner, _PURPOSE, m.fields(), sig):
        raise _bad("its signature does not verify (altered, or not signed by its owner)")
    return m


def load(handle: str, what: str = "--join") -> RunManifest:
    """A manifest from ``handle``: a file (its last non-comment line is the string form) or the
    string itself. Raises ConfigError (one line, starting with ``what``, the flag or command
    that named it, when the file cannot be read or the string is damaged or cut short) when
    neither holds a valid manifest."""
    text = handle.strip()
    if not text.startswith(PREFIX):
        path = Path(handle).expanduser()
        try:
            if path.stat().st_size > 4 * MAX_BYTES + 65536:
                raise _bad(f"{handle} is too large")
            lines = [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
        except FileNotFoundError:
            raise ConfigError(f"{what}: {handle!r} is neither a manifest file nor a {PREFIX}... string") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{what}: cannot read {handle}: {getattr(e, 'strerror', None) or e}") from None
        if len(lines) != 1 or not lines[0].startswith(PREFIX):
            raise _bad(f"{handle} does not hold one {PREFIX}... line")
        text = lines[0]
    body = text[len(PREFIX):]
    damaged = ConfigError(f"{what}: the run handle is damaged or incomplete: copy the whole {PREFIX}... string "
                          f"(or the manifest file) from the run's owner again")
    try:
        packed = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        d = zlib.decompressobj()
        data = d.decompress(packed, MAX_BYTES + 1)
    except (binascii.Error, ValueError, zlib.error):
        raise damaged from None
    if len(data) > MAX_BYTES or d.unconsumed_tail:
        raise _bad(f"more than {MAX_BYTES} bytes")
    if not d.eof:  # cut short: zlib gives what it has so far, without an error
        raise damaged
    return decode(data)


TRUSTED_FACTORIES = "p2pdiloco.models."  # factories a manifest may name without the node's consent


def check_factory(m: RunManifest, confirmed: Any) -> None:
    """A manifest's ``model.factory`` names code this machine will import and run: one of
    p2pdiloco's own model factories (``p2pdiloco.models.*``), or any other only when the
    node's own command line names the same factory (``--set model.factory=...``), so that a
    manifest cannot make a node import a module of the owner's choosing unasked.

    Raises:
        ConfigError: the factory is outside p2pdiloco and the node did not name it."""
    factory = m.settings.get("model.factory") or ""
    if factory and not factory.startswith(TRUSTED_FACTORIES) and confirmed != factory:
        raise ConfigError(f"run {m.run_id!r} builds its model with {factory!r}, code from this machine's installed "
                          f"packages: to run it, confirm with --set model.factory={factory}")


def pinned(m: RunManifest) -> dict[str, Any]:
    """The settings a node of ``m``'s run must have: its run settings and ``swarm.run_id``
    (``load_config(run=...)``)."""
    return {**m.settings, "swarm.run_id": m.run_id}


def published(records: Mapping[Any, Any], owner: str | None) -> RunManifest | None:
    """The run's manifest among its DHT records ``{subkey: value}`` (``RUN/manifest``, each
    stored by a node that joined with it, under its own peer ID): the newest (``created``, then
    digest) valid one signed by ``owner``, the peer ID of the run's owner as this machine knows
    it (:mod:`p2pdiloco.owners`, or the node's own manifest's owner); None when ``owner`` is None
    or none of the records is its. Every record is looked at, whatever their number: anyone can
    store manifests under the run's key, and their count must not decide which one is read
    (docs/trust.md); only records signed by ``owner`` are verified (:func:`decode`)."""
    if owner is None:
        return None
    key = public_key_of(owner)
    best: RunManifest | None = None
    for value in records.values():
        if not isinstance(value, bytes) or _signer(value) != key:
            continue
        try:
            m = decode(value)
        except ConfigError:
            continue
        if best is None or (m.created, m.digest) > (best.created, best.digest):
            best = m
    return best


def _signer(data: bytes) -> bytes | None:
    """The owner key field of a manifest's msgpack form, unverified (None if malformed)."""
    try:
        f = _unpack(data)
    except ConfigError:
        return None
    return f[7] if isinstance(f, list) and len(f) == 9 and isinstance(f[7], bytes) else None
