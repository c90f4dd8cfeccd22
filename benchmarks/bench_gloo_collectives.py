"""gloo's collectives on one CPU box, and where the owned-matrix Muon exchange spends its time.

Why this exists: ``data_parallel.reduce_scatter_muon`` moves the Muon gradients in a
reduce-scatter to their owners. On gloo that collective is slower than an all-reduce of the
same buffer, so the engine all-reduces there (``muon_owners.GLOO_REDUCE_SCATTER``). This bench
is the measurement behind that choice and behind the exchange breakdown quoted in
docs/scaling.md. Two gloo ranks, 1 thread each, side by side in one run:

* all-reduce, reduce-scatter and all-gather of one fp32 buffer of the bench model's Muon
  values (24 x 256^2, 6 x 1024x256, 6 x 256x1024 = 4.7M values, 18.9 MB), median of 15;
* the owned exchange of ``OwnerShardedHybrid`` on the same matrices: packing ``grad / W``
  into the bucket buffers and starting the collectives, waiting for them, and copying this
  rank's chunk out, median of 10.

    OMP_NUM_THREADS=1 python benchmarks/bench_gloo_collectives.py

Writes ``benchmarks/results/gloo_collectives_cpu.{json,md}``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SHAPES = [(256, 256)] * 24 + [(1024, 256)] * 6 + [(256, 1024)] * 6


def _median_ms(fn, n: int) -> float:
    import torch.distributed as dist

    times = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def worker(out: str) -> None:
    """Under torchrun: the timings of this rank, gathered to rank 0."""
    import torch.distributed as dist
    from torch import nn

    from speedtronic.distributed import muon_owners
    from speedtronic.optim import HybridOptimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    numel = sum(a * b for a, b in SHAPES)
    x = torch.randn(numel)
    part = torch.empty(numel // world)
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    row = {"all_reduce": _median_ms(lambda: dist.all_reduce(x), 15),
           "reduce_scatter": _median_ms(lambda: rs(part, x), 15),
           "all_gather": _median_ms(lambda: ag(x, part), 15)}

    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in SHAPES]
    grads = [torch.randn(s, generator=g) for s in SHAPES]
    opt = muon_owners.owner_sharded_optimizer(
        HybridOptimizer([{"kind": "muon", "params": params, "lr": 0.02}]))
    phases: dict[str, list[float]] = {"pack_and_start": [], "wait": [], "own_chunk": []}
    for _ in range(10):
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        dist.barrier()
        t0 = time.perf_counter()
        for b in opt.buckets:
            opt._launch(b)
        t1 = time.perf_counter()
        for b in opt.buckets:
            b.work.wait()
        t2 = time.perf_counter()
        for b in opt.buckets:
            b.work, b.ready = None, 0
            b.share.copy_(b.buffer[opt.rank * b.per:(opt.rank + 1) * b.per])
        t3 = time.perf_counter()
        for name, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            phases[name].append(dt)
    row.update({f"owned_{k}": 1e3 * statistics.median(v) for k, v in phases.items()})
    row["owned_buckets"] = len(opt.buckets)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, row)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_data import cpu_flags

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc-per-node=2", str(Path(__file__).resolve()), "--worker",
                               str(out)], capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=600)
        if proc.returncode:
            raise SystemExit(f"worker failed:\n{proc.stderr[-3000:]}")
        rows = json.loads(out.read_text())
    meta = {"torch": torch.__version__, "python": platform.python_version(), "cpu": cpu_flags(),
            "command": "OMP_NUM_THREADS=1 python benchmarks/bench_gloo_collectives.py",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "buffer": "4.7M fp32 values (18.9 MB)"}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gloo_collectives_cpu.json").write_text(json.dumps({"meta": meta, "ranks": rows},
                                                                   indent=1))
    lines = ["# gloo collectives on CPU, and the owned-matrix Muon exchange", "",
             f"`{meta['command']}`; torch {meta['torch']}, {meta['cpu']}; {meta['date']}; "
             "fp32; 2 gloo ranks on loopback, 1 thread each.", "",
             f"One buffer of {meta['buffer']}, the bench model's Muon values, median of 15:", "",
             "| rank | all-reduce (ms) | reduce-scatter (ms) | all-gather (ms) | "
             "reduce-scatter / all-reduce |", "|---|---:|---:|---:|---:|"]
    for r, row in enumerate(rows):
        lines.append(f"| {r} | {row['all_reduce']:.1f} | {row['reduce_scatter']:.1f} | "
                     f"{row['all_gather']:.1f} | {row['reduce_scatter'] / row['all_reduce']:.2f} |")
    lines += ["", "The owned exchange (`OwnerShardedHybrid`, gloo: all-reduce per bucket), "
              f"{rows[0]['owned_buckets']} buckets, median of 10:", "",
              "| rank | pack grad / W and start (ms) | wait (ms) | copy own chunk (ms) |",
              "|---|---:|---:|---:|"]
    for r, row in enumerate(rows):
        lines.append(f"| {r} | {row['owned_pack_and_start']:.1f} | {row['owned_wait']:.1f} | "
                     f"{row['owned_own_chunk']:.1f} |")
    (RESULTS / "gloo_collectives_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
