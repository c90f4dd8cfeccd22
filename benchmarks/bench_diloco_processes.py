"""DiLoCo as real processes: a standalone master and M worker processes over a ``file://`` store.

``bench_diloco.py`` drives the real Worker and Master code on a deterministic synchronous
schedule; here the same config runs the way users run it (``speedtronic train`` per worker,
``python -m speedtronic.diloco master``), with real threads, polling and staleness. Rows (eval
cross-entropy of the final global, nats/byte, 20 held-out batches of 16 x 64 bytes):

* DiLoCo, M workers, H inner steps, outer 0.5/0.5, no inner reset, one row per
  ``--polls`` value (every node's poll_interval; a round of H steps takes about 1 s here)
* with ``--methods a,b``, one row per ``distributed.outer_optimizer`` value for each poll
  (interleaved like the repeats), else the config default
* optionally the same rows with the code at ``--before DIR`` (a checkout put first on
  PYTHONPATH), to compare two versions side by side in one run; ``--repeats N`` interleaves
  N runs of every setting (poll x version) and reports each setting's median and range
* one node alone, the same number of steps (what each worker would do by itself)
* one node with an M x batch (the equal-compute data-parallel reference)

    OMP_NUM_THREADS=1 python benchmarks/bench_diloco_processes.py [--steps 1200] [--workers 3]
        [--polls 1,3] [--methods delayed_nesterov,eager_nesterov] [--before /old/checkout]
        [--out benchmarks/results]
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
from bench_data import cpu_flags  # the CPU model and the ISA flags that matter here

ROOT = Path(__file__).resolve().parent.parent


def make_config(tmp: Path, steps: int, workers: int, inner: int, poll: float) -> dict:
    """bench_diloco.py's model and inner optimizer (constant-lr AdamW 2e-3, batch 16)."""
    return {
        "run": {"name": "w", "output_dir": str(tmp / "runs"), "seed": 0, "num_threads": 1,
                "max_steps": steps, "eval_every": 0, "eval_batches": 20},
        "model": {"n_layer": 2, "d_model": 128, "n_head": 4, "max_seq_len": 64},
        "data": {"micro_batch_size": 16, "block_size": 64, "stdlib_max_bytes": 4_000_000},
        "optimizer": {"name": "adamw", "lr": 2e-3, "weight_decay": 0.1, "betas": [0.9, 0.95],
                      "grad_clip": 1.0},
        "scheduler": {"name": "constant", "warmup_steps": 0},
        "logging": {"every_steps": 100, "progress_bar": False},
        "checkpoint": {"enabled": False},
        "distributed": {"enabled": True, "role": "worker", "node_id": "w0",
                        "store": f"file://{tmp / 'store'}", "inner_steps": inner,
                        "poll_interval": poll, "lease_ttl": 10 * poll + 5,
                        "num_shards": workers, "shard": 0, "outer_lr": 0.5,
                        "outer_momentum": 0.5, "reset_inner_optimizer": False,
                        "final_sync_timeout": 120, "expected_workers": workers,
                        "master_idle_timeout": 60},
    }


def final_eval(log: Path) -> float:
    """The eval loss on the run's last ``done:`` line."""
    done = [ln for ln in log.read_text().splitlines() if ln.startswith("done:")]
    return float(done[-1].split("eval_loss=")[1].split()[0])


