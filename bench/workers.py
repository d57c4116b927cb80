"""One training process of a baseline system, started by the benchmarks (never by hand).

    python -m bench.workers MODE --rank R --world N --out RESULT.json --settings JSON [...]

MODE:
  standalone  the learner alone: no network, no peers (the reference throughput)
  ddp         PyTorch DistributedDataParallel over torch.distributed gloo (gradient
              all-reduce every inner step)
  diloco      synchronous DiLoCo (DiLoCo arXiv 2311.08105, as OpenDiLoCo): every H inner steps
              a gloo all-reduce of the whole model's pseudo-gradient (mean over ranks), then the
              same fp32 Nesterov outer step as p2pdiloco (p2pdiloco.core.outer)
  torchft     torchft's DiLoCo (torchft.local_sgd.DiLoCo, Manager, ProcessGroupGloo, its
              lighthouse), one replica group of one process per rank

Every mode trains the same thing as a p2pdiloco node with the same ``--set`` settings: the
model from ``build_model(cfg.model, cfg.seed)``, AdamW with the same schedule and clipping
(``p2pdiloco.core.learner.Learner``), data shard ``rank`` of ``world`` of the default corpus,
and the same held-out batches. Batches are drawn with the seed ``seed * 1000 + rank``.

The process writes ``--status`` (JSON, about every second: tokens trained, tokens merged,
CPU seconds) while it runs and ``--out`` (rank 0: final held-out loss) at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from p2pdiloco.config import load_config
from p2pdiloco.core.fragments import balanced_fragments
from p2pdiloco.core.learner import Learner
from p2pdiloco.core.outer import nesterov_outer_step
from p2pdiloco.data import BatchSampler, default_corpus_files, evaluate, heldout_batches, load_corpus
from p2pdiloco.model import build_model


def _write(path: Path | None, data: dict) -> None:
    if path is None:
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


class Worker:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.cfg = cfg = load_config(env={}, overrides=json.loads(args.settings))
        torch.set_num_threads(cfg.threads)
        self.model = build_model(cfg.model, cfg.seed)
        files = default_corpus_files()
        corpus = load_corpus(files, args.rank, args.world, cfg.data.heldout_fraction, cfg.data.max_bytes or None)
        self.sampler = BatchSampler(corpus.train, cfg.data.batch_size, cfg.model.block_size, cfg.seed * 1000 + args.rank)
        self.heldout = heldout_batches(corpus.heldout, cfg.data.batch_size, cfg.model.block_size, cfg.data.eval_batches)
        self.tokens = self.merged = self.pending = 0
        self.t_start = time.time()
        self.cpu_start = time.process_time()
        self.next_status = 0.0
        self.status = Path(args.status) if args.status else None
        self.deadline = time.monotonic() + args.duration if args.duration else None

    def learner(self, module: torch.nn.Module, embeddings: tuple[str, ...]) -> Learner:
        shapes = [(n, tuple(p.shape)) for n, p in module.named_parameters()]
        return Learner(module, balanced_fragments(shapes, 1, embeddings), self.cfg.inner)

    def step(self, learner: Learner) -> None:
        x, y = self.sampler.next()
        learner.inner_step(x, y)
        self.tokens += x.numel()
        self.pending += x.numel()
        self.report()

    def report(self, force: bool = False) -> None:
        now = time.time()
        if force or now >= self.next_status:
            _write(self.status, {"t": now, "tokens": self.tokens, "merged": self.merged,
                                 "cpu_s": time.process_time() - self.cpu_start, "pid": os.getpid()})
            self.next_status = now + 1.0

    def budget_left(self, steps_done: int) -> bool:
        if self.args.steps and steps_done >= self.args.steps:
            return False
        return self.deadline is None or time.monotonic() < self.deadline

    def finish(self, model: torch.nn.Module, start_loss: float, extra: dict | None = None) -> None:
        self.report(force=True)
        result = {"rank": self.args.rank, "tokens": self.tokens, "merged": self.merged,
                  "wall_s": time.time() - self.t_start, "cpu_s": time.process_time() - self.cpu_start,
                  "start_loss": start_loss, **(extra or {})}
        if self.args.rank == 0 or self.args.mode in ("standalone", "torchft"):
            result["end_loss"] = evaluate(model, self.heldout)
        _write(Path(self.args.out), result)


def run_standalone(w: Worker) -> None:
    learner = w.learner(w.model, w.model.embedding_names())
    start = evaluate(w.model, w.heldout) if w.args.eval_start else float("nan")
    steps = 0
    while w.budget_left(steps):
        w.step(learner)
        w.merged = w.tokens  # nothing to merge with: every token counts
        steps += 1
    w.finish(w.model, start, {"steps": steps})


def _init_gloo(w: Worker) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{w.args.port}", rank=w.args.rank,
                            world_size=w.args.world, timeout=timedelta(seconds=120))


def _stop_flag(w: Worker, steps: int) -> bool:
    """Duration runs: every rank stops at the same step (rank 0's clock decides)."""
    if w.deadline is None:
        return not w.budget_left(steps)
    flag = torch.tensor([1 if (w.args.rank == 0 and not w.budget_left(steps)) else 0])
    dist.broadcast(flag, 0)
    return bool(flag.item())


def run_ddp(w: Worker) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415

    _init_gloo(w)
    start = evaluate(w.model, w.heldout) if w.args.eval_start else float("nan")
    ddp = DDP(w.model)
    learner = w.learner(ddp, tuple(f"module.{n}" for n in w.model.embedding_names()))
    steps = 0
    while True:
        if w.deadline is not None and steps % 10 == 0 and _stop_flag(w, steps):
            break
        if w.deadline is None and not w.budget_left(steps):
            break
        w.step(learner)  # the backward pass all-reduces the gradients
        w.merged = w.tokens
        steps += 1
    dist.barrier()
    w.finish(w.model, start, {"steps": steps})
    dist.barrier()  # no rank tears gloo down while another still evaluates (a teardown race aborted a rank)
    dist.destroy_process_group()


def run_diloco(w: Worker) -> None:
    _init_gloo(w)
    H, out = w.args.H, w.cfg.outer
    start = evaluate(w.model, w.heldout) if w.args.eval_start else float("nan")
    learner = w.learner(w.model, w.model.embedding_names())
    steps = 0
    while True:
        w.step(learner)
        steps += 1
        if steps % H == 0:
            delta = learner.pseudo_gradient(0)
            flat = torch.cat([d.reshape(-1) for d in delta])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat /= w.args.world
            merged = [c.view_as(d) for c, d in zip(flat.split([d.numel() for d in delta]), delta)]
            learner.install(nesterov_outer_step(learner.global_states[0], merged, out.lr, out.momentum))
            w.merged += w.pending
            w.pending = 0
            w.report(force=True)
            if _stop_flag(w, steps):
                break
    dist.barrier()
    w.finish(w.model, start, {"steps": steps})
    dist.barrier()  # no rank tears gloo down while another still evaluates (a teardown race aborted a rank)
    dist.destroy_process_group()


def run_torchft(w: Worker) -> None:
    from torch.distributed import TCPStore  # noqa: PLC0415
    from torchft import Manager, ProcessGroupGloo  # noqa: PLC0415
    from torchft.local_sgd import DiLoCo  # noqa: PLC0415

    H, out = w.args.H, w.cfg.outer
    start = evaluate(w.model, w.heldout) if w.args.eval_start else float("nan")
    learner = w.learner(w.model, w.model.embedding_names())
    outer_opt = torch.optim.SGD(w.model.parameters(), lr=out.lr, momentum=out.momentum, nesterov=True)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def state_dict() -> dict:
        return {"model": w.model.state_dict(), "inner": learner.optimizer.state_dict(), "step": learner.step}

    def load_state_dict(sd: dict) -> None:
        w.model.load_state_dict(sd["model"])
        learner.optimizer.load_state_dict(sd["inner"])
        learner.step = int(sd["step"])

    timeout = timedelta(seconds=w.args.ft_timeout)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
                      min_replica_size=w.args.min_replicas, use_async_quorum=False, timeout=timeout,
                      quorum_timeout=timedelta(seconds=w.args.ft_quorum_timeout), connect_timeout=timeout,
                      rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
                      lighthouse_addr=w.args.lighthouse, replica_id=f"replica{w.args.rank}", hostname="127.0.0.1",
                      init_sync=False)
    commits = failed = 0
    try:
        with DiLoCo(manager, [w.model], learner.optimizer, outer_opt, sync_every=H, backup_device=torch.device("cpu"),
                    pin_memory=False) as diloco:
            steps = 0
            while w.budget_left(steps):
                before = manager.current_step()
                w.step(learner)  # the optimizer's post-step hook syncs every H steps
                steps += 1
                if diloco._local_step == 0:  # a sync just ran: committed iff the manager's step advanced
                    if manager.current_step() > before:
                        w.merged += w.pending
                        commits += 1
                    else:
                        failed += 1  # torchft restored the last global parameters: progress lost
                    w.pending = 0
                    w.report(force=True)
            # evaluate the global parameters (torchft keeps them as the fragment's backup), not
            # the local progress since the last sync
            final = build_model(w.cfg.model, w.cfg.seed)
            with torch.no_grad():
                for name, q in final.named_parameters():
                    q.copy_(diloco._fragments[0].original_parameters[name])
        w.finish(final, start, {"steps": steps, "commits": commits, "failed_syncs": failed,
                                "manager_step": manager.current_step()})
    finally:
        manager.shutdown(wait=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["standalone", "ddp", "diloco", "torchft"])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--settings", required=True, help="JSON object of --set values (the nodes' settings)")
    p.add_argument("--status", default=None)
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--duration", type=float, default=0.0)
    p.add_argument("--H", type=int, default=100, help="inner steps between outer syncs (diloco, torchft)")
    p.add_argument("--port", type=int, default=29500, help="gloo rendezvous port (ddp, diloco)")
    p.add_argument("--lighthouse", default="", help="torchft lighthouse address, http://HOST:PORT")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--ft-timeout", type=float, default=20.0)
    p.add_argument("--ft-quorum-timeout", type=float, default=60.0)
    p.add_argument("--eval-start", type=int, default=0)
    args = p.parse_args()
    w = Worker(args)
    {"standalone": run_standalone, "ddp": run_ddp, "diloco": run_diloco, "torchft": run_torchft}[args.mode](w)


if __name__ == "__main__":
    main()
