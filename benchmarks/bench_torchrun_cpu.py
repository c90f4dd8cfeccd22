"""Data parallelism on CPU: ``torchrun`` against one process, and the sharded Muon step.

Two measurements, each side by side in one invocation:

* **engine tokens/s** on the same total cores: one process with 2 threads, one process with 1
  thread, and ``torchrun --nproc-per-node 2`` with 1 thread per rank (the job's global tokens/s
  from rank 0's ``metrics.jsonl``: median of the log rows after the first). Rounds interleave
  the three so a noisy neighbour hits them alike.
* **the Muon step per rank**, replicated (every rank orthogonalizes every matrix) against
  sharded (``process_group=``: each rank 1/W of each shape group, then an all-gather), ZeRO-1
  and owned matrices (``data_parallel.reduce_scatter_muon``: a reduce-scatter of the gradients
  to each matrix's owner, its step, an all-gather of the matrices), on 2 gloo ranks, 1 thread
  each, interleaved step by step; median time per rank of the step alone and of the gradient
  exchange plus the step (an all-reduce of the flat gradient buffer, as DDP's bucket, for the
  first three; the reduce-scatter for owned matrices), since the last one moves the exchange.

    OMP_NUM_THREADS=1 python benchmarks/bench_torchrun_cpu.py [--rounds 3] [--steps 60]

Writes ``benchmarks/results/torchrun_cpu.{json,md}``.
"""

from __future__ import annotations

import argparse
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
import yaml

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# a 6-layer reference model at d_model 256 (~5M parameters): large enough that a CPU step is
# compute, not dispatch, and that 2 ranks have 12+ Muon matrices per shape group to share
MODEL = {"d_model": 256, "n_layer": 6, "n_head": 4, "max_seq_len": 128}
MUON_SHAPES = [(256, 256)] * 24 + [(1024, 256)] * 6 + [(256, 1024)] * 6


