"""The trained model taken out of a run: the export folder, loading it, evaluating and sampling.

An export folder (``p2pdiloco model export``, node/export.py) holds:

* ``model.safetensors``: the swarm's global parameters Θ, fp32, keyed by ``model.state_dict()``
  names (every ``named_parameters`` name; a tied weight also under its alias, as its own copy,
  e.g. the built-in GPT's ``lm_head.weight`` = ``wte.weight``; a factory module's persistent
  buffers as built), so that ``model.load_state_dict(safetensors.torch.load_file(path),
  strict=True)`` takes it;
* ``config.json``: ``{"format": 1, "seed": int, "model": {the [model] settings}, "data": {path,
  heldout_fraction, max_bytes, batch_size, eval_batches}}``: enough to rebuild the module
  (:func:`p2pdiloco.model.build_model`) and the nodes' held-out batches;
* ``export.json``: per fragment its version and digest, the global digest, the sha256 of
  ``model.safetensors`` (a copy that does not match is refused on load);
* ``hf/`` (a transformers model only: ``model.factory`` building a ``transformers.PreTrainedModel``,
  e.g. ``p2pdiloco.models.hf:llama``): the same weights in Hugging Face's layout (its own
  ``config.json`` and ``model.safetensors``, by ``save_pretrained``), which
  ``transformers.AutoModelForCausalLM.from_pretrained(OUT / "hf")`` loads without p2pdiloco.

Tokens are raw bytes (:mod:`p2pdiloco.data`); generation emits bytes.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.nn as nn
from torch import Tensor

from p2pdiloco.atomic import write_bytes_atomic
from p2pdiloco.config import NodeConfig, load_config
from p2pdiloco.core.fragments import Fragment
from p2pdiloco.core.outer import FragmentState
from p2pdiloco.data import default_corpus_files, heldout_batches, load_corpus
from p2pdiloco.formats import collect_files
from p2pdiloco.tokenizer import load as load_tokenizer
from p2pdiloco.errors import ConfigError
from p2pdiloco.model import build_model
from p2pdiloco.model_config import ModelConfig

__all__ = ["MODEL_FILE", "CONFIG_FILE", "EXPORT_FILE", "FORMAT", "HF_DIR", "settings_config", "data_path_of", "read_json", "load_global",
           "global_parameters", "GlobalView",
           "write_export", "write_hf", "Exported", "load_export", "heldout_of", "heldout_with_bytes", "generate"]

MODEL_FILE, CONFIG_FILE, EXPORT_FILE, HF_DIR = "model.safetensors", "config.json", "export.json", "hf"
FORMAT = 1
EVAL_FIELDS = ("heldout_fraction", "max_bytes", "batch_size", "eval_batches",  # the held-out batches' settings
               "format", "text_field", "tokenizer", "tokenizer_sha256")  # and how the text is read (formats, tokenizer)
MAX_JSON_BYTES = 1 << 20  # config.json, export.json, node-config.json


def settings_config(settings: Any, source: str) -> NodeConfig:
    """The settings an export needs (``seed``, ``model.*``, ``outer.fragments``, the data
    fields of the held-out batches) out of ``settings``, a nested JSON dict (``{"seed": 0,
    "model": {...}, "data": {...}}``: a node's ``node-config.json`` or an export's
    ``config.json``), typed and checked by :func:`p2pdiloco.config.load_config` (the
    environment is not read); other fields and ``data.path`` are not used here.

    Raises:
        ConfigError: one line per problem, naming the setting and ``source``.
    """
    if not isinstance(settings, Mapping):
        raise ConfigError(f"{source}: expected a JSON object of settings")
    picked: dict[str, Any] = {"seed": settings["seed"]} if "seed" in settings else {}
    model_fields = tuple(f.name for f in dataclasses.fields(ModelConfig))
    for section, names in (("model", model_fields), ("outer", ("fragments",)), ("data", EVAL_FIELDS)):
        values = settings.get(section, {})
        if not isinstance(values, Mapping):
            raise ConfigError(f"{source}: {section}: expected an object of settings")
        picked.update({f"{section}.{k}": values[k] for k in names if k in values})
    return load_config(None, env={}, overrides=picked, overrides_source=f"in {source}")


def data_path_of(settings: Any, source: str) -> str:
    """``data.path`` of ``settings`` (as :func:`settings_config` takes them), not checked for
    existence: the text a node trained on ("" = the Python standard library's source).
    Raises ConfigError when it is not a string."""
    data = settings.get("data") if isinstance(settings, Mapping) else None
    path = data.get("path", "") if isinstance(data, Mapping) else ""
    if not isinstance(path, str):
        raise ConfigError(f"{source}: data.path: expected a string, got {path!r}")
    return path


def read_json(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path`` (at most 1 MiB). Raises ConfigError (missing, too large, not
    a JSON object), naming ``what``."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{what}: cannot read {path}: {e.strerror or e}") from None
    if len(raw) > MAX_JSON_BYTES:
        raise ConfigError(f"{what}: {path} is larger than {MAX_JSON_BYTES} bytes")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{what}: {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {path} holds no JSON object")
    return data


def global_parameters(fragments: Sequence[Fragment], states: Sequence[FragmentState]) -> dict[str, Tensor]:
    """The global parameters Θ of ``states`` (fp32, slot shapes) by the slot names of
    ``fragments`` (state p for fragment p): {parameter name: tensor}, the states' own tensors.
    Raises ValueError when the counts or a shape differ."""
    if len(states) != len(fragments):
        raise ValueError(f"{len(states)} fragment states for {len(fragments)} fragments")
    out = {}
    for frag, state in zip(fragments, states):
        if len(state.theta) != len(frag.slots):
            raise ValueError(f"fragment {frag.index}: {len(state.theta)} tensors, expected {len(frag.slots)}")
        for slot, theta in zip(frag.slots, state.theta):
            if tuple(theta.shape) != slot.shape:
                raise ValueError(f"{slot.name}: shape {tuple(theta.shape)}, the model's is {slot.shape}")
            out[slot.name] = theta
    return out


def load_global(model: nn.Module, fragments: Sequence[Fragment], states: Sequence[FragmentState]) -> nn.Module:
    """Copy the global parameters Θ of ``states`` (:func:`global_parameters`) into ``model``'s
    parameters; returns ``model``. Raises ValueError when the counts or a shape differ."""
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, theta in global_parameters(fragments, states).items():
            named[name].copy_(theta)
    return model


class GlobalView(nn.Module):
    """``model`` as if it held the global parameters Θ of ``states``, without a copy of its
    weights: its module tree copied without its tensors (``copy.deepcopy`` with every
    parameter and buffer memoized as itself), called with Θ in place of the parameters
    (``torch.func.functional_call``). ``model`` itself is never touched, so another thread may
    train it meanwhile; the view is for evaluation (``forward(idx)`` as ``model``'s, under
    ``torch.no_grad``). Raises ValueError as :func:`global_parameters`."""

    def __init__(self, model: nn.Module, fragments: Sequence[Fragment], states: Sequence[FragmentState]) -> None:
        super().__init__()
        theta = global_parameters(fragments, states)
        device = next(model.parameters()).device
        if device.type != "cpu":  # the states are CPU tensors (invariant I1); the model's device runs the view
            theta = {k: v.to(device) for k, v in theta.items()}
        shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
        self.tree = copy.deepcopy(model, memo=shared)
        self._theta = theta

    def forward(self, idx: Tensor) -> Tensor:
        return torch.func.functional_call(self.tree, self._theta, (idx,))


def write_export(out: Path, model: nn.Module, cfg: NodeConfig, data_path: str,
                 info: Mapping[str, Any]) -> dict[str, Any]:
    """Write ``out``/model.safetensors (``model.state_dict()`` as fp32 CPU tensors, tied
    aliases as their own copies: safetensors stores no shared tensors), config.json (from
    ``cfg``, and ``data_path``: the text the node trained on) and export.json (``info`` plus ``format`` and ``model_sha256``), each atomically,
    export.json last; for a transformers model, ``out``/hf first (:func:`write_hf`). Returns
    export.json's content. Raises OSError."""
    tensors = {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype).contiguous().clone()
               for k, v in model.state_dict().items()}
    blob = safetensors.torch.save(tensors, metadata={"format": "pt"})
    config = {"format": FORMAT, "seed": cfg.seed, "model": dataclasses.asdict(cfg.model),
              "data": {"path": data_path, **{k: getattr(cfg.data, k) for k in EVAL_FIELDS}}}
    meta = {"format": FORMAT, **info, "model_sha256": hashlib.sha256(blob).hexdigest()}
    if write_hf(out / HF_DIR, model):
        meta["hf"] = HF_DIR
    for name, data in ((MODEL_FILE, blob), (CONFIG_FILE, json.dumps(config, indent=1).encode()),
                       (EXPORT_FILE, json.dumps(meta, indent=1).encode())):  # a model to share: readable by all
        write_bytes_atomic(out / name, data, mode=0o644)
    return meta


