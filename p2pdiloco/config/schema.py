"""The settings' schema: one frozen dataclass per section (``[model]``, ``[inner]``,
``[outer]``, ``[swarm]``, ``[data]``, ``[trust]``) and :class:`NodeConfig` over them, each
field with its type, default and range check (``Invalid`` lists what is out of range).
:mod:`p2pdiloco.config.loading` fills them from TOML, the environment and flags."""

from __future__ import annotations

import dataclasses
import ipaddress
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from p2pdiloco.core.choices import DEFAULT_OUTLIER_FACTOR, OUTLIER_POLICIES
from p2pdiloco.core.inner import InnerConfig
from p2pdiloco.errors import AddressError
from p2pdiloco.formats import FORMATS, DataFormat
from p2pdiloco.model_config import ModelConfig
from p2pdiloco.net.codecs.precision import WIRE_PRECISIONS


class Invalid(ValueError):
    """Out-of-range fields of one config section: ``problems`` is [(field, message)]."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{f}: {m}" for f, m in problems))


# Upper bounds: far above any real run, low enough that a signed run manifest or a typo cannot
# make a node allocate, wait or loop without end (docs/operating.md "Start a node").
MAX_FRAGMENTS = 1024  # what a heads record may list (net.records.parse.MAX_FRAGMENTS; tests/test_config.py checks)
MAX_STEPS = 10**9  # inner steps (H, tau, warm-up, schedule length, budgets)
MAX_QUORUM = 256  # members of one group (net.records.parse.MAX_GROUP)
MAX_LOGITS = 2**32  # batch_size x block_size x vocab_size of the built-in GPT (16 GiB of fp32 logits per batch)
MAX_WAIT_S = 3600.0  # seconds any one wait of a round may last
MAX_DURATION_S = 10.0**8  # seconds (about 3 years)


def _validate(*checks: tuple[str, bool, str]) -> None:
    """Raise :class:`Invalid` listing every (field, ok, message) check that failed."""
    failed = [(name, message) for name, ok, message in checks if not ok]
    if failed:
        raise Invalid(failed)


# The outer settings topk2 is measured with (docs/benchmarks/codecs.md): no outer momentum, as
# SparseLoCo runs it (arXiv 2508.15706, section 3); lr and error-feedback decay from a grid in
# DiLoCo's regime (docs/benchmarks/codecs_density_grid.md). A node off them says so at start.
TOPK2_RECIPE = {"momentum": 0.0, "lr": 2.0, "error_feedback_decay": 0.65}


def topk2_note(outer: "OuterConfig") -> str | None:
    """One line for a person when ``outer`` runs topk2 off :data:`TOPK2_RECIPE`; None otherwise."""
    runs = {k: getattr(outer, k) for k in TOPK2_RECIPE}
    if outer.wire_precision != "topk2" or runs == TOPK2_RECIPE:
        return None

    def settings(values: dict[str, float]) -> str:
        return ", ".join(f"outer.{k} = {v:g}" for k, v in values.items())

    return f"topk2 is measured with {settings(TOPK2_RECIPE)} (docs/benchmarks/codecs.md); this run has {settings(runs)}"


@dataclass(frozen=True)
class OuterConfig:
    """Outer loop (DiLoCo arXiv 2311.08105 defaults lr 0.7, momentum 0.9;
    Decoupled DiLoCo arXiv 2604.21428 uses P = 24, H = 24, tau = 2 on large models; P = 4
    here, since fragments hold whole tensors and the default model has 20)."""

    lr: float = 0.7
    momentum: float = 0.9
    fragments: int = 4  # P, at most the model's number of parameter tensors
    sync_every: int = 24  # H, inner steps between two syncs of one fragment
    overlap: int = 2  # tau: inner steps a round may take while training goes on (sizes the grace window)
    min_quorum: int = 1  # K
    grace_gamma: float = 0.5
    grace_min: float = 0.5  # seconds
    grace_max: float = 5.0  # seconds
    quorum_timeout: float = 10.0  # seconds to wait for K members
    liveness_timeout: float = 10.0  # seconds a reducer waits for a missing member
    wire_precision: str = "fp32"
    # beta of the error feedback of lossy wire precisions: a member sends Δ + beta·e, e what coding
    # left out of its last round (SparseLoCo, arXiv 2508.15706). 1 carries e whole (right for the
    # dense precisions); topk2 trains best with 0.65, momentum 0, lr 2 (TOPK2_RECIPE)
    error_feedback_decay: float = 1.0
    # Baseline for comparisons, not for production: every round waits (up to quorum_timeout)
    # for all live learners and training blocks until it is applied, as in synchronous
    # DiLoCo (OpenDiLoCo, arXiv 2407.07852; torchft's DiLoCo).
    synchronous: bool = False
    # What a learner does on arrival of a merge that contains its contribution: "overwrite"
    # θ_p with the new Θ_p (the paper's rule, arXiv 2604.21428), dropping the inner steps that
    # ran while the round was in flight; or "keep" those steps on top of the new Θ_p and
    # contribute them at the next round (no token is lost; see Learner.install_keeping_flight).
    on_arrival: str = "keep"

    def __post_init__(self) -> None:
        _validate(
            ("lr", 0 < self.lr <= 100, "must be in (0, 100]"),
            ("momentum", 0 <= self.momentum < 1, "must be in [0, 1)"),
            ("fragments", 1 <= self.fragments <= MAX_FRAGMENTS, f"must be in 1..{MAX_FRAGMENTS}"),
            ("sync_every", 1 <= self.sync_every <= MAX_STEPS, f"must be in 1..{MAX_STEPS}"),
            ("overlap", 0 <= self.overlap <= MAX_STEPS, f"must be in 0..{MAX_STEPS}"),
            ("min_quorum", 1 <= self.min_quorum <= MAX_QUORUM, f"must be in 1..{MAX_QUORUM}"),
            ("grace_gamma", 0 < self.grace_gamma < 1, "must be in (0, 1)"),
            ("grace_min", 0 <= self.grace_min <= self.grace_max <= MAX_WAIT_S,
             f"need 0 <= grace_min <= grace_max <= {MAX_WAIT_S:g} (seconds)"),
            ("quorum_timeout", 0 < self.quorum_timeout <= MAX_WAIT_S, f"must be in (0, {MAX_WAIT_S:g}] (seconds)"),
            ("liveness_timeout", 0 < self.liveness_timeout <= MAX_WAIT_S, f"must be in (0, {MAX_WAIT_S:g}] (seconds)"),
            ("wire_precision", self.wire_precision in WIRE_PRECISIONS, f"must be one of {', '.join(WIRE_PRECISIONS)}"),
            ("error_feedback_decay", 0 <= self.error_feedback_decay <= 1, "must be in [0, 1]"),
            ("on_arrival", self.on_arrival in ("keep", "overwrite"), "must be keep or overwrite"),
        )


def _address_problems(name: str, addresses: tuple[str, ...], check) -> list[tuple[str, bool, str]]:
    out = []
    for m in addresses:
        try:
            check(m)
        except AddressError as e:
            out.append((name, False, str(e)))
    return out


def _is_ipv4(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


ReachabilityMode = Literal["auto", "public", "private"]


@dataclass(frozen=True)
class SwarmConfig:
    """Where the node listens and whom it asks to join."""

    run_id: str = "p2pdiloco"
    initial_peers: tuple[str, ...] = ()
    host: str = "0.0.0.0"
    port: int = 0  # 0: any free port
    announce: tuple[str, ...] = ()  # multiaddrs others should dial, when behind NAT
    # auto: a dial-back check through the initial peers decides (net.transport.reachability); public or
    # private: no check. relay: reserve a circuit relay slot when behind NAT (docs/operating.md)
    reachability: ReachabilityMode = "auto"
    relay: bool = True

    def __post_init__(self) -> None:
        from p2pdiloco.net.transport.addresses import check_announce_maddr, check_peer_maddr  # noqa: PLC0415

        _validate(
            ("run_id", bool(self.run_id) and not any(c == "/" or c.isspace() for c in self.run_id),
             "must be a non-empty name without '/' or spaces"),
            ("host", _is_ipv4(self.host), f"{self.host!r} is not an IPv4 address (0.0.0.0: every interface)"),
            ("port", 0 <= self.port <= 65535, "must be in 0..65535 (0: any free port)"),
            *_address_problems("initial_peers", self.initial_peers, check_peer_maddr),
            *_address_problems("announce", self.announce, check_announce_maddr),
            ("reachability", self.reachability in typing.get_args(ReachabilityMode), "must be auto, public or private"),
        )


@dataclass(frozen=True)
class DataConfig:
    """Training text: the standard library's source by default, or the user's files
    (docs/data.md)."""

    path: str = ""  # file or folder; "" = the Python standard library's .py files
    format: DataFormat = "auto"  # text | jsonl | parquet | auto (by extension: .jsonl/.ndjson, .parquet, else text)
    text_field: str = "text"  # the JSON Lines field / Parquet column holding the text
    tokenizer: str = ""  # a tokenizers JSON file (this node's copy); "" = bytes (vocab 256)
    tokenizer_sha256: str = ""  # the run's tokenizer (set from data.tokenizer; the manifest carries it)
    shard_index: int = -1  # -1: derived from the peer ID
    num_shards: int = 8
    batch_size: int = 16
    max_bytes: int = 8_000_000  # training bytes read per node (0 = all)
    heldout_fraction: float = 0.05
    eval_batches: int = 8

    def __post_init__(self) -> None:
        _validate(
            ("num_shards", 1 <= self.num_shards <= 2**20, f"must be in 1..{2**20}"),
            ("shard_index", -1 <= self.shard_index < self.num_shards, "must be -1 or in [0, num_shards)"),
            ("batch_size", 1 <= self.batch_size <= 2**16, f"must be in 1..{2**16}"),
            ("max_bytes", 0 <= self.max_bytes <= 2**50, f"must be in 0..{2**50} (0: all)"),
            ("heldout_fraction", 0 < self.heldout_fraction < 1, "must be in (0, 1)"),
            ("eval_batches", 1 <= self.eval_batches <= 10**5, f"must be in 1..{10**5}"),
            ("path", not self.path or Path(self.path).exists(), f"{self.path!r} does not exist"),
            ("format", self.format in FORMATS, f"must be one of {', '.join(FORMATS)}"),
            ("text_field", 0 < len(self.text_field) <= 256, "must be a field name (1 to 256 characters)"),
            ("tokenizer", not self.tokenizer or Path(self.tokenizer).expanduser().is_file(),
             f"{self.tokenizer!r} is not a file"),
            ("tokenizer_sha256", not self.tokenizer_sha256 or (len(self.tokenizer_sha256) == 64 and all(
                c in "0123456789abcdef" for c in self.tokenizer_sha256)), "must be 64 lowercase hex digits"),
        )


@dataclass(frozen=True)
class TrustConfig:
    """Identity, private-swarm membership and robust merging (docs/trust.md)."""

    identity: str = ""  # Ed25519 identity file; "" = {data_dir}/p2p.key (a new key each start without data_dir)
    swarm_key: str = ""  # private swarm: its public key (64 hex digits) or swarm.pub path; "" = public swarm
    certificate: str = ""  # membership certificate; "" = {data_dir}/member.cert
    revocations: str = ""  # the swarm's signed revocation list (optional)
    outliers: str = "clip"  # norms far above the round's median: clip | drop | off
    outlier_factor: float = DEFAULT_OUTLIER_FACTOR  # "far above": more than this many times the lower median (or own) norm

    def __post_init__(self) -> None:
        _validate(
            ("outliers", self.outliers in OUTLIER_POLICIES, f"must be one of {', '.join(OUTLIER_POLICIES)}"),
            ("outlier_factor", 1 < self.outlier_factor <= 10**6, f"must be in (1, {10**6}]"),
            ("swarm_key", not self.swarm_key or _is_swarm_key(self.swarm_key),
             "expected 64 hex digits (from `p2pdiloco swarm init`) or the path of a swarm.pub file"),
            ("certificate", not self.certificate or Path(self.certificate).expanduser().is_file(),
             f"{self.certificate!r} is not a file"),
            ("revocations", not self.revocations or Path(self.revocations).expanduser().is_file(),
             f"{self.revocations!r} is not a file"),
        )


def _is_swarm_key(text: str) -> bool:
    from p2pdiloco.trust.certificates import decode_swarm_key  # noqa: PLC0415
    from p2pdiloco.trust.errors import CertificateError  # noqa: PLC0415

    try:
        decode_swarm_key(text)
    except CertificateError:
        return False
    return True


def _usable_dir(path: str) -> bool:
    return not path or not Path(path).exists() or Path(path).is_dir()


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
    device: str = "auto"  # "auto" (CUDA, else Apple MPS, else CPU), "cpu", "cuda", "cuda:N", "mps"
    memory_limit: int = 0  # MiB this node may use (resident memory); 0: no limit
    trace_dir: str = ""  # when set, every committed round's inputs and result are saved here
    metrics_port: int = 0  # Prometheus endpoint on http://metrics_host:PORT/metrics; 0: off
    metrics_host: str = "127.0.0.1"  # 0.0.0.0 exposes the metrics to the network
    status_every: float = 5.0  # seconds between status snapshots (status file, metrics); the live view and `node status` are fresh
    checkpoint_every: float = 10.0  # seconds between local checkpoints, at least 20x the last one's duration (needs data_dir; 0: off)
    settle: float = 10.0  # seconds a node that spent its budget keeps serving until peers agree
    alone_after: float = 180.0  # seconds of training without merging with another node before it says it is alone
    model: ModelConfig = field(default_factory=ModelConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trust: TrustConfig = field(default_factory=TrustConfig)

    def __post_init__(self) -> None:
        _validate(
            ("max_steps", 0 <= self.max_steps <= MAX_STEPS, f"must be in 0..{MAX_STEPS} (0: until stopped)"),
            ("duration", 0 <= self.duration <= MAX_DURATION_S, f"must be in 0..{MAX_DURATION_S:g} (seconds; 0: until stopped)"),
            ("eval_every", 1 <= self.eval_every <= MAX_STEPS, f"must be in 1..{MAX_STEPS}"),
            ("threads", 1 <= self.threads <= 1024, "must be in 1..1024"),
            ("device", self.device in ("auto", "cpu", "cuda", "mps") or (
                self.device.startswith("cuda:") and self.device[5:].isdigit()), "must be auto, cpu, cuda, cuda:N or mps"),
            ("memory_limit", self.memory_limit >= 0, "must be >= 0 (MiB; 0: no limit)"),
            ("status_every", 0.1 <= self.status_every <= 3600, "must be in 0.1..3600 (seconds)"),
            ("checkpoint_every", 0 <= self.checkpoint_every <= MAX_DURATION_S, f"must be in 0..{MAX_DURATION_S:g} (seconds; 0: off)"),
            ("settle", 0 <= self.settle <= MAX_WAIT_S, f"must be in 0..{MAX_WAIT_S:g} (seconds)"),
            ("alone_after", 0 < self.alone_after <= MAX_DURATION_S, f"must be in (0, {MAX_DURATION_S:g}] (seconds)"),
            ("data_dir", _usable_dir(self.data_dir), f"{self.data_dir!r} exists and is not a folder"),
            ("trace_dir", _usable_dir(self.trace_dir), f"{self.trace_dir!r} exists and is not a folder"),
            ("metrics_port", 0 <= self.metrics_port <= 65535, "must be in 1..65535, or 0 for no metrics endpoint"),
            ("metrics_host", _is_ipv4(self.metrics_host),
             f"{self.metrics_host!r} is not an IPv4 address (default 127.0.0.1: this machine only)"),
            ("outer.fragments", self.model.factory or self.outer.fragments <= self.model.num_tensors,
             f"{self.outer.fragments} exceeds the model's {self.model.num_tensors} parameter tensors "
             f"(fragments hold whole tensors); use at most {self.model.num_tensors}"),
            ("data.batch_size", bool(self.model.factory) or self.data.batch_size * self.model.block_size
             * self.model.vocab_size <= MAX_LOGITS,
             f"{self.data.batch_size} x model.block_size {self.model.block_size} x model.vocab_size "
             f"{self.model.vocab_size} logits per batch exceed {MAX_LOGITS} (16 GiB in fp32): lower one of them"),
            *_factory_problems(self.model.factory),
        )


def _factory_problems(spec: str) -> list[tuple[str, bool, str]]:
    """``model.factory`` can be imported and called (p2pdiloco.factory.resolve_factory); a
    module that builds the wrong thing is refused when the node builds it (Setup.build)."""
    if not spec:
        return []
    from p2pdiloco.factory import resolve_factory  # noqa: PLC0415

    try:
        resolve_factory(spec)
    except ValueError as e:
        return [("model.factory", False, str(e))]
    return []


SECTIONS = ("model", "inner", "outer", "swarm", "data", "trust")
TOP_LEVEL = tuple(f.name for f in dataclasses.fields(NodeConfig) if f.name not in SECTIONS)
