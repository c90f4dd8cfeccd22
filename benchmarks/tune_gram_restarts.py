"""Place the Gram Newton-Schulz restarts for every shipped coefficient schedule, and check the
16-bit choices of ``speedtronic.kernels.newton_schulz`` against float64.

For each schedule (quintic, polar_express; 5 steps) and each set of restart points (subsets of
iterations 1..4), the Gram iteration's error relative to a float64 standard NS of the same input
is compared with the standard iteration's error in the same dtype, on:

* spectra: Gaussian gradients, power law (singular values ~ i^-1, like real gradients) and a
  harsher power law (i^-2);
* shapes (m, n): aspect 2, 4 and 8 (the Gram side of the per-shape dispatch);
* dtypes: fp16 (the CUDA default), bf16, fp32;
* the input as normalized, and scaled by 1.05 (singular values 5% above the bound that
  normalization guarantees): the safety margin against rounding that lifts the top singular
  value above 1, where an untamed Gram iteration diverges.

A placement passes when, on every fp16 and fp32 case (the dtypes the Gram iteration runs in;
bf16 always uses the standard iteration, see below), its median error is at most 1.25x the
standard iteration's in the same dtype, or below 1% of the fp16 standard error of that case
(fp32 rounding-level differences, 100x under what the default dtype carries anyway). The chosen
placement is the passing one with the fewest restarts (ties: the smallest worst-case ratio).
bf16 rows are recorded for information: there the Gram iteration is ~2x less accurate than
standard NS (the a I term cannot be absorbed with 8 mantissa bits), so bf16 stays standard.

Also measured: ``X <- (B + a I) X`` (``a`` folded into B's diagonal, no copy of X) against
``baddbmm`` per dtype.

    python benchmarks/tune_gram_restarts.py          # writes results/gram_restarts.{json,md}
    python benchmarks/tune_gram_restarts.py --quick  # small shapes, nothing written

Runs on the CPU (16-bit GEMMs accumulate in fp32 as cuBLAS does); numerics, not speed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import time
from pathlib import Path

import torch

from speedtronic.kernels import newton_schulz as ns

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
TOLERANCE = 1.25  # Gram may be at most 25% less accurate than standard NS in the same dtype
FLOOR = 0.01  # ... or below 1% of the fp16 standard error of the same case
GRAM_DTYPES = ("fp16", "fp32")


def make_input(kind: str, m: int, n: int, batch: int, seed: int) -> torch.Tensor:
    """(batch, m, n) float64, m <= n, Frobenius-normalized."""
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        G = torch.randn(batch, m, n, generator=g, dtype=torch.float64)
    else:
        power = {"power_law": 1.0, "power_law_2": 2.0}[kind]
        U, _ = torch.linalg.qr(torch.randn(batch, m, m, generator=g, dtype=torch.float64))
        V, _ = torch.linalg.qr(torch.randn(batch, n, m, generator=g, dtype=torch.float64))
        s = torch.arange(1, m + 1, dtype=torch.float64) ** -power
        G = U @ torch.diag_embed(s.expand(batch, m)) @ V.mT
    return G / torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True)


def rel_error(X: torch.Tensor, ref: torch.Tensor) -> float:
    err = torch.linalg.matrix_norm(X.double() - ref) / torch.linalg.matrix_norm(ref)
    err = torch.nan_to_num(err, nan=float("inf"))
    return float(err.median())


def schedules(steps: int) -> dict[str, list[tuple[float, ...]]]:
    out = {}
    for name in ns.COEFFICIENT_SCHEDULES:
        flat = ns.resolve_coefficients(name, steps)
        out[name] = ns._iter_coefficients(flat, steps)
    return out


def fold_table(shapes: list[tuple[int, int]], batch: int) -> list[dict]:
    """Error of X <- (B + aI) X vs baddbmm, standard NS, per dtype and spectrum."""
    rows = []
    coeffs = [ns.QUINTIC] * 5
    for kind, (m, n) in itertools.product(("gaussian", "power_law"), shapes):
        X64 = make_input(kind, m, n, batch, seed=1)
        ref = ns.ns_standard(X64, coeffs, transpose_out=False)
        for dname, dt in DTYPES.items():
            row = {"spectrum": kind, "m": m, "n": n, "dtype": dname}
            for mode in ("fold", "baddbmm"):
                X = X64.to(dt)
                for a, b, c in coeffs:
                    A = torch.bmm(X, X.mT)
                    B = torch.baddbmm(A, A, A, beta=b, alpha=c)
                    if mode == "fold":
                        B.diagonal(dim1=-2, dim2=-1).add_(a)
                        X = torch.bmm(B, X)
                    else:
                        X = torch.baddbmm(X, B, X, beta=a)
                row[mode] = rel_error(X, ref)
            rows.append(row)
    return rows


def tune(shapes: list[tuple[int, int]], batch: int, steps: int) -> dict:
    kinds = ("gaussian", "power_law", "power_law_2")
    candidates = [c for r in range(0, steps) for c in itertools.combinations(range(1, steps), r)]
    out: dict = {"schedules": {}}
    for name, coeffs in schedules(steps).items():
        cases = []
        for kind, (m, n), scale in itertools.product(kinds, shapes, (1.0, 1.05)):
            X64 = make_input(kind, m, n, batch, seed=m + n) * scale
            ref = ns.ns_standard(X64, coeffs, transpose_out=False)
            fp16_std = None
            for dname, dt in DTYPES.items():
                X = X64.to(dt)
                std_err = rel_error(ns.ns_standard(X, coeffs, transpose_out=False), ref)
                fp16_std = std_err if dname == "fp16" else fp16_std
                gram = {",".join(map(str, c)) or "none":
                        rel_error(ns.ns_gram(X, coeffs, c, transpose_out=False), ref)
                        for c in candidates}
                budget = max(TOLERANCE * std_err, FLOOR * fp16_std)
                cases.append({"spectrum": kind, "m": m, "n": n, "scale": scale, "dtype": dname,
                              "standard": std_err, "budget": budget, "gram": gram})
        summary = []
        for c in candidates:
            key = ",".join(map(str, c)) or "none"
            ratios = [case["gram"][key] / case["budget"] * TOLERANCE for case in cases
                      if case["dtype"] in GRAM_DTYPES]
            worst = max(ratios)
            summary.append({"restarts": list(c), "worst_ratio": worst,
                            "passes": worst <= TOLERANCE})  # worst gram / budget x 1.25
        passing = [s for s in summary if s["passes"]]
        best = min(passing, key=lambda s: (len(s["restarts"]), s["worst_ratio"]), default=None)
        out["schedules"][name] = {"cases": cases, "summary": summary,
                                  "chosen": best["restarts"] if best else None}
    return out


def write_markdown(result: dict, path: Path) -> None:
    lines = ["# Gram Newton-Schulz restart placement and 16-bit choices", "",
             f"Command: `{result['command']}`  ",
             f"Machine: {result['machine']}; torch {result['torch']}; {result['seconds']:.0f} s  ",
             f"Shapes (m, n): {result['shapes']}, batch {result['batch']}, {result['steps']} "
             "steps; errors are medians over the batch of ||X - X64|| / ||X64|| (Frobenius), "
             "X64 = standard NS in float64 of the same input.", "",
             f"A placement passes when Gram's error <= max({TOLERANCE:.2f} x standard's in the "
             f"same dtype, {FLOOR:g} x the fp16 standard error) on every fp16 and fp32 case (3 "
             "spectra x 3 aspects x inputs scaled by 1.0 and 1.05). 'worst ratio' is the worst "
             f"gram / budget x {TOLERANCE:.2f} (passes at <= {TOLERANCE:.2f}). bf16 rows are for "
             "information: bf16 always runs standard NS.", ""]
    for name, s in result["tune"]["schedules"].items():
        lines += [f"## {name}: chosen restarts after iteration(s) {s['chosen']}", "",
                  "| restarts after | worst ratio | passes |", "|---|---|---|"]
        for row in sorted(s["summary"], key=lambda r: (len(r["restarts"]), r["restarts"])):
            lines.append(f"| {row['restarts'] or 'none'} | {row['worst_ratio']:.3g} | "
                         f"{'yes' if row['passes'] else 'no'} |")
        chosen = ",".join(map(str, s["chosen"] or [])) or "none"
        lines += ["", f"Errors of the chosen placement ({chosen}) vs standard:", "",
                  "| spectrum | m x n | scale | dtype | standard | gram |",
                  "|---|---|---|---|---|---|"]
        for c in s["cases"]:
            lines.append(f"| {c['spectrum']} | {c['m']}x{c['n']} | {c['scale']} | {c['dtype']} | "
                         f"{c['standard']:.3g} | {c['gram'][chosen]:.3g} |")
        lines.append("")
    lines += ["## fold: X <- (B + aI) X against baddbmm (standard NS, quintic)", "",
              "| spectrum | m x n | dtype | fold | baddbmm |", "|---|---|---|---|---|"]
    for r in result["fold"]:
        lines.append(f"| {r['spectrum']} | {r['m']}x{r['n']} | {r['dtype']} | {r['fold']:.3g} | "
                     f"{r['baddbmm']:.3g} |")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small shapes, no files written")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [(16, 32), (16, 64)] if args.quick else [(96, 192), (96, 384), (64, 512)]
    batch = 2 if args.quick else 4
    t0 = time.perf_counter()
    command = "python benchmarks/tune_gram_restarts.py" + (" --quick" if args.quick else "")
    result = {"command": command,
              "machine": f"{platform.processor() or platform.machine()}, {args.threads} thread(s)",
              "torch": torch.__version__, "shapes": shapes, "batch": batch, "steps": 5,
              "tune": tune(shapes, batch, 5), "fold": fold_table(shapes[:2], batch)}
    result["seconds"] = time.perf_counter() - t0
    for name, s in result["tune"]["schedules"].items():
        print(f"{name}: restarts after {s['chosen']} (shipped: {ns.GRAM_RESTARTS.get(name)})")
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "gram_restarts.json").write_text(json.dumps(result, indent=1) + "\n")
        write_markdown(result, RESULTS / "gram_restarts.md")
        print(f"wrote {RESULTS / 'gram_restarts.md'}")


if __name__ == "__main__":
    main()
