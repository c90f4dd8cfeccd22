"""Trainer overhead: tokens/s of ``speedtronic.trainer.Trainer`` vs a minimal hand-written loop.

Both sides train the same model (same init), on the same data iterator type, with the same
batch, precision (fp32 on CPU), optimizer (``build_optimizer``), LR schedule and grad clipping.
Timing is external and identical for both: the clock starts after optimizer step 1 (which pays
one-off costs such as lazy imports) and stops after step N. Runs alternate A/B/A/B so machine
noise hits both sides alike; the reported ratio is the median over repeats.

    python benchmarks/bench_trainer.py                 # default threads, then 1 thread
    python benchmarks/bench_trainer.py --steps 30 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from speedtronic.config import load_config
from speedtronic.data import build_data
from speedtronic.models import build_model
from speedtronic.precision import resolve_precision
from speedtronic.runtime import build_optimizer, build_scheduler, build_trainer

RESULTS = Path(__file__).resolve().parent / "results"


def _config(out: str, steps: int) -> dict:
    # The quickstart model and batch (configs/quickstart.yaml), without evals or checkpoints.
    return {
        "run": {"name": "bench", "output_dir": out, "max_steps": steps, "eval_every": 0,
                "eval_batches": 1, "seed": 0},
        "model": {"n_layer": 4, "n_head": 4, "n_kv_head": 2, "d_model": 128, "max_seq_len": 128},
        "data": {"micro_batch_size": 16, "stdlib_max_bytes": 2_000_000},
        "optimizer": {"name": "adamw", "lr": 2e-3},
        "scheduler": {"warmup_steps": 5},
        "logging": {"every_steps": steps, "progress_bar": False, "level": "WARNING"},
        "checkpoint": {"enabled": False},
        "shape_validation": {"enabled": False},
    }


class _Clock:
    """Trainer callback: time from the end of step 1 to the end of step N."""

    name = "bench_clock"

    def __init__(self) -> None:
        self.t1 = self.tn = 0.0

    def after_optimizer_step(self, trainer, step: int) -> None:
        now = time.perf_counter()
        if step == 1:
            self.t1 = now
        self.tn = now


def run_trainer(raw: dict) -> float:
    raw = {**raw, "run": {**raw["run"], "name": f"bench-{time.monotonic_ns()}"}}  # fresh dir
    cfg = load_config(raw)
    clock = _Clock()
    trainer = build_trainer(cfg, callbacks=[clock])
    trainer._eval_cache = trainer.data.eval_batches(1)[:0]  # no eval passes in the timing
    trainer.fit()
    trainer.metrics.close()
    tokens = (cfg.run.max_steps - 1) * cfg.data.target_batch_size * cfg.data.block_size
    return tokens / (clock.tn - clock.t1)


def run_hand_loop(raw: dict) -> float:
    cfg = load_config(raw)
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model)
    data = build_data(cfg)
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg)
    model.train()
    it = iter(data.train)
    t1 = 0.0
    for step in range(1, cfg.run.max_steps + 1):
        x, y = next(it)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if step == 1:
            t1 = time.perf_counter()
    tn = time.perf_counter()
    tokens = (cfg.run.max_steps - 1) * cfg.data.micro_batch_size * cfg.data.block_size
    return tokens / (tn - t1)


def measure(threads: int, steps: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    trainer_tps, hand_tps = [], []
    with tempfile.TemporaryDirectory() as out:
        raw = _config(out, steps)
        run_hand_loop(_config(out, 3))  # warm caches/imports outside the timed repeats
        for _ in range(repeats):
            trainer_tps.append(run_trainer(raw))
            hand_tps.append(run_hand_loop(raw))
    ratios = [t / h for t, h in zip(trainer_tps, hand_tps, strict=True)]
    return {"threads": threads, "steps": steps, "repeats": repeats,
            "trainer_tokens_per_s": trainer_tps, "hand_loop_tokens_per_s": hand_tps,
            "ratio_per_repeat": ratios, "ratio_median": statistics.median(ratios)}


def _hardware() -> dict:
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "bench_trainer_cpu"))
    args = ap.parse_args()
    plan = resolve_precision("auto", torch.device("cpu"))
    hw = _hardware()
    rows = [measure(t, args.steps, args.repeats)
            for t in dict.fromkeys([torch.get_num_threads(), 1])]
    result = {"benchmark": "trainer vs hand-written loop, tokens/s", "device": "cpu",
              "dtype": plan.mode, "torch": torch.__version__, "python": sys.version.split()[0],
              "hardware": hw, "load_average_at_end": os.getloadavg(),
              "command": "python benchmarks/bench_trainer.py " + " ".join(sys.argv[1:]),
              "model": "reference_transformer d128 L4 H4 KV2, T=128, B=16 (quickstart)",
              "results": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Trainer overhead: Speedtronic Trainer vs a minimal hand-written loop (CPU)",
        "",
        f"- command: `{result['command']}`",
        f"- hardware: {hw['cpu']}, {hw['cpu_count']} cores ({hw['platform']})",
        f"- load average at start / end: {hw['load_average_at_start']} / "
        f"{result['load_average_at_end']} (a shared, busy machine: see the spread per repeat)",
        f"- torch {torch.__version__}, python {result['python']}, dtype {plan.mode}",
        f"- model: {result['model']}; same init, data, optimizer, schedule, clipping",
        f"- timing: steps 2..{args.steps}, {args.repeats} alternating repeats, median ratio",
        "",
        "| threads | trainer tok/s (median) | hand loop tok/s (median) | ratio (median) | "
        "ratio per repeat |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['threads']} | {statistics.median(r['trainer_tokens_per_s']):.0f} | "
                     f"{statistics.median(r['hand_loop_tokens_per_s']):.0f} | "
                     f"{r['ratio_median']:.3f} | "
                     + ", ".join(f"{x:.3f}" for x in r["ratio_per_repeat"]) + " |")
    if len(rows) > 1 and statistics.median(rows[0]["hand_loop_tokens_per_s"]) < \
            statistics.median(rows[-1]["hand_loop_tokens_per_s"]):
        lines += ["", f"Note: with {rows[0]['threads']} threads both loops ran slower than with 1 "
                  "thread, so the machine was oversubscribed (threads spinning against other "
                  "processes); that row's ratio measures noise, not the trainer. Trust the "
                  "1-thread row, or rerun on an idle machine."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
