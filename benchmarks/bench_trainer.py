"""Trainer overhead: tokens/s of ``speedtronic.train.Trainer`` vs a minimal hand-written loop.

Both sides train the same model (same init), on the same data iterator type, with the same
batch, precision (fp32 on CPU), optimizer (``build_optimizer``), LR schedule and grad clipping.
Timing is external and identical for both: the clock starts after optimizer step 1 (which pays
one-off costs such as lazy imports) and stops after step N. Runs alternate A/B/A/B so machine
noise hits both sides alike; the reported ratio is the median over repeats.

    python benchmarks/bench_trainer.py                 # default threads, then 1 thread
    python benchmarks/bench_trainer.py --steps 30 --repeats 5
    python benchmarks/bench_trainer.py --device cuda   # GPT-2-small class, bf16, hybrid Muon,
                                                       # eager and torch.compile'd (gpu_check.sh)

On CUDA both sides run under bf16 autocast; with ``compile`` the trainer gets ``compile: true``
and the hand loop ``torch.compile(model)`` (the clock starts after step 1, which compiles). The
clock synchronizes the device at steps 1 and N only: the trainer's own syncs are part of what is
measured.
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
from speedtronic.train.precision import resolve_precision
from speedtronic.train.runtime import build_optimizer, build_scheduler, build_trainer

RESULTS = Path(__file__).resolve().parent / "results"


def _config(out: str, steps: int, device: str = "cpu", compiled: bool = False) -> dict:
    if device == "cuda":  # GPT-2-small class (85 M parameters in the blocks), as measured on H200
        return {
            "run": {"name": "bench", "output_dir": out, "max_steps": steps, "eval_every": 0,
                    "eval_batches": 1, "seed": 0, "device": "cuda"},
            "model": {"n_layer": 12, "n_head": 12, "n_kv_head": 12, "d_model": 768,
                      "max_seq_len": 512},
            "data": {"micro_batch_size": 32, "stdlib_max_bytes": 8_000_000},
            "optimizer": {"name": "muon", "lr": 2e-3},
            "scheduler": {"warmup_steps": 5},
            "precision": {"mode": "bf16"},
            "compile": compiled,
            "logging": {"every_steps": steps, "progress_bar": False, "level": "WARNING"},
            "checkpoint": {"enabled": False},
            "shape_validation": {"enabled": False},
        }
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Clock:
    """Trainer callback: time from the end of step 1 to the end of step N."""

    name = "bench_clock"

    def __init__(self, last: int) -> None:
        self.last = last
        self.t1 = self.tn = 0.0

    def after_optimizer_step(self, trainer, step: int) -> None:
        if step in (1, self.last):
            _sync(trainer.device)
            if step == 1:
                self.t1 = time.perf_counter()
            self.tn = time.perf_counter()


def run_trainer(raw: dict) -> float:
    raw = {**raw, "run": {**raw["run"], "name": f"bench-{time.monotonic_ns()}"}}  # fresh dir
    cfg = load_config(raw)
    clock = _Clock(cfg.run.max_steps)
    trainer = build_trainer(cfg, callbacks=[clock])
    trainer._eval_cache = trainer.data.eval_batches(1)[:0]  # no eval passes in the timing
    trainer.fit()
    trainer.metrics.close()
    tokens = (cfg.run.max_steps - 1) * cfg.data.target_batch_size * cfg.data.block_size
    return tokens / (clock.tn - clock.t1)


def run_hand_loop(raw: dict) -> float:
    cfg = load_config(raw)
    device = torch.device(cfg.run.device if cfg.run.device != "auto" else "cpu")
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model).to(device)
    data = build_data(cfg)
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg)
    model.train()
    forward = torch.compile(model) if cfg.compile is True else model
    bf16 = cfg.precision.mode == "bf16"
    it = iter(data.train)
    t1 = 0.0
    for step in range(1, cfg.run.max_steps + 1):
        x, y = next(it)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = forward(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if step == 1:
            _sync(device)
            t1 = time.perf_counter()
    _sync(device)
    tn = time.perf_counter()
    tokens = (cfg.run.max_steps - 1) * cfg.data.micro_batch_size * cfg.data.block_size
    return tokens / (tn - t1)


def measure(threads: int, steps: int, repeats: int, device: str = "cpu",
            compiled: bool = False) -> dict:
    torch.set_num_threads(threads)
    trainer_tps, hand_tps = [], []
    with tempfile.TemporaryDirectory() as out:
        raw = _config(out, steps, device, compiled)
        run_hand_loop(_config(out, 3, device, compiled))  # warm caches/imports outside timing
        for _ in range(repeats):
            trainer_tps.append(run_trainer(raw))
            hand_tps.append(run_hand_loop(raw))
    ratios = [t / h for t, h in zip(trainer_tps, hand_tps, strict=True)]
    return {"threads": threads, "steps": steps, "repeats": repeats,
            "mode": "compiled" if compiled else "eager",
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
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out", default=None,
                    help="result path without suffix (default results/bench_trainer_<device>)")
    args = ap.parse_args()
    args.out = args.out or str(RESULTS / f"bench_trainer_{args.device}")
    hw = _hardware()
    if args.device == "cuda":
        hw["gpu"] = torch.cuda.get_device_name()
        dtype = "bf16 autocast"
        model = "reference_transformer d768 L12 H12, T=512, B=32, hybrid Muon"
        rows = [measure(torch.get_num_threads(), args.steps, args.repeats, "cuda", compiled)
                for compiled in (False, True)]
    else:
        dtype = resolve_precision("auto", torch.device("cpu")).mode
        model = "reference_transformer d128 L4 H4 KV2, T=128, B=16 (quickstart)"
        rows = [measure(t, args.steps, args.repeats)
                for t in dict.fromkeys([torch.get_num_threads(), 1])]
    result = {"benchmark": "trainer vs hand-written loop, tokens/s", "device": args.device,
              "dtype": dtype, "torch": torch.__version__, "python": sys.version.split()[0],
              "hardware": hw, "load_average_at_end": os.getloadavg(),
              "command": "python benchmarks/bench_trainer.py " + " ".join(sys.argv[1:]),
              "model": model, "results": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Trainer overhead: Speedtronic Trainer vs a minimal hand-written loop "
        f"({args.device.upper()})",
        "",
        f"- command: `{result['command']}`",
        f"- hardware: {hw.get('gpu', '')} {hw['cpu']}, {hw['cpu_count']} cores "
        f"({hw['platform']})",
        f"- load average at start / end: {hw['load_average_at_start']} / "
        f"{result['load_average_at_end']} (a shared, busy machine: see the spread per repeat)",
        f"- torch {torch.__version__}, python {result['python']}, dtype {dtype}",
        f"- model: {result['model']}; same init, data, optimizer, schedule, clipping",
        f"- timing: steps 2..{args.steps}, {args.repeats} alternating repeats, median ratio",
        "",
        "| threads | mode | trainer tok/s (median) | hand loop tok/s (median) | ratio (median) "
        "| ratio per repeat |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['threads']} | {r['mode']} | "
                     f"{statistics.median(r['trainer_tokens_per_s']):.0f} | "
                     f"{statistics.median(r['hand_loop_tokens_per_s']):.0f} | "
                     f"{r['ratio_median']:.3f} | "
                     + ", ".join(f"{x:.3f}" for x in r["ratio_per_repeat"]) + " |")
    oversubscribed = len(rows) > 1 and statistics.median(rows[0]["hand_loop_tokens_per_s"]) < \
        statistics.median(rows[-1]["hand_loop_tokens_per_s"])
    if args.device == "cpu" and oversubscribed:
        lines += ["", f"Note: with {rows[0]['threads']} threads both loops ran slower than with 1 "
                  "thread, so the machine was oversubscribed (threads spinning against other "
                  "processes); that row's ratio measures noise, not the trainer. Trust the "
                  "1-thread row, or rerun on an idle machine."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
