"""CPU training steps under three glibc malloc settings: what ``train.host_memory`` buys.

Each setting trains the short-run YAML's model (``bench_short_run.py``: 4 layers, d 128,
micro-batch 8 x 128 tokens, fp32, AdamW) for ``--steps`` steps in a fresh process and reports
the training time (``Trainer.fit``, start-up excluded), the minor page faults taken during it, the
process's peak resident memory and its resident memory right after training (where memory that
is kept rather than returned to the kernel shows):

* ``glibc defaults``: malloc as the process starts;
* ``trim threshold only``: ``MALLOC_TRIM_THRESHOLD_=1 GiB`` in the environment, which also
  switches off glibc's dynamic mmap threshold (why ``tune_malloc`` sets both);
* ``tune_malloc()``: mmap threshold 32 MiB and trim threshold 1 GiB, as the CLI sets them.

Settings alternate within each round, one thread; medians over rounds.

    python benchmarks/bench_host_malloc.py
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

RESULTS = Path(__file__).resolve().parent / "results"

CHILD = """
import json, resource, sys, time
import torch
from speedtronic import host_memory
from speedtronic.config import load_config
from speedtronic.train.runtime import build_trainer
tune, steps, config = sys.argv[1] == "1", int(sys.argv[2]), sys.argv[3]
line = host_memory.tune_malloc() if tune else "not called"
torch.set_num_threads(1)
cfg = load_config(config, [f"run.max_steps={steps}", "run.eval_every=0",
                           "scheduler.warmup_steps=1"])
trainer = build_trainer(cfg)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t0 = time.perf_counter()
trainer.fit()
seconds = time.perf_counter() - t0
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
import os
rss_mib = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
print(json.dumps({"seconds": seconds, "minor_faults": faults, "peak_rss_mib": peak_mib,
                  "rss_after_mib": rss_mib, "decision": line}))
"""

SETTINGS = {
    "glibc defaults": ({}, False),
    "trim threshold only": ({"MALLOC_TRIM_THRESHOLD_": str(1 << 30)}, False),
    "tune_malloc()": ({}, True),
}


def run_one(extra_env: dict[str, str], tune: bool, steps: int, config: Path) -> dict:
    # Without the user's malloc settings or a preloaded allocator, which tune_malloc respects
    # (the "tune_malloc()" row would then measure "unchanged").
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    env.pop("SPEEDTRONIC_HOST_MALLOC", None)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **extra_env)
    argv = [sys.executable, "-c", CHILD, "1" if tune else "0", str(steps), str(config)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    from bench_data import cpu_flags  # this folder is sys.path[0] when run as a script
    from bench_short_run import CONFIG as SHORT_RUN_CONFIG

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as d:
        config = Path(d) / "short.yaml"  # bench_short_run.py's YAML, one source for the model
        config.write_text(SHORT_RUN_CONFIG % (Path(d) / "runs", "", ""))
        for _ in range(args.rounds):
            for name, (extra_env, tune) in SETTINGS.items():
                runs[name].append(run_one(extra_env, tune, args.steps, config))
                print(name, runs[name][-1], flush=True)
    summary = {name: {"seconds": statistics.median(r["seconds"] for r in rs),
                      "minor_faults": statistics.median(r["minor_faults"] for r in rs),
                      "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in rs),
                      "rss_after_mib": statistics.median(r["rss_after_mib"] for r in rs),
                      "decision": rs[-1]["decision"]} for name, rs in runs.items()}
    base = summary["glibc defaults"]["seconds"]
    meta = {"command": "python benchmarks/bench_host_malloc.py", "cpu": cpu_flags(),
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M"),
            "steps": args.steps, "rounds": args.rounds, "threads": 1, "dtype": "fp32"}
    import torch

    meta["torch"] = torch.__version__
    (RESULTS / "host_malloc_cpu.json").write_text(
        json.dumps({**meta, "runs": runs, "summary": summary}, indent=1) + "\n")
    lines = ["# Host malloc settings: CPU training steps (speedtronic.train.host_memory)", "",
             f"Command: `{meta['command']}`, {meta['date']} UTC; {meta['cpu']}; torch "
             f"{meta['torch']}, Python {meta['python']}, 1 thread, fp32. {args.steps} steps of "
             f"the short-run model (4 layers, d 128, 8 x 128 tokens, AdamW), start-up excluded; "
             f"median of {args.rounds} interleaved rounds, each in a fresh process.", "",
             "| setting | training (s) | vs glibc defaults | minor page faults | peak RSS (MiB) "
             "| RSS after training (MiB) |", "|---|---|---|---|---|---|"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['seconds']:.2f} | {s['seconds'] / base:.2f}x | "
                     f"{s['minor_faults']:,.0f} | {s['peak_rss_mib']:.0f} | "
                     f"{s['rss_after_mib']:.0f} |")
    lines += ["", f"Decision line: `{summary['tune_malloc()']['decision']}`"]
    (RESULTS / "host_malloc_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