def _env(threads: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    return env


def engine_config(tmp: Path, name: str, steps: int, threads: int) -> Path:
    """The bench job; a name starting with ``zero`` turns on ``data_parallel.zero1``, one
    starting with ``owned`` ``data_parallel.reduce_scatter_muon``."""
    raw = {
        "run": {"name": name, "output_dir": str(tmp), "max_steps": steps, "eval_every": 0,
                "seed": 0, "device": "cpu", "num_threads": threads},
        "model": MODEL,
        "data": {"micro_batch_size": 8, "target_batch_size": 16, "stdlib_max_bytes": 4_000_000},
        "optimizer": {"name": "muon"},
        "logging": {"every_steps": 10, "progress_bar": False},
        "checkpoint": {"enabled": False},
        "shape_validation": {"enabled": False},
        "compile": False,
        "data_parallel": {"zero1": name.startswith("zero"),
                          "reduce_scatter_muon": name.startswith("owned")},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run_engine(tmp: Path, name: str, steps: int, threads: int, nproc: int) -> float:
    """The job's median tokens/s over its log rows after the first."""
    cfg = engine_config(tmp, name, steps, threads)
    train = ["-m", "speedtronic", "train", "--config", str(cfg)]
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", *train] if nproc > 1 else [sys.executable, *train])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(threads), cwd=ROOT,
                          timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_sec"] for r in rows if r["event"] == "train_step"][1:]
    return statistics.median(rates)


def muon_step_worker(steps: int, out: str) -> None:
    """Under torchrun: time the replicated and the sharded Muon step, interleaved."""
    import torch.distributed as dist
    from torch import nn

    from speedtronic.distributed.muon_owners import owner_sharded_optimizer
    from speedtronic.optim import HybridOptimizer, Muon

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from torch.distributed.optim import ZeroRedundancyOptimizer

    g = torch.Generator().manual_seed(0)
    modes = ("replicated", "sharded", "zero1", "owned")
    times: dict[str, list[float]] = {m: [] for m in modes}
    exchange: dict[str, list[float]] = {m: [] for m in modes}
    opts: dict = {}
    grads: dict = {}
    for mode in modes:
        params = [nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in MUON_SHAPES]
        flat = torch.randn(sum(p.numel() for p in params), generator=g)  # DDP's bucket
        views = list(flat.split([p.numel() for p in params]))
        grads[mode] = (params, flat, [v.view(p.shape) for v, p in zip(views, params,
                                                                        strict=True)])
        if mode == "zero1":  # what data_parallel.zero1 builds (torch's ZeRO-1, our Muon inside)
            opts[mode] = ZeroRedundancyOptimizer(params, optimizer_class=Muon, lr=0.02)
        elif mode == "owned":  # what data_parallel.reduce_scatter_muon builds
            opts[mode] = owner_sharded_optimizer(HybridOptimizer(
                [{"kind": "muon", "params": params, "lr": 0.02}]))
        else:
            opts[mode] = Muon(params, lr=0.02, process_group=dist.group.WORLD
                              if mode == "sharded" else None)
    for i in range(steps + 3):
        for mode, opt in opts.items():
            params, flat, views = grads[mode]
            for p, v in zip(params, views, strict=True):
                p.grad = v
            dist.barrier()
            t0 = time.perf_counter()
            if mode == "owned":
                opt.finish_gradients()  # the reduce-scatter to the owners
            else:
                dist.all_reduce(flat)  # DDP's gradient all-reduce
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            if i >= 3:  # the first steps build banks and state
                times[mode].append(t2 - t1)
                exchange[mode].append(t2 - t0)
            flat.mul_(0.5)  # keep the gradients' scale from growing over the all-reduces
    medians: dict = {m: statistics.median(v) for m, v in times.items()}
    medians.update({f"{m}_with_exchange": statistics.median(v) for m, v in exchange.items()})
    for mode, opt in opts.items():  # optimizer state this rank holds
        local = getattr(opt, "optim", opt)
        medians[f"{mode}_state_bytes"] = sum(t.numel() * t.element_size()
                                             for st in local.state.values()
                                             for t in st.values() if torch.is_tensor(t))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, medians)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def run_muon_step(steps: int, tmp: Path) -> list[dict[str, float]]:
    out = tmp / "muon_step.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(Path(__file__).resolve()), "--muon-step-worker", str(out), "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(1), cwd=ROOT,
                          timeout=1800)
    if proc.returncode:
        raise SystemExit(f"muon step failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--muon-step-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.muon_step_worker:
        muon_step_worker(args.steps, args.muon_step_worker)
        return
    from bench_data import cpu_flags

    rows: dict[str, list[float]] = {"1 process, 2 threads": [], "1 process, 1 thread": [],
                                    "torchrun 2 ranks, 1 thread each": [],
                                    "torchrun 2 ranks, 1 thread each, zero1": [],
                                    "torchrun 2 ranks, 1 thread each, reduce_scatter_muon": []}
    plan = [("one2", 2, 1), ("one1", 1, 1), ("dp2", 1, 2), ("zero2", 1, 2), ("owned2", 1, 2)]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for (name, threads, nproc), row in zip(plan, rows, strict=True):
                rate = run_engine(Path(tmp), f"{name}-{r}", args.steps, threads, nproc)
                rows[row].append(rate)
                print(f"[torchrun_cpu] round {r} {row}: {rate:.0f} tokens/s", flush=True)
        muon = run_muon_step(args.steps, Path(tmp))
    meta = {"torch": torch.__version__, "python": platform.python_version(),
            "cpu": cpu_flags(), "model": MODEL, "muon_shapes": "24 x 256^2, 6 x 1024x256, "
            "6 x 256x1024", "command": "OMP_NUM_THREADS=1 python benchmarks/"
            f"bench_torchrun_cpu.py --rounds {args.rounds} --steps {args.steps}",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    result = {"meta": meta, "engine_tokens_per_sec": rows, "muon_step_s_per_rank": muon}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "torchrun_cpu.json").write_text(json.dumps(result, indent=1))
    base = statistics.median(rows["1 process, 2 threads"])
    lines = ["# torchrun data parallelism on CPU", "",
             f"`{meta['command']}`; torch {meta['torch']}, {meta['cpu']}; {meta['date']}; fp32.",
             "", f"Reference model {MODEL}, global batch 16 x 128 tokens, hybrid Muon, "
             f"{args.steps} steps per run, {args.rounds} interleaved rounds (median of the "
             "rounds' median tokens/s).", "",
             "| job | tokens/s | vs 1 process, 2 threads |", "|---|---:|---:|"]
    for name, rates in rows.items():
        med = statistics.median(rates)
        lines.append(f"| {name} | {med:.0f} | {med / base:.2f}x |")
    lines += ["", "Muon step per rank, 2 gloo ranks, 1 thread each ("
              f"{meta['muon_shapes']}), median of {args.steps} interleaved steps; 'with "
              "exchange' adds the gradient all-reduce (replicated, sharded, zero1) or the "
              "reduce-scatter to the owners (owned):", "",
              "| rank | mode | step (ms) | with exchange (ms) | vs replicated, with exchange "
              "| state MiB |", "|---|---|---:|---:|---:|---:|"]
    for rank, m in enumerate(muon):
        for mode in ("replicated", "sharded", "zero1", "owned"):
            lines.append(f"| {rank} | {mode} | {1e3 * m[mode]:.1f} | "
                         f"{1e3 * m[f'{mode}_with_exchange']:.1f} | "
                         f"{m[f'{mode}_with_exchange'] / m['replicated_with_exchange']:.2f} | "
                         f"{m[f'{mode}_state_bytes'] / 2**20:.1f} |")
    (RESULTS / "torchrun_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
