"""Peak extra memory of one Muon step, ours against torch.optim.Muon, measured on the CPU.

The step allocates the same tensors on CPU and GPU except where the CUDA pre-kernel writes the
16-bit stack directly (the CPU path makes an fp32 stack first), so the CPU figure is an upper
bound for ours on a GPU. Both run in the dtypes they use on CUDA: our Newton-Schulz in fp16,
torch's in bf16. Each case runs in its own process with glibc's mmap threshold at 64 KiB (so a
freed tensor leaves the resident set at once), and the peak is read from ``VmHWM`` after
resetting it (``/proc/self/clear_refs``):

* ``first``: the first step, which also allocates the fp32 momentum buffers (how the H200 run
  measured it: torch 346 MiB, ours 680 MiB on GPT-2 small);
* ``steady``: a later step (temporaries only).

    python benchmarks/bench_step_memory.py      # writes benchmarks/results/step_memory_cpu.md
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "step_memory_cpu.md"
SETS = {
    "gpt2_small": [(768, 768)] * 48 + [(3072, 768)] * 12 + [(768, 3072)] * 12,
    # The Llama-1B-class set with every dimension halved (1/8 of the FLOPs: a CPU can run it).
    "llama_1b_half": ([(1024, 1024)] * 32 + [(256, 1024)] * 32 + [(4096, 1024)] * 32
                      + [(1024, 4096)] * 16),
}

CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(2)
which, phase, shapes, ns_dtype = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
ps = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
for p in ps:
    p.grad = torch.randn_like(p)
if which == "ours":
    from speedtronic.optim import Muon
    opt = Muon(ps, lr=0.02, ns_dtype=ns_dtype)
elif which == "ours_small":  # a 64 MiB workspace budget: chunks instead of one batch a group
    from speedtronic.optim import Muon
    opt = Muon(ps, lr=0.02, ns_dtype=ns_dtype, workspace_budget=64 << 20)
else:
    opt = torch.optim.Muon(ps, lr=0.02)
def field(name):
    for line in open("/proc/self/status"):
        if line.startswith(name):
            return int(line.split()[1]) * 1024
if phase == "steady":
    opt.step()
base = field("VmRSS")
open("/proc/self/clear_refs", "w").write("5")
t0 = time.perf_counter()
opt.step()
print(json.dumps({"peak_extra_mib": (field("VmHWM") - base) / 2**20,
                  "step_s": time.perf_counter() - t0}))
"""


def run(which: str, phase: str, shapes, ns_dtype: str = "fp16") -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", CHILD, which, phase, json.dumps(shapes),
                          ns_dtype],
                         capture_output=True, text=True, env=env, timeout=3600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    import argparse

    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--ns-dtype", default="fp16", help="our NS dtype (fp16: the CUDA default; "
                    "fp32 where this CPU has no fast fp16 GEMM, an upper bound for fp16)")
    ap.add_argument("--sets", default=",".join(SETS))
    args = ap.parse_args()
    rows = []
    for name in args.sets.split(","):
        shapes = SETS[name]
        params_mib = sum(r * c for r, c in shapes) * 4 / 2**20
        for phase in ("first", "steady"):
            ours, theirs = run("ours", phase, shapes, args.ns_dtype), run("torch", phase, shapes)
            small = run("ours_small", phase, shapes, args.ns_dtype)
            rows.append((name, phase, params_mib, ours, theirs, small))
            print(name, phase, ours, theirs, small, flush=True)
    command = " ".join(["python", "benchmarks/bench_step_memory.py", *sys.argv[1:]])
    lines = ["# Peak extra memory of one Muon step (CPU measurement)", "",
             f"Command: `{command}`  ",
             f"Machine: {platform.machine()}, 2 threads; torch {torch.__version__}; "
             f"{time.strftime('%Y-%m-%d')}  ",
             f"Ours: speedtronic.optim.Muon(ns_dtype={args.ns_dtype!r}); torch: torch.optim.Muon "
             "(bf16 NS). "
             "Peak resident set above the level before the step (see the script's docstring).",
             "The first step includes what the step keeps afterwards (our momentum, gather and "
             "fp16 NS banks; torch's momentum buffers); the steady step is temporaries only. "
             "`ours, 64 MiB` sets `workspace_budget=64 << 20`.",
             "", "| set | step | fp32 params MiB | ours MiB | ours, 64 MiB budget | torch MiB | "
             "ours / torch | ours s | torch s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, phase, pm, o, t, sm in rows:
        lines.append(f"| {name} | {phase} | {pm:.0f} | {o['peak_extra_mib']:.0f} | "
                     f"{sm['peak_extra_mib']:.0f} | {t['peak_extra_mib']:.0f} | "
                     f"{o['peak_extra_mib'] / max(t['peak_extra_mib'], 1e-9):.2f}x | "
                     f"{o['step_s']:.1f} | {t['step_s']:.1f} |")
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