def write_hf(folder: Path, model: nn.Module) -> bool:
    """When ``model`` wraps a transformers model (``FactoryModel.net`` is a
    ``transformers.PreTrainedModel``), write it with its ``save_pretrained`` (safetensors, fp32)
    into a fresh temporary folder next to ``folder`` and rename that to ``folder`` (a previous
    export there is replaced whole); returns whether it wrote. Other models: nothing, False.
    Raises OSError."""
    hf = sys.modules.get("transformers")  # imported by the factory of a transformers model, else absent
    net = getattr(model, "net", None)
    if hf is None or not isinstance(net, hf.PreTrainedModel):
        return False
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        net.save_pretrained(tmp, safe_serialization=True)
        for f in tmp.iterdir():
            f.chmod(0o644)  # a model to share: readable by all (mkdtemp's files and folder are private)
        tmp.chmod(0o755)
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True


@dataclass(frozen=True)
class Exported:
    """An export folder loaded: the module (CPU, eval mode), its settings, export.json."""

    model: nn.Module
    cfg: NodeConfig
    info: dict[str, Any]
    data_path: str  # the data the node trained on ("" = the Python standard library's source)


def load_export(folder: Path) -> Exported:
    """Load an export folder (see the module docstring) into a freshly built module.

    Raises:
        ConfigError: a file is missing or malformed, the settings are invalid, the model file
            does not match export.json's sha256, or its tensors do not fit the module.
    """
    folder = Path(folder)
    if not (folder / EXPORT_FILE).is_file():
        raise ConfigError(f"{folder} is not a model export (no {EXPORT_FILE}; see p2pdiloco model export)")
    config, info = read_json(folder / CONFIG_FILE, "--model"), read_json(folder / EXPORT_FILE, "--model")
    for name, d in ((CONFIG_FILE, config), (EXPORT_FILE, info)):
        if d.get("format") != FORMAT:
            raise ConfigError(f"--model: {folder / name} has format {d.get('format')!r}, expected {FORMAT}")
    cfg = settings_config(config, str(folder / CONFIG_FILE))
    data_path = data_path_of(config, str(folder / CONFIG_FILE))
    try:
        blob = (folder / MODEL_FILE).read_bytes()
    except OSError as e:
        raise ConfigError(f"--model: cannot read {folder / MODEL_FILE}: {e.strerror or e}") from None
    if hashlib.sha256(blob).hexdigest() != info.get("model_sha256"):
        raise ConfigError(f"--model: {folder / MODEL_FILE} does not match {EXPORT_FILE} (a partial or mixed copy?)")
    try:
        model = build_model(cfg.model, cfg.seed)
        model.load_state_dict(safetensors.torch.load(blob), strict=True)
    except (ValueError, RuntimeError) as e:  # a factory that fails, tensors of other names or shapes
        raise ConfigError(f"--model: {folder / MODEL_FILE} does not fit the model of {CONFIG_FILE}: "
                          f"{str(e).strip().splitlines()[0]}") from None
    return Exported(model.eval(), cfg, info, data_path)


