"""Everything a node builds before it talks to the swarm: model, fragments, learner, data."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from p2pdiloco.config import NodeConfig, topk2_note
from p2pdiloco.core.fragments import Fragment, StaggeredSchedule, balanced_fragments
from p2pdiloco.core.learner import Learner
from p2pdiloco.core.outer import OUTER_STEP_RULE
from p2pdiloco import tokenizer as tokenizers
from p2pdiloco.data import (PIECE_BYTES, BatchSampler, Corpus, EmptyShard, default_corpus_files, heldout_batches,
                            load_corpus, min_text_bytes)
from p2pdiloco.errors import ConfigError
from p2pdiloco.exported import GlobalView
from p2pdiloco.footprint import Footprint
from p2pdiloco.formats import collect_files
from p2pdiloco.model import build_model

from node.training import Dispatch, TrainingLoop

log = logging.getLogger(__name__)

WIRE_VERSION = 14  # bump on any change of the RPC formats (6: signed mm.join, st.heads pushes, topk2; 7: state.deltas;
# 8: heartbeat pushes every 20 s, records stale after 65 s, st.heads hello; 9: heads records state their heartbeat period;
# 10: small calls in sessions, one stream per peer pair; 11: pushes as patches of the value the peer took last;
# 12: digests as 32 bytes, group members as public keys; 13: topk2 keeps 128 of 4096, not 64;
# 14: topk2 keeps 224, its places Rice-coded)


def protocol_tag(cfg, fragments) -> str:
    """A short hash of the settings every group member must share and of the fragments' tensor names and shapes."""
    out = cfg.outer
    shared = (WIRE_VERSION, OUTER_STEP_RULE, repr(cfg.model), cfg.seed, out.fragments, out.wire_precision, out.lr,
              out.momentum, out.sync_every, [[(s.name, s.shape) for s in f.slots] for f in fragments])
    return hashlib.sha256(repr(shared).encode()).hexdigest()[:10]


