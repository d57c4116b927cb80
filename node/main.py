"""Run one node: start the transport, build the learner, train, report. Used by the CLI."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from p2pdiloco.config import NodeConfig
from p2pdiloco.data import bits_per_byte, evaluate
from p2pdiloco.net.transport import Swarm

from node.runtime import Node
from node.setup import Setup

log = logging.getLogger(__name__)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` atomically (temp file in the same folder, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def global_digest(node: Node) -> str:
    """One hash over every fragment's (version, digest): equal iff all fragments are equal."""
    h = hashlib.sha256()
    for s in node.committed:
        h.update(f"{s.index}:{s.version}:{s.digest};".encode())
    return h.hexdigest()[:16]


def snapshot(node: Node, swarm: Swarm, maddrs: list[str]) -> dict[str, Any]:
    """The node's statistics as one JSON-able dict (rendered by the demo and `status`)."""
    tr = node.training.stats if node.training else None
    st = node.stats
    return {
        "name": node.setup.name, "peer_id": swarm.peer_id, "maddrs": maddrs, "pid": os.getpid(),
        "p2pd_pid": swarm.daemon_pid, "state": st.state, "uptime_s": round(time.time() - swarm.started_at, 1),
        "step": tr.step if tr else 0, "tokens": tr.tokens if tr else 0,
        "tokens_per_s": round(tr.tokens_per_s, 1) if tr else 0.0,
        "loss": tr.loss if tr else None, "heldout_loss": tr.heldout_loss if tr else None,
        "rounds_committed": st.rounds_committed, "rounds_failed": st.rounds_failed,
        "rounds_late": st.rounds_late, "rounds_alone": st.rounds_alone, "catchups": st.catchups,
        "tokens_merged": st.tokens_merged,
        "last_round": vars(st.recent[-1]) if st.recent else None,
        "bytes_out": swarm.stats.bytes_out, "bytes_in": swarm.stats.bytes_in,
        "fragments": [[s.version, s.short()] for s in node.committed],
        "global_digest": global_digest(node),
    }


async def run_node(cfg: NodeConfig, *, name: str = "node", status_path: Path | None = None,
                   report_path: Path | None = None, on_ready=None) -> dict[str, Any]:
    """Run one node to the end of its budget or until SIGINT/SIGTERM; returns its report.

    Raises:
        NetworkError: the transport could not start or join.
        ConfigError: the data or model settings cannot work.
    """
    data_dir = Path(cfg.data_dir) if cfg.data_dir else None
    identity = str(data_dir / "p2p.key") if data_dir else None
    if data_dir:
        data_dir.mkdir(parents=True, exist_ok=True)
    sw = cfg.swarm
    from p2pdiloco.trust import load_node_trust  # noqa: PLC0415  (identity, private-swarm membership)

    trust = load_node_trust(cfg.trust, data_dir)
    swarm = await Swarm.start(initial_peers=sw.initial_peers, host_maddrs=[f"/ip4/{sw.host}/tcp/{sw.port}"],
                              announce_maddrs=sw.announce, identity=trust.identity, membership=trust.membership,
                              admission_key=f"{sw.run_id}/heads")
    try:
        maddrs = await swarm.visible_maddrs()
        setup = await asyncio.to_thread(Setup.build, cfg, name, swarm.peer_id)
        node = Node(setup, swarm)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, node.stop)
        if on_ready is not None:
            on_ready(swarm.peer_id, maddrs)

        async def write_status() -> None:
            while True:
                if status_path is not None:
                    await asyncio.to_thread(write_json_atomic, status_path, snapshot(node, swarm, maddrs))
                await asyncio.sleep(1.0)

        async with asyncio.TaskGroup() as tg:
            writer = tg.create_task(write_status())
            try:
                await node.run()
            finally:
                writer.cancel()
        report = snapshot(node, swarm, maddrs)
        final = await asyncio.to_thread(evaluate, setup.global_model(node.committed), setup.heldout)
        start = node.training.stats.heldout_history[0][1]
        report.update(start_loss=start, end_loss=final, end_bits_per_byte=bits_per_byte(final),
                      heldout_history=node.training.stats.heldout_history, state="stopped")
        log.info("%s done: held-out loss %.3f -> %.3f nats/byte, %d rounds, digest %s",
                 name, start, final, node.stats.rounds_committed, report["global_digest"])
        for path in (status_path, report_path):
            if path is not None:
                write_json_atomic(path, report)
        return report
    finally:
        await swarm.shutdown()