def heldout_of(cfg: NodeConfig, data_path: str) -> list[tuple[Tensor, Tensor]]:
    """The held-out batches every node of ``cfg`` evaluates on for the text at ``data_path``
    ("" = the Python standard library's source): the same split (:func:`p2pdiloco.data.load_corpus`,
    which holds pieces out before any shard is chosen), the same ``max_bytes`` cap and batches
    (:func:`p2pdiloco.data.heldout_batches`). List of (inputs, targets), int64 [B, T].

    Raises:
        ConfigError: the path does not exist, holds no usable text, or too little held-out text.
    """
    return heldout_with_bytes(cfg, data_path)[0]


def heldout_with_bytes(cfg: NodeConfig, data_path: str) -> tuple[list[tuple[Tensor, Tensor]], float]:
    """:func:`heldout_of`'s batches and the held-out text's mean bytes per token
    (:attr:`p2pdiloco.data.Corpus.bytes_per_token`, 1.0 without a tokenizer). Raises as :func:`heldout_of`."""
    try:
        files = collect_files(Path(data_path), cfg.data.format) if data_path else default_corpus_files()
        tok = load_tokenizer(cfg.data.tokenizer) if cfg.data.tokenizer else None  # as the node read its text
        corpus = load_corpus(files, 0, 1, cfg.data.heldout_fraction, cfg.data.max_bytes or None,
                             fmt=cfg.data.format, text_field=cfg.data.text_field, tokenizer=tok)
        batches = heldout_batches(corpus.heldout, cfg.data.batch_size, cfg.model.block_size, cfg.data.eval_batches)
    except (ValueError, OSError) as e:
        raise ConfigError(f"--data: {e}") from None
    return batches, corpus.bytes_per_token