def _mps() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def resolve_device(name: str) -> torch.device:
    """``auto``: the first CUDA device when there is one, else Apple's GPU (MPS) when there is
    one, else the CPU. The inner steps run there (bf16 autocast on CUDA, fp32 elsewhere); the
    outer step and the merge always run on the CPU in fp32 (invariant I1).

    Raises:
        ConfigError: a CUDA or MPS device was asked for and is not available.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if _mps() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ConfigError(f"device {name!r}: no such CUDA device here (a CPU-only torch build? see docs/operating.md, "
                          "\"Running on your hardware\"); use device = \"cpu\" or \"auto\"")
    if device.type == "mps" and not _mps():
        raise ConfigError(f"device {name!r}: no Apple GPU (MPS) here; use device = \"cpu\" or \"auto\"")
    return device


def _short_text(corpus: Corpus, block_size: int) -> str | None:
    """What is too short in ``corpus`` for one sequence (``block_size + 1`` bytes), or None."""
    need = block_size + 1
    for part, text in (("training", corpus.train), ("held-out", corpus.heldout)):
        if text.numel() < need:
            return f"this node's {part} text has {text.numel()} bytes, fewer than one sequence " \
                   f"(model.block_size + 1 = {need})"
    return None


def _more_text(block_size: int) -> str:
    return (f"give at least {min_text_bytes(block_size):,} bytes of text (data.path: cut into {PIECE_BYTES // 1024} "
            f"KiB pieces, one held out)")


def _tokenizer(cfg: NodeConfig):
    """The run's tokenizer (None: bytes), its file checked against the run's digest once more
    (p2pdiloco.tokenizer.resolve did at load). Raises ConfigError (one line)."""
    want = cfg.data.tokenizer_sha256
    if not cfg.data.tokenizer:
        if want:
            raise ConfigError(f"this run tokenizes with a tokenizer of sha256 {want[:16]}... (data.tokenizer_sha256): "
                              f"set data.tokenizer to your copy of the run's tokenizer file")
        return None
    if tokenizers.file_sha256(cfg.data.tokenizer) != want:
        raise ConfigError(f"data.tokenizer {cfg.data.tokenizer} changed since the node's settings were read")
    return tokenizers.load(cfg.data.tokenizer)


@dataclass
class Setup:
    """A node's local pieces. ``name`` is a human label; ``peer_id`` seeds its data shard."""

    cfg: NodeConfig
    name: str
    model: nn.Module  # p2pdiloco.model.GPT, or a p2pdiloco.factory.FactoryModel (model.factory)
    fragments: tuple[Fragment, ...]
    learner: Learner
    sampler: BatchSampler
    heldout: list
    notes: tuple[tuple[int, str], ...] = ()  # (logging level, message) for :meth:`log_notes`
    footprint: Footprint | None = None  # the memory estimate checked at start (p2pdiloco.footprint)
    bytes_per_token: float = 1.0  # of the held-out text (p2pdiloco.data.Corpus.bytes_per_token)

    @classmethod
    def build(cls, cfg: NodeConfig, name: str, peer_id: str) -> Setup:
        """Raises ConfigError when the data or fragment count cannot work with the model, or
        the model cannot be built (model.factory)."""
        torch.set_num_threads(cfg.threads)
        device = resolve_device(cfg.device)
        try:  # a model.factory that builds no usable module: ValueError, one line
            model = build_model(cfg.model, cfg.seed).to(device)  # same run seed: same start on every node (I8)
            shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
            fragments = balanced_fragments(shapes, cfg.outer.fragments, model.embedding_names())
            files = collect_files(Path(cfg.data.path), cfg.data.format) if cfg.data.path else default_corpus_files()
            tok = _tokenizer(cfg)
            shard, shards = cfg.data.shard_index, cfg.data.num_shards
            auto = shard < 0
            if auto:
                shard = int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "big") % shards
            fallback = None

            def corpus_of(shard: int, shards: int) -> Corpus:
                return load_corpus(files, shard, shards, cfg.data.heldout_fraction, cfg.data.max_bytes or None,
                                   fmt=cfg.data.format, text_field=cfg.data.text_field, tokenizer=tok)

            bs = cfg.model.block_size
            try:
                corpus = corpus_of(shard, shards)
            except EmptyShard as e:
                if not auto:  # a shard the person chose: fewer shards, if all of the text would do
                    if problem := _short_text(corpus_of(0, 1), bs):
                        raise ValueError(f"data: {problem} even with one shard; {_more_text(bs)}") from None
                    raise
                # a small corpus: rather than fail (or train on a sliver), this node trains on all
                # of the training text, in its own random order (its sampler's seed is its own)
                fallback, shard, shards = str(e), 0, 1
                corpus = corpus_of(0, 1)
            if problem := _short_text(corpus, bs):
                whole = shards > 1 and not _short_text(corpus_of(0, 1), bs)
                raise ValueError(f"data: {problem}; " + ("set data.num_shards to 1 (all of the text is enough)"
                                                         if whole else _more_text(bs)))
            data_seed = int.from_bytes(hashlib.sha256(f"{cfg.seed}/{peer_id}".encode()).digest()[:4], "big")
            sampler = BatchSampler(corpus.train, cfg.data.batch_size, cfg.model.block_size, data_seed)
            heldout = heldout_batches(corpus.heldout, cfg.data.batch_size, cfg.model.block_size, cfg.data.eval_batches)
        except (ValueError, OSError) as e:
            raise ConfigError(str(e)) from None
        unit = "tokens" if cfg.data.tokenizer else "bytes"
        notes = [(logging.WARNING, f"{name}: {fallback}; this node trains on all of the training text instead")] \
            if fallback else []
        notes += [(logging.INFO, f"{name}: model {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters "
                                 f"{f'from {cfg.model.factory} ' if cfg.model.factory else ''}"
                                 f"in {len(fragments)} fragments on {device}; corpus of {len(files)} file(s), data "
                                 f"shard {shard}/{shards}: {corpus.train.numel()} training {unit}, "
                                 f"{corpus.heldout.numel()} held-out {unit}")]
        if note := topk2_note(cfg.outer):
            notes += [(logging.WARNING, f"{name}: {note}")]
        learner = Learner(model, fragments, cfg.inner)
        return cls(cfg, name, model, tuple(fragments), learner, sampler, heldout, tuple(notes),
                   bytes_per_token=corpus.bytes_per_token)

    def log_notes(self) -> None:
        """Log what :meth:`build` found (model size, data share, a fallback to all of the text),
        once the node is up: a node that fails to start says one line and nothing else."""
        for level, message in self.notes:
            log.log(level, "%s", message)

    def training_loop(self, dispatch: Dispatch, deadline: float | None = None) -> TrainingLoop:
        out = self.cfg.outer
        schedule = StaggeredSchedule(out.sync_every, out.fragments, out.overlap)
        return TrainingLoop(self.learner, schedule, self.sampler, self.heldout, dispatch,
                            max_steps=self.cfg.max_steps, deadline=deadline, eval_every=self.cfg.eval_every,
                            synchronous=out.synchronous, keep_flight=out.on_arrival == "keep")

    def global_model(self, states) -> nn.Module:
        """The model as if it held the global parameters Θ of ``states``, for evaluation
        (:class:`p2pdiloco.exported.GlobalView`: no copy of the weights, so checking a state
        adds no model-sized memory, p2pdiloco.footprint; training may go on meanwhile)."""
        return GlobalView(self.model, self.fragments, states)