def run_diloco(cfg: dict, tmp: Path, workers: int, pythonpath: str | None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    t0 = time.perf_counter()
    master = subprocess.Popen([sys.executable, "-m", "speedtronic.diloco", "master", "--config",
                               str(path)], env=env, stdout=subprocess.DEVNULL,
                              stderr=open(tmp / "master.log", "w"))
    procs = [subprocess.Popen([sys.executable, "-m", "speedtronic", "train", "--config",
                               str(path), "--set", f"run.name=w{i}",
                               "--set", f"distributed.node_id=w{i}",
                               "--set", f"distributed.shard={i}"],
                              env=env, stdout=open(tmp / f"w{i}.log", "w"),
                              stderr=subprocess.STDOUT) for i in range(workers)]
    codes = [p.wait() for p in procs]
    master.wait(timeout=300)
    versions = sum(" from " in ln for ln in (tmp / "master.log").read_text().splitlines())
    evals = [final_eval(tmp / f"w{i}.log") for i in range(workers)]
    return {"eval": max(evals), "worker_evals": evals, "exit_codes": codes,
            "versions": versions, "wall_s": time.perf_counter() - t0}


def run_single(cfg: dict, tmp: Path, batch: int) -> dict:
    cfg = json.loads(json.dumps(cfg))
    cfg["distributed"]["enabled"] = False
    cfg["data"]["micro_batch_size"] = batch
    path = tmp / f"single{batch}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = tmp / f"single{batch}.log"
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        subprocess.run([sys.executable, "-m", "speedtronic", "train", "--config", str(path),
                        "--set", f"run.name=single{batch}"], stdout=fh,
                       stderr=subprocess.STDOUT, check=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    return {"eval": final_eval(log), "wall_s": time.perf_counter() - t0}


def report(meta: dict, rows: dict, repeats: int) -> list[str]:
    """The markdown lines: every run, then (with repeats) each setting's median and range."""
    lines = ["# DiLoCo as real processes", "",
             f"`{meta['command']}` (OMP_NUM_THREADS=1), torch {meta['torch']}, Python "
             f"{meta['python']}, {meta['cores']} cores ({meta['cpu_flags']}), fp32 on CPU. "
             f"{meta['workers']} workers x {meta['steps']} steps, H={meta['inner_steps']} (a "
             "round takes about 1 s), outer 0.5/0.5 (the method a row names, else the config "
             "default), no inner reset; eval = "
             "the final global's eval loss (nats/byte; the highest of the workers' final "
             "evals).", "",
             "| run | repeat | eval loss | versions | wall s |", "|---|---|---:|---:|---:|"]
    for name, r in rows.items():
        setting, _, repeat = name.partition(" | ")
        lines.append(f"| {setting} | {repeat} | {r['eval']:.4f} | {r.get('versions', '')} | "
                     f"{r['wall_s']:.0f} |")
    settings: dict[str, list[float]] = {}
    for name, r in rows.items():
        settings.setdefault(name.split(" | ")[0], []).append(r["eval"])
    if repeats > 1:
        lines += ["", "| setting | median | range | range % of median | runs |",
                  "|---|---:|---:|---:|---:|"]
        for name, ev in settings.items():
            med = statistics.median(ev)
            lines.append(f"| {name} | {med:.4f} | {min(ev):.4f}-{max(ev):.4f} | "
                         f"{100 * (max(ev) - min(ev)) / med:.1f} | {len(ev)} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--polls", default="1,3", help="poll_interval values (s), one row each")
    ap.add_argument("--before", default="", help="an older checkout for a side-by-side row")
    ap.add_argument("--methods", default="", help="outer_optimizer values, one row each "
                    "(default: the config default)")
    ap.add_argument("--no-baselines", action="store_true", help="DiLoCo rows only")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved runs per setting")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--stem", default="bench_diloco_processes", help="result file name")
    args = ap.parse_args()
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        base = Path(d)
        versions = [("", None)]
        if args.before:
            versions.append((f", {Path(args.before).name}", args.before))
        polls = [float(p) for p in args.polls.split(",")]
        methods = [m for m in args.methods.split(",") if m] or [None]
        for repeat in range(args.repeats):
            for poll in polls:
                for method in methods:
                    for tag, pythonpath in versions:
                        name = f"DiLoCo, poll {poll:g} s{tag}"
                        if method is not None:
                            name += f", {method}"
                        if args.repeats > 1:
                            name += f" | r{repeat}"
                        tmp = base / f"run{len(rows)}"
                        tmp.mkdir()
                        cfg = make_config(tmp, args.steps, args.workers, args.inner_steps, poll)
                        if method is not None:
                            cfg["distributed"]["outer_optimizer"] = method
                        rows[name] = run_diloco(cfg, tmp, args.workers, pythonpath)
                        print(name, rows[name], flush=True)
        if not args.no_baselines:
            cfg = make_config(base, args.steps, args.workers, args.inner_steps, polls[0])
            rows["one node alone"] = run_single(cfg, base, 16)
            rows[f"one node, {args.workers}x batch"] = run_single(cfg, base, 16 * args.workers)
        print(rows, flush=True)
    meta = {"command": " ".join(["python", *sys.argv]), "torch": torch.__version__,
            "python": platform.python_version(), "cpu": platform.processor() or "x86_64",
            "cpu_flags": cpu_flags(), "cores": os.cpu_count(), "steps": args.steps,
            "workers": args.workers, "inner_steps": args.inner_steps, "polls": polls}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / args.stem
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = report(meta, rows, args.repeats)
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