@torch.no_grad()
def generate(model: nn.Module, prompt: bytes, tokens: int, *, block_size: int, temperature: float = 1.0,
             seed: int = 0) -> bytes:
    """``tokens`` bytes sampled after ``prompt`` (bytes; empty: a newline as context), one at a
    time from the model's next-byte distribution softmax(logits / ``temperature``) over the 256
    byte values (temperature 0: the most likely byte), the context cut to the last
    ``block_size`` bytes. Draws come from a CPU ``torch.Generator`` seeded with ``seed``: the
    same bytes for the same model, prompt and seed. Runs on the model's device; returns the new
    bytes only. Raises ValueError on tokens < 0, a negative or non-finite temperature, or a
    seed outside [0, 2**63)."""
    if tokens < 0 or not (math.isfinite(temperature) and temperature >= 0) or not 0 <= seed < 2**63:
        raise ValueError(f"need tokens >= 0, a finite temperature >= 0 and 0 <= seed < 2**63, "
                         f"got {tokens}, {temperature}, {seed}")
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    idx = torch.tensor([list(prompt or b"\n")], dtype=torch.long, device=device)  # [1, T]
    out = bytearray()
    was_training = model.training
    model.eval()
    try:
        for _ in range(tokens):
            logits = model(idx[:, -block_size:])[0, -1, :256].float().cpu()  # [256]: byte values only
            if temperature == 0:
                nxt = int(logits.argmax())
            else:
                nxt = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))
            out.append(nxt)
            idx = torch.cat([idx, torch.tensor([[nxt]], device=device)], dim=1)[:, -block_size:]
    finally:
        model.train(was_training)
    return bytes(out)
