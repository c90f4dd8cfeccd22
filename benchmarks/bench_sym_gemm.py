"""The Hopper symmetric GEMM (csrc/kernels/sym_gemm_sm90.cuh, TMA + wgmma) vs cuBLAS on one GPU.

Run by benchmarks/gpu_check.sh on an sm_90 machine. Two tables:

1. ``sym_gemm`` vs cuBLAS for X X^T (``torch.bmm(X, X.mT)``) at m in {512, 768, 1024, 2048, 4096,
   8192} and k in {m, 4m}, fp16 and bf16, batch 1; and for the NS polynomial b A + c A^2
   (``torch.baddbmm(A, A, A, beta=b, alpha=c)``) at k = m. Each row: median milliseconds (CUDA
   events), speedup, dense-equivalent TFLOP/s, the error against an fp32 product relative to its
   largest entry, whether the output is exactly symmetric.
2. The full Muon step on the GPT-2-small and 1B-class sets (benchmarks/bench_kernels_gpu.py)
   with the kernel off (``SPEEDTRONIC_SYM_GEMM=0``) and opted in (``=1``: each NS shape then
   measures the kernel against cuBLAS once and keeps the faster).

``--dry-run`` prints the plan and exits without touching a GPU (CI parses and imports this file
that way). Writes JSON to --out-dir and $RESULTS_DIR when set; prints a Markdown table last.
No GPU has run this yet: the kernel is off by default until it does (docs/kernels.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

MS = (512, 768, 1024, 2048, 4096, 8192)
DTYPES = ("float16", "bfloat16")
QUINTIC_B, QUINTIC_C = -4.7750, 2.0315


def plan() -> list[dict]:
    rows = []
    for dt in DTYPES:
        for m in MS:
            for k in (m, 4 * m):
                rows.append({"op": "xxt", "dtype": dt, "m": m, "k": k})
            rows.append({"op": "poly", "dtype": dt, "m": m, "k": m})
    return rows


def bench_row(row: dict, timer) -> dict:
    dt = getattr(torch, row["dtype"])
    m, k = row["m"], row["k"]
    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    X = torch.randn(1, m, k, generator=gen, device="cuda").to(dt)
    dbg = torch.ops.speedtronic_debug
    if row["op"] == "xxt":
        ref32 = torch.bmm(X.float(), X.float().mT)
        ours, blas = (lambda: dbg.sym_gemm(X, 1.0, 0.0, None)), (lambda: torch.bmm(X, X.mT))
        flops = 2.0 * m * m * k
    else:
        A = torch.bmm(X.float(), X.float().mT)
        A = (A / A.abs().amax()).to(dt)  # symmetric, |A| <= 1 as in Newton-Schulz
        ref32 = QUINTIC_B * A.float() + QUINTIC_C * torch.bmm(A.float(), A.float())
        ours = lambda: dbg.sym_gemm(A, QUINTIC_C, QUINTIC_B, A)  # noqa: E731
        blas = lambda: torch.baddbmm(A, A, A, beta=QUINTIC_B, alpha=QUINTIC_C)  # noqa: E731
        flops = 2.0 * m * m * m
    out = ours()
    torch.cuda.synchronize()
    err = ((out.float() - ref32).abs().max() / ref32.abs().max()).item()
    t_ours, t_blas = timer(ours), timer(blas)
    return {**row, "sym_gemm_ms": t_ours, "cublas_ms": t_blas, "speedup": t_blas / t_ours,
            "sym_gemm_dense_tflops": flops / t_ours / 1e9, "cublas_tflops": flops / t_blas / 1e9,
            "rel_err": err, "exactly_symmetric": bool(torch.equal(out, out.mT))}


def bench_steps(timer_repeat: int) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    import bench_kernels_gpu as bk  # the same step and clock as the main benchmark

    from speedtronic.kernels import newton_schulz as ns
    from speedtronic.kernels import newton_schulz_gemm as gemm

    out: dict = {}
    clock = bk.Clock(torch.device("cuda"))
    for name, shapes in (("gpt2_small", bk.GPT2_SMALL), ("llama_1b", bk.LLAMA_1B)):
        for env in ("0", "1"):
            os.environ[ns.SYM_GEMM_ENV] = env
            step = bk.ours_step(shapes, torch.device("cuda"))
            step()  # first step: per-shape measurements (env=1) happen here
            out[f"{name} SPEEDTRONIC_SYM_GEMM={env}"] = clock.time(step, warmup=2,
                                                                   repeat=timer_repeat)
        out[f"{name} sym_gemm disabled after error"] = gemm.SYM_GEMM.disabled
    os.environ.pop(ns.SYM_GEMM_ENV, None)
    return out


def table(rows: list[dict], steps: dict) -> str:
    lines = ["| op | dtype | m | k | sym_gemm ms | cuBLAS ms | speedup | rel err | symmetric |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['op']} | {r['dtype']} | {r['m']} | {r['k']} | {r['error']} |"
                         " | | | |")
            continue
        lines.append(f"| {r['op']} | {r['dtype']} | {r['m']} | {r['k']} | {r['sym_gemm_ms']:.3f} |"
                     f" {r['cublas_ms']:.3f} | {r['speedup']:.2f}x | {r['rel_err']:.1e} |"
                     f" {'yes' if r['exactly_symmetric'] else 'NO'} |")
    if steps:
        lines += ["", "| full Muon step | ms |", "|---|---|"]
        lines += [f"| {k} | {v if isinstance(v, (str, type(None))) else f'{v:.2f}'} |"
                  for k, v in steps.items()]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--dry-run", action="store_true", help="print the plan; no GPU needed")
    ap.add_argument("--no-steps", action="store_true", help="skip the full-step table")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    rows = plan()
    if args.dry_run:
        for r in rows:
            print(r)
        print(f"bench_sym_gemm: dry run, {len(rows)} rows planned")
        return 0
    import speedtronic.kernels.extension as kernels
    import speedtronic.kernels.ops  # noqa: F401  (defines the schemas, then loads the kernels)
    from speedtronic.kernels.autotune import cuda_event_timer

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("bench_sym_gemm: needs an sm_90 (Hopper) GPU; nothing measured")
        return 3
    if not kernels.status().active or not hasattr(torch.ops.speedtronic_debug, "sym_gemm"):
        print(f"bench_sym_gemm: kernels not active: {kernels.status().reason}")
        return 1
    timer = lambda fn: cuda_event_timer(fn, 5, args.repeat)  # noqa: E731
    results: list[dict] = []
    for r in rows:
        try:
            results.append(bench_row(r, timer))
        except Exception as exc:  # noqa: BLE001 - report the row, keep going
            results.append({**r, "error": f"{type(exc).__name__}: {exc}"[:160]})
        print(results[-1], flush=True)
    steps = {} if args.no_steps else bench_steps(max(3, args.repeat // 4))
    payload = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "rows": results, "steps": steps}
    for d in {args.out_dir, os.environ.get("RESULTS_DIR") or args.out_dir}:
        Path(d).mkdir(parents=True, exist_ok=True)
        (Path(d) / "sym_gemm_gpu.json").write_text(json.dumps(payload, indent=1))
    print()
    print(table(results, steps))
    bad = [r for r in results if "error" in r or not r.get("exactly_symmetric", False)
           or r.get("rel_err", 1.0) > (2e-2 if r["dtype"] == "bfloat16" else 4e-3)]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
