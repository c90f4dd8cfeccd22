"""How the GPU's copy-free fold rounds: fp16 Newton-Schulz error against float64, old route
against new, with cuBLAS's rounding emulated on CPU.

The polynomial ``P = a I + b A + c A^2`` that multiplies ``X`` each iteration used to be
``baddbmm`` (a copy of ``A`` into the output, then the GEMM with beta = b) and a separate
``a I`` diagonal add: 3 launches. ``newton_schulz_gemm._fold_poly`` now writes ``A + (a/b) I`` with
one add and runs the GEMM in place with beta = b: 2 launches. Whether that costs accuracy
depends on how the GEMM rounds, and the CPU's fp16 ``baddbmm`` does not round as cuBLAS does
(so the CPU keeps the old route). This script therefore emulates cuBLAS: fp16 operands, the
product and ``beta C`` accumulated in fp32, one rounding to fp16 at the output; torch's
elementwise add rounds once as well. Both routes then run the same standard NS (5 steps).

    python benchmarks/bench_fold_rounding.py   # writes results/fold_rounding.{json,md}
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_data import cpu_flags  # noqa: E402

from speedtronic.kernels import newton_schulz as ns  # noqa: E402
from speedtronic.kernels import newton_schulz_gemm as ns_gemm  # noqa: E402

H = torch.float16


def gemm(L: torch.Tensor, R: torch.Tensor, C: torch.Tensor | None = None, alpha: float = 1.0,
         beta: float = 0.0) -> torch.Tensor:
    """cuBLAS's fp16 GEMM: fp32 accumulation of ``alpha L R + beta C``, one rounding."""
    out = alpha * (L.float() @ R.float())
    if C is not None:
        out = out + beta * C.float()
    return out.to(H)


def ns_route(X: torch.Tensor, coeffs: list[tuple[float, ...]], route: str) -> torch.Tensor:
    X = X.to(H)                                                   # (b, m, n)
    eye = torch.eye(X.shape[-2])
    for a, b, c in coeffs:
        A = gemm(X, X.mT)                                         # (b, m, m)
        if route == "old":  # baddbmm (copy + GEMM), then + a I
            P = (gemm(A, A, A, alpha=c, beta=b).float() + a * eye).to(H)
        else:               # A + (a/b) I, then the GEMM in place
            P = gemm(A, A, (A.float() + (a / b) * eye).to(H), alpha=c, beta=b)
        X = gemm(P, X)
    return X


def inputs(kind: str, m: int, n: int, batch: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if kind == "gaussian":
        G = torch.randn(batch, m, n, generator=g, dtype=torch.float64)
    else:  # power law 1 .. 1e-4, like real gradients
        U = torch.linalg.qr(torch.randn(batch, m, m, generator=g, dtype=torch.float64))[0]
        V = torch.linalg.qr(torch.randn(batch, n, m, generator=g, dtype=torch.float64))[0]
        s = torch.logspace(0, -4, m, dtype=torch.float64).expand(batch, m)
        G = U @ torch.diag_embed(s) @ V.mT
    return G / G.norm(dim=(-2, -1), keepdim=True)


def main() -> None:
    rows = []
    for kind in ("gaussian", "power_law"):
        for m, n in ((128, 128), (128, 512), (256, 1024)):
            G = inputs(kind, m, n)
            for schedule in ns.COEFFICIENT_SCHEDULES:
                flat = ns.resolve_coefficients(schedule, 5)
                ref = ns.orthogonalize(G, 5, flat, 1e-7, torch.float64, "standard", True)
                coeffs = ns._iter_coefficients(flat, 5)
                err = {r: float((ns_route(G, coeffs, r).double() - ref).norm() / ref.norm())
                       for r in ("old", "new")}
                cpu = {}  # torch's own CPU fp16 GEMMs, which is why the CPU keeps the old route
                for route, flag in (("old", False), ("new", True)):
                    ns_gemm.COPY_FREE_FOLD_ON_CPU = flag
                    try:
                        X = ns.orthogonalize(G.float(), 5, flat, 1e-7, torch.float16,
                                             "standard", True).double()
                    finally:
                        ns_gemm.COPY_FREE_FOLD_ON_CPU = False
                    cpu[route] = float((X - ref).norm() / ref.norm())
                rows.append({"spectrum": kind, "shape": f"{m}x{n}", "schedule": schedule,
                             **err, "ratio": err["new"] / err["old"],
                             "cpu_old": cpu["old"], "cpu_new": cpu["new"],
                             "cpu_ratio": cpu["new"] / cpu["old"]})
    meta = {"torch": torch.__version__, "python": platform.python_version(),
            "cpu_flags": cpu_flags(), "command": "python benchmarks/bench_fold_rounding.py"}
    out = ROOT / "benchmarks" / "results"
    (out / "fold_rounding.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["# fp16 Newton-Schulz: the copy-free fold against the old route, cuBLAS rounding",
             "", f"`{meta['command']}`: torch {meta['torch']}, Python {meta['python']}, "
             f"{meta['cpu_flags']}. Emulated on CPU (fp16 operands, fp32 accumulation, one "
             "rounding per GEMM and per add), standard NS, 5 steps, batch 4; error = "
             "||X - X_fp64||_F / ||X_fp64||_F. Old: baddbmm (copy + GEMM) then + a I "
             "(3 launches); new: A + (a/b) I, then the GEMM in place (2). The last column runs "
             "both routes through torch's CPU fp16 GEMMs instead, which round differently (the "
             "reason the CPU keeps the old route).", "",
             "| spectrum | m x n | schedule | old | new | new / old | torch CPU fp16: new / old |",
             "|---|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['spectrum']} | {r['shape']} | {r['schedule']} | {r['old']:.2e} | "
              f"{r['new']:.2e} | {r['ratio']:.2f} | {r['cpu_ratio']:.2f} |" for r in rows]
    ratios, cpu_ratios = [r["ratio"] for r in rows], [r["cpu_ratio"] for r in rows]
    lines += ["", f"new / old with cuBLAS rounding: {min(ratios):.2f} to {max(ratios):.2f}; "
              f"through torch's CPU fp16 GEMMs: {min(cpu_ratios):.2f} to {max(cpu_ratios):.2f}."]
    (out / "fold_rounding.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
