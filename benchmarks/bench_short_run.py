"""Wall time of a short CPU training run, ours against speedtronic 2.0.0 on the same YAML.

The run (150 steps of a 4-layer, d=128 model on byte-level data, fp32, no checkpoints) is what a
user tries first; every second of start-up, evaluation or plotting shows. Both CLIs run the same
file in alternation, ``--repeats`` times each, with one torch thread (``OMP_NUM_THREADS=1``), and
the medians are compared. speedtronic 2.0.0 lives in its own virtual environment (same package
name): ``python3 -m venv /tmp/v200 && /tmp/v200/bin/pip install torch==2.13.0 speedtronic==2.0.0``.

    python benchmarks/bench_short_run.py --v200-python /tmp/v200/bin/python
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
CONFIG = """run: {max_steps: 150, device: cpu, seed: 1, name: short, output_dir: %s%s}
model: {vocab_size: 256, max_seq_len: 128, n_layer: 4, n_head: 4, n_kv_head: 2, d_model: 128%s}
data: {micro_batch_size: 8, target_batch_size: 8}
precision: {mode: fp32}
checkpoint: {enabled: false}
"""


NO_EVAL = ", eval_every: 0"
#: 2.0.0's SwiGLU width for d_model 128 (8/3 d rounded to 8); ours rounds to 64, giving 384.
SAME_WIDTH = ", d_ff: 344"


def version(python: str, cwd: Path) -> str:
    """The speedtronic version ``python`` imports when run from ``cwd``."""
    out = subprocess.run([python, "-c", "import speedtronic; print(speedtronic.__version__)"],
                         capture_output=True, text=True, cwd=cwd, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"{python} cannot import speedtronic:\n{out.stderr[-2000:]}")
    return out.stdout.strip()


def run(python: str, config: Path, extra_env: dict[str, str]) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **extra_env)
    t0 = time.perf_counter()
    # cwd outside the checkout: ``python -m`` puts the working directory first on sys.path, so
    # run from the repository root the 2.0.0 interpreter would import *this* tree's package.
    out = subprocess.run([python, "-m", "speedtronic", "train", "--config", str(config)],
                         capture_output=True, text=True, env=env, timeout=900,
                         cwd=config.parent)
    elapsed = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{python} failed:\n{out.stderr[-2000:]}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--v200-python", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    # "ours, final eval only": the same YAML with run.eval_every: 0, to price our evaluations
    # (2.0.0 runs none by default). "ours, d_ff 344": the same model width as 2.0.0's, to
    # separate the engine from the extra MLP work our default width does. "ours, glibc malloc
    # defaults": without train.host_memory's thresholds, to price them. "ours, cpu kernels
    # off": without the fused SwiGLU / RMSNorm kernels (speedtronic.kernels.cpu).
    variants = {"ours": (sys.executable, "", "", {}),
                "ours, final eval only": (sys.executable, NO_EVAL, "", {}),
                "ours, d_ff 344": (sys.executable, "", SAME_WIDTH, {}),
                "ours, glibc malloc defaults": (sys.executable, "", "",
                                                {"SPEEDTRONIC_HOST_MALLOC": "0"}),
                "ours, cpu kernels off": (sys.executable, "", "", {"SPEEDTRONIC_CPU_KERNELS": "0"}),
                "2.0.0": (args.v200_python, "", "", {})}
    times: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as d:
        versions = {name: version(python, Path(d)) for name, (python, *_) in variants.items()}
        if versions["2.0.0"] != "2.0.0" or versions["ours"] == "2.0.0":
            raise SystemExit(f"wrong packages imported: {versions}")
        for i in range(args.repeats):
            for name, (python, run_extra, model_extra, extra_env) in variants.items():
                tag = name.replace(",", "").replace(" ", "-")
                config = Path(d) / f"{tag}-{i}.yaml"
                config.write_text(CONFIG % (Path(d) / f"runs-{tag}-{i}", run_extra, model_extra))
                times[name].append(run(python, config, extra_env))
                print(name, f"{times[name][-1]:.2f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["ours"] / med["2.0.0"]
    ratio_no_eval = med["ours, final eval only"] / med["2.0.0"]
    ratio_no_kernels = med["ours, cpu kernels off"] / med["2.0.0"]
    ratio_same_width = med["ours, d_ff 344"] / med["2.0.0"]
    ratio_malloc = med["ours, glibc malloc defaults"] / med["2.0.0"]
    try:
        load = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        load = ["?"]
    import torch
    from bench_data import cpu_flags  # this folder is sys.path[0] when run as a script

    from speedtronic.kernels import cpu as cpu_kernels

    torch.set_num_threads(1)  # as in the runs (OMP_NUM_THREADS=1)
    kernels_line = cpu_kernels.status().line()

    result = {"times_s": times, "cpu": cpu_flags(), "median_s": med, "ratio": ratio,
              "ratio_final_eval_only": ratio_no_eval, "ratio_cpu_kernels_off": ratio_no_kernels,
              "cpu_kernels": kernels_line,
              "ratio_same_width": ratio_same_width, "ratio_glibc_malloc_defaults": ratio_malloc,
              "versions": versions, "load_avg_after": load,
              "machine": platform.processor() or platform.machine(),
              "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "command": "python benchmarks/bench_short_run.py --v200-python <venv>/bin/python"
                         + (f" --repeats {args.repeats}"
                            if args.repeats != ap.get_default("repeats") else "")}
    (RESULTS / "short_run_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# Short CPU run: wall time, ours against speedtronic 2.0.0 (same YAML)", "",
             f"Command: `{result['command']}`, {result['date']} UTC; {result['machine']} "
             f"({result['cpu']}), "
             f"Python {result['python']}, torch 2.13.0+cpu for both, OMP_NUM_THREADS=1; "
             f"speedtronic {versions['ours']} against {versions['2.0.0']} (checked from the "
             "run directory); "
             f"load average after: {' '.join(load)}; ours: `{kernels_line}`", "", "```yaml",
             (CONFIG % ("<tmp>", "", "")).strip(), "```", "",
             "| CLI | runs (s) | median (s) |", "|---|---|---|"]
    for k, v in times.items():
        lines.append(f"| {k} | {', '.join(f'{x:.2f}' for x in v)} | {med[k]:.2f} |")
    lines += ["", f"Ratio ours / 2.0.0: **{ratio:.2f}x** (the target is <= 0.90x); with the "
              f"final evaluation only {ratio_no_eval:.2f}x; with 2.0.0's MLP width "
              f"{ratio_same_width:.2f}x; with glibc's malloc defaults {ratio_malloc:.2f}x; "
              f"without the fused CPU kernels {ratio_no_kernels:.2f}x."]
    out = RESULTS / "short_run_cpu.md"
    # The analysis under the table is written by hand ("## ..." sections): keep it on a rerun.
    old = out.read_text() if out.exists() else ""
    notes = old[old.index("\n## ") + 1:] if "\n## " in old else ""
    out.write_text("\n".join(lines) + "\n" + ("\n" + notes if notes else ""))
    if notes:
        print(f"kept the hand-written notes below the table in {out}: check that the numbers "
              "they quote still match this run")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
