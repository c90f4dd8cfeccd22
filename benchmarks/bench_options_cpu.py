"""What Muon+ and the cautious mask add to one Muon step on CPU, side by side in one run.

The GPT-2-small matrix set (48 x 768^2, 12 x 3072x768, 12 x 768x3072; fp32 parameters and
gradients, the CPU default fp32 Newton-Schulz), one thread, the three optimizers stepped in
turn round by round so that machine noise hits them alike; the median step of each and its
ratio to the plain step. On CPU these options run as batched elementwise torch ops around the
Newton-Schulz GEMMs, so their cost is memory traffic and the fresh tensors they allocate.

    OMP_NUM_THREADS=1 python benchmarks/bench_options_cpu.py --out benchmarks/results/options_cpu
    PYTHONPATH=<other checkout> python benchmarks/bench_options_cpu.py ...   (measures that one)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # after PYTHONPATH: an older checkout there is what is measured
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_data import cpu_flags  # noqa: E402

import speedtronic  # noqa: E402
from speedtronic.optim import Muon  # noqa: E402

GPT2_SMALL = [(768, 768)] * 48 + [(3072, 768)] * 12 + [(768, 3072)] * 12
VARIANTS = {"plain": {}, "muon+": {"muon_plus": True}, "cautious": {"cautious": True}}


def _optimizer(scale: int, **kw) -> tuple[Muon, list[nn.Parameter]]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(r // scale, c // scale)) for r, c in GPT2_SMALL]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = Muon(params, lr=0.02, weight_decay=0.01, **kw)
    opt.step()  # the plan and its banks; later steps are the steady state
    return opt, params


def measure(scale: int, rounds: int) -> dict:
    opts = {name: _optimizer(scale, **kw)[0] for name, kw in VARIANTS.items()}
    times: dict[str, list[float]] = {name: [] for name in opts}
    for _ in range(rounds):
        for name, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(v) for name, v in times.items()}
    return {name: {"median_ms": round(med[name] * 1e3, 1),
                   "vs_plain": round(med[name] / med["plain"], 3),
                   "all_ms": [round(t * 1e3, 1) for t in times[name]]} for name in opts}


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(Path(speedtronic.__file__).parent), "rev-parse",
                               "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=1, help="divide every dimension (1: full size)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="result stem (.json and .md); default: print")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = measure(args.scale, args.rounds)
    meta = {"command": "python benchmarks/bench_options_cpu.py " + " ".join(sys.argv[1:]),
            "speedtronic_commit": _commit(), "torch": torch.__version__,
            "python": platform.python_version(), "machine": platform.machine(),
            "cpu_flags": cpu_flags(), "threads": 1, "scale": args.scale,
            "dtype": "fp32 parameters, gradients and Newton-Schulz",
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    lines = [f"`{meta['command']}` on speedtronic {meta['speedtronic_commit']}: torch "
             f"{meta['torch']}, {meta['cpu_flags']}, 1 thread, {meta['dtype']}, GPT-2-small "
             f"matrix set /{args.scale}, median of {args.rounds} interleaved steps, "
             f"{meta['date']}.", "", "| step | median | vs plain | steps (ms) |",
             "|---|---:|---:|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['median_ms']:.0f} ms | {r['vs_plain']:.3f}x | "
                     f"{', '.join(f'{t:.0f}' for t in r['all_ms'])} |")
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        Path(args.out + ".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
