"""A DiLoCo node as a real OS process, for the fault tests.

    python tests/diloco/proc.py worker --store URL --node ID --steps N --report R [...]
    python tests/diloco/proc.py master --store URL --node ID --expect a,b --report R [...]

Progress is written to ``--progress`` (the step count); ``--stop-at N`` freezes the process
right after step N so a test can kill or resume it at that exact point; crash points come from
SPEEDTRONIC_DILOCO_CRASH_AT.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from harness import FakeTrainer, TinyModel, initial_weights, make_cfg, train  # noqa: E402

from speedtronic.diloco import codec  # noqa: E402
from speedtronic.diloco.node import Worker  # noqa: E402
from speedtronic.diloco.service import MasterThread  # noqa: E402


def _write(path: str | None, data: dict) -> None:
    if path:
        tmp = Path(path + ".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)


def worker(a: argparse.Namespace) -> None:
    cfg = make_cfg(a.store, inner_steps=a.h, compression=a.codec,
                   final_sync_timeout=a.final_sync, poll_interval=a.poll,
                   max_unapplied=a.max_unapplied, unapplied_wait=a.unapplied_wait)
    model = TinyModel(seed=0)
    trainer = FakeTrainer(model)
    cb = Worker(cfg, node_id=a.node)

    def on_step(step: int) -> None:
        if a.progress:
            Path(a.progress).write_text(str(step))
        if step == a.stop_at:
            # Freeze (all threads) at exactly this step; the test SIGKILLs or SIGCONTs it. Polling
            # the progress file and killing "soon" raced: under load a 30-step worker finished,
            # done marker and all, before the kill landed.
            os.kill(os.getpid(), signal.SIGSTOP)
        if a.step_time:
            time.sleep(a.step_time)  # stands in for compute; never used to synchronize

    train(cb, trainer, a.steps, shard=a.shard, on_step=on_step)
    params = {k: p.detach() for k, p in model.named_parameters()}
    _write(a.report, {"node": a.node, "session": cb.session, "version": cb.version,
                      "digest": cb.digest, "weights_digest": codec.tensor_digest(params),
                      "final_synced": cb.final_synced, "last_seq": cb.last_seq,
                      "metrics": cb.metrics()})


def master(a: argparse.Namespace) -> None:
    cfg = make_cfg(a.store, outer_optimizer=a.outer, max_staleness=a.max_staleness,
                   poll_interval=a.poll, delete_processed=a.delete,
                   max_object_mb=a.max_object_mb)
    expect = {n for n in a.expect.split(",") if n}
    t = MasterThread(cfg, a.node, lambda: initial_weights(0))
    t.until = lambda m: m.all_done(expect)
    t.start()
    t.join()
    m = t.master
    _write(a.report, {"node": a.node, "error": repr(t.error) if t.error else None,
                      "version": m.pointer.version if m.pointer else -1, "epoch": m.epoch,
                      "totals": m.totals, "quarantined": m.quarantined})
    if t.error is not None:
        sys.exit(3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["worker", "master"])
    p.add_argument("--store", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--report")
    p.add_argument("--progress")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--h", type=int, default=5)
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--codec", default="none")
    p.add_argument("--final-sync", type=float, default=60.0)
    p.add_argument("--poll", type=float, default=0.05)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--stop-at", type=int, default=-1, help="SIGSTOP itself after this step")
    p.add_argument("--expect", default="")
    p.add_argument("--outer", default="delayed_nesterov")
    p.add_argument("--max-staleness", type=int, default=8)
    p.add_argument("--delete", action="store_true")
    p.add_argument("--max-object-mb", type=float, default=None)
    p.add_argument("--max-unapplied", type=int, default=4)
    p.add_argument("--unapplied-wait", type=float, default=30.0)
    a = p.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(relativeCreated)6d [{a.node}] %(name)s: %(message)s")
    worker(a) if a.role == "worker" else master(a)


if __name__ == "__main__":
    main()
