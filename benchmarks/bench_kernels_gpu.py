"""GPU benchmarks of the CUDA kernels (run by benchmarks/gpu_check.sh on a GPU machine).

1. Full Muon step (momentum -> Newton-Schulz -> update, every matrix) on the GPT-2-small set and
   a Llama-3.2-1B-class set through the public ``speedtronic.optim.Muon``: total, and split into
   pre / NS / post; NS against the FLOP floor (dense NS FLOPs / the measured GEMM rate) and
   pre + post against the bandwidth floor (24 bytes per element / the measured copy rate); the
   update error vs a float64 NS on Gaussian and power-law gradients; peak extra memory; beside
   torch.optim.Muon eager and compiled and speedtronic 2.0.0 (``--v200-python``); Muon+ and
   cautious overheads. ``--cpu-smoke`` runs exactly this part on CPU at small sizes (CI).
2. The symmetric tensor-core kernel vs cuBLAS (torch.bmm) for X X^T at m in {768 ... 8192}.
3. Fused elementwise kernels' achieved bandwidth vs a measured device-to-device copy.

CUDA-event timing, warm-up first, median of repeats. Prints a short table last; writes JSON to
benchmarks/results/ and to $RESULTS_DIR when set.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import speedtronic.kernels.extension as kernels
import speedtronic.kernels.ops as ops
from speedtronic.kernels.autotune import cuda_event_timer

GPT2_SMALL = [(768, 768)] * 48 + [(3072, 768)] * 12 + [(768, 3072)] * 12
LLAMA_1B = ([(2048, 2048)] * 32 + [(512, 2048)] * 32 + [(8192, 2048)] * 32 + [(2048, 8192)] * 16)
# --cpu-smoke: the same code paths at 1/16 of every dimension and 1/4 of the counts.
SMOKE_SETS = {"gpt2_small": [(48, 48)] * 12 + [(192, 48)] * 3 + [(48, 192)] * 3,
              "llama_1b": [(128, 128)] * 8 + [(32, 128)] * 8 + [(512, 128)] * 8 + [(128, 512)] * 4}
ELEMENTWISE_BYTES = 24
"""Bytes per matrix element the step must move at least: pre reads the gradient (4) and the fp32
momentum (4), writes it (4) and the 16-bit stack (2); post reads the 16-bit update (2) and the
fp32 parameter (4) and writes it (4)."""


class Clock:
    """Milliseconds of a callable: CUDA events on a GPU, perf_counter (after a sync) on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], object], warmup: int = 3, repeat: int = 10) -> float:
        if self.cuda:
            return cuda_time(fn, warmup, repeat)
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def cuda_time(fn: Callable[[], object], warmup: int = 5, repeat: int = 20) -> float:
    """Median milliseconds of fn() by CUDA events (the timer the per-shape dispatch uses)."""
    return cuda_event_timer(fn, warmup, repeat)


def make_params(shapes, device, seed=0, spectrum="gaussian"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    params, grads = [], []
    for s in shapes:
        params.append(torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(device)))
        if spectrum == "power_law":
            k = min(s)
            U, _ = torch.linalg.qr(torch.randn(s[0], k, generator=g))
            V, _ = torch.linalg.qr(torch.randn(s[1], k, generator=g))
            grads.append((U * torch.arange(1, k + 1) ** -1.0) @ V.T)
        else:
            grads.append(torch.randn(s, generator=g))
    for p, gr in zip(params, grads, strict=True):
        p.grad = gr.to(device)
    return params


def ours_step(shapes, device, **kw):
    from speedtronic.optim import Muon

    opt = Muon(make_params(shapes, device), lr=0.02, weight_decay=0.01, **kw)
    return opt.step


def torch_step(shapes, device, compiled: bool):
    opt = torch.optim.Muon(make_params(shapes, device), lr=0.02, weight_decay=0.01)
    return torch.compile(opt.step) if compiled else opt.step


def phase_split(shapes, device, clock: Clock) -> dict[str, float]:
    """The step's three phases timed apart: every bucket's pre-pass, then every NS, then every
    post-pass (the same ops, arguments and order as speedtronic.optim.muon's bucket step)."""
    params = make_params(shapes, device)
    bufs = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    compute = ops.resolve_compute_dtype(device, torch.float32)
    buckets: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        buckets.setdefault(tuple(p.shape), []).append(i)
    coeffs = list(ops.QUINTIC)
    dts = [compute, torch.float32]
    pre_op = ops.kernel_or_fallback("muon_pre_orthogonalize_", device, dts)
    post_op = ops.kernel_or_fallback("muon_post_update_", device, dts)
    stacks: dict[tuple, torch.Tensor] = {}
    orths: dict[tuple, torch.Tensor] = {}

    def pre():
        for s, idx in buckets.items():
            stacks[s] = pre_op([bufs[i] for i in idx], [params[i].grad for i in idx], 0.95, True,
                               1e-7, compute)

    def ns():
        for s in buckets:
            orths[s] = ops.newton_schulz(stacks[s], 5, coeffs, 1e-7, compute, "auto", True)

    def post():
        for s, idx in buckets.items():
            post_op([params[i] for i in idx], orths[s], [params[i].grad for i in idx], 0.02, 0.01,
                    max(1.0, s[0] / s[1]) ** 0.5, False, 1e-8, False, True)

    pre()
    ns()
    return {"pre_ms": clock.time(pre), "ns_ms": clock.time(ns), "post_ms": clock.time(post)}


def ns_flops(shapes) -> float:
    """FLOPs of 5 standard dense NS iterations (2 per MAC), on the wide orientation."""
    total = 0.0
    for r, c in shapes:
        m, n = min(r, c), max(r, c)
        total += 5 * 2 * (2 * m * m * n + m**3)
    return total


def calibrate(device: torch.device, clock: Clock) -> dict[str, float]:
    """Measured GEMM rate in the NS dtype and copy bandwidth: the floors' denominators."""
    dtype = ops.resolve_compute_dtype(device, torch.float32)
    k = 4096 if device.type == "cuda" else 512
    a = torch.randn(k, k, device=device).to(dtype)
    gemm_ms = clock.time(lambda: a @ a)
    n = (64 if device.type == "cuda" else 4) * 2**20
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    copy_ms = clock.time(lambda: dst.copy_(src))
    return {"gemm_tflops": 2 * k**3 / gemm_ms / 1e9, "copy_GBps": 2 * n * 4 / copy_ms / 1e6,
            "dtype": str(dtype).removeprefix("torch.")}


def update_errors(shapes, device) -> dict[str, float]:
    """Median relative error of one orthogonalized update vs a float64 NS of the same input,
    ours (default dtype and path) and torch.optim.Muon's, on Gaussian and power-law gradients."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    out = {}
    picks = sorted(set(shapes))
    for spectrum in ("gaussian", "power_law"):
        ours, theirs = [], []
        for p in make_params(picks, "cpu", seed=3, spectrum=spectrum):
            G = p.grad.to(device)
            ref = ops.newton_schulz(G.double(), 5, list(ops.QUINTIC), 1e-7, torch.float64,
                                    "standard").cpu()
            a = ops.newton_schulz(G, 5, list(ops.QUINTIC), 1e-7, None).cpu().double()
            b = _zeropower_via_newtonschulz(G, ops.QUINTIC, 5, 1e-7).cpu().double()
            ours.append(float((a - ref).norm() / ref.norm()))
            theirs.append(float((b - ref).norm() / ref.norm()))
        out[f"ours_{spectrum}"] = statistics.median(ours)
        out[f"torch_{spectrum}"] = statistics.median(theirs)
    return out


def peak_extra_mib(step: Callable[[], object], device: torch.device) -> float | None:
    """Peak memory the step allocates above what was live before it (CUDA only)."""
    if device.type != "cuda":
        return None
    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def v200_step_ms(python: str | None, name: str, shapes, device: torch.device) -> float | str:
    """speedtronic 2.0.0's Muon step, run in its own interpreter (same package name as ours)."""
    if not python:
        return "not run (--v200-python)"
    code = (
        "import json, statistics, sys, time, torch\n"
        "from speedtronic.optim import Muon\n"
        f"shapes = {shapes!r}; dev = torch.device({str(device)!r})\n"
        "ps = [torch.nn.Parameter(torch.randn(s, device=dev) * 0.02) for s in shapes]\n"
        "for p in ps: p.grad = torch.randn_like(p)\n"
        "opt = Muon(ps, lr=0.02)\n"
        "sync = torch.cuda.synchronize if dev.type == 'cuda' else (lambda: None)\n"
        "for _ in range(3): opt.step()\n"
        "ts = []\n"
        "for _ in range(10):\n"
        "    sync(); t0 = time.perf_counter(); opt.step(); sync()\n"
        "    ts.append((time.perf_counter() - t0) * 1e3)\n"
        "print(json.dumps(statistics.median(ts)))\n")
    import subprocess

    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=600)
        return float(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else \
            f"failed: {out.stderr.strip().splitlines()[-1][:160]}"
    except Exception as exc:  # noqa: BLE001 - report, keep going
        return f"failed: {type(exc).__name__}: {exc}"[:200]


def bench_steps(results: dict, device: torch.device, quick: bool, smoke: bool,
                v200_python: str | None) -> None:
    clock = Clock(device)
    calib = calibrate(device, clock)
    results["calibration"] = calib
    sets = SMOKE_SETS if smoke else {"gpt2_small": GPT2_SMALL, "llama_1b": LLAMA_1B}
    for name, shapes in sets.items():
        rep = 10 if name == "llama_1b" else 30
        rep = 3 if smoke else rep
        row: dict[str, float | int | str | None] = {"matrices": len(shapes)}
        step = ours_step(shapes, device)
        row["ours_ms"] = clock.time(step, warmup=2, repeat=rep)
        row.update(phase_split(shapes, device, clock))
        if device.type == "cuda":  # the whole step as one CUDA graph (Muon(cuda_graph=True))
            try:
                row["ours_cuda_graph_ms"] = clock.time(
                    ours_step(shapes, device, cuda_graph=True), warmup=5, repeat=rep)
            except Exception as exc:  # noqa: BLE001 - report, keep going
                row["ours_cuda_graph_ms"] = f"failed: {type(exc).__name__}: {exc}"[:200]
        row["ours_muon_plus_cautious_ms"] = clock.time(
            ours_step(shapes, device, muon_plus=True, cautious=True), warmup=2, repeat=rep)
        numel = sum(r * c for r, c in shapes)
        row["flop_floor_ms"] = ns_flops(shapes) / (calib["gemm_tflops"] * 1e9)
        row["ns_over_flop_floor"] = row["ns_ms"] / row["flop_floor_ms"]
        row["bandwidth_floor_ms"] = ELEMENTWISE_BYTES * numel / (calib["copy_GBps"] * 1e6)
        row["pre_post_over_bandwidth_floor"] = ((row["pre_ms"] + row["post_ms"])
                                                / row["bandwidth_floor_ms"])
        row.update(update_errors(shapes, device))
        row["ours_peak_extra_mib"] = peak_extra_mib(ours_step(shapes, device), device)
        tstep = torch_step(shapes, device, False)
        row["torch_eager_ms"] = clock.time(tstep, warmup=2, repeat=rep)
        row["torch_peak_extra_mib"] = peak_extra_mib(torch_step(shapes, device, False), device)
        if not quick:
            try:
                t0 = time.perf_counter()
                fn = torch_step(shapes, device, True)
                fn()
                row["torch_compile_s"] = round(time.perf_counter() - t0, 1)
                row["torch_compiled_ms"] = clock.time(fn, warmup=2, repeat=rep)
            except Exception as exc:  # noqa: BLE001 - report, keep going
                row["torch_compiled_ms"] = f"failed: {type(exc).__name__}: {exc}"[:200]
        row["speedtronic_2_0_0_ms"] = v200_step_ms(v200_python, name, shapes, device)
        results["muon_step"][name] = row
        print(name, row, flush=True)


def bench_symmetric(results: dict) -> None:
    sp = torch.ops.speedtronic_debug
    for m in (768, 1024, 2048, 4096, 8192):
        X = torch.randn(1, m, m, device="cuda").bfloat16()
        t_sym = cuda_time(lambda X=X: sp.syrk(X, 1.0, 0.0, None), repeat=10)
        t_blas = cuda_time(lambda X=X: torch.bmm(X, X.mT), repeat=10)
        flops = 2 * m**3
        results["symmetric"][str(m)] = {
            "syrk_ms": t_sym, "cublas_ms": t_blas, "speedup": t_blas / t_sym,
            "cublas_tflops": flops / t_blas / 1e9, "syrk_dense_equiv_tflops": flops / t_sym / 1e9}
        print("syrk", m, results["symmetric"][str(m)], flush=True)


def bench_bandwidth(results: dict) -> None:
    n = 64 * 2**20  # 64 Mi fp32 elements per tensor (256 MiB)
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src))
    copy_gbs = 2 * n * 4 / t / 1e6
    results["bandwidth"]["copy_GBps"] = copy_gbs
    p, g, m, v = (torch.randn(n, device="cuda") for _ in range(4))
    v.abs_()
    cases = {
        # bytes moved per element: reads + writes, fp32
        "adamw": (lambda: torch.ops.speedtronic.cautious_adamw_step_(
            [p], [g], [m], [v], 1e-3, 0.9, 0.999, 1e-8, 0.1, 3, False, True), 7 * 4),
        "cautious_adamw_rescale": (lambda: torch.ops.speedtronic.cautious_adamw_step_(
            [p], [g], [m], [v], 1e-3, 0.9, 0.999, 1e-8, 0.1, 3, True, True), 10 * 4),
        "cautious_mask": (lambda: torch.ops.speedtronic.cautious_mask_([m], [g], False), 3 * 4),
    }
    mats = [torch.randn(4096, 4096, device="cuda") for _ in range(4)]
    gm = [torch.randn_like(x) for x in mats]
    bm = [torch.zeros_like(x) for x in mats]
    orth = torch.randn(4, 4096, 4096, device="cuda").bfloat16()
    elems = 4 * 4096 * 4096
    cases["muon_pre_bf16_out"] = (lambda: torch.ops.speedtronic.muon_pre_orthogonalize_(
        bm, gm, 0.95, True, 1e-7, torch.bfloat16), 4 + 8 + 2 + 8)
    cases["muon_post_plain"] = (lambda: torch.ops.speedtronic.muon_post_update_(
        mats, orth, gm, 0.02, 0.01, 1.0, False, 1e-8, False, False), 2 + 8)
    cases["muon_post_plus_cautious"] = (lambda: torch.ops.speedtronic.muon_post_update_(
        mats, orth, gm, 0.02, 0.01, 1.0, True, 1e-8, True, True), 2 * 3 + 4 * 2 + 8)
    for name, (fn, bytes_per) in cases.items():
        count = elems if name.startswith("muon") else n
        t = cuda_time(fn)
        gbs = bytes_per * count / t / 1e6
        results["bandwidth"][name] = {"ms": t, "GBps": gbs, "fraction_of_copy": gbs / copy_gbs}
        print("bandwidth", name, results["bandwidth"][name], flush=True)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 0.01 else f"{v:.2f}"
    return "-" if v is None else str(v)[:24]


def table(results: dict) -> str:
    c = results.get("calibration", {})
    lines = [f"Muon step, {results['device']} (NS dtype {c.get('dtype')}, measured GEMM "
             f"{c.get('gemm_tflops', 0):.1f} TFLOP/s, copy {c.get('copy_GBps', 0):.0f} GB/s)", "",
             "| set | ours ms | CUDA graph | pre | NS | post | NS / FLOP floor | "
             "pre+post / BW floor | +Muon+/cautious | torch eager | torch compiled | 2.0.0 | "
             "peak MiB ours / torch |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["muon_step"].items():
        lines.append(
            f"| {name} | {_fmt(r['ours_ms'])} | {_fmt(r.get('ours_cuda_graph_ms'))} | "
            f"{_fmt(r['pre_ms'])} | {_fmt(r['ns_ms'])} | "
            f"{_fmt(r['post_ms'])} | {_fmt(r['ns_over_flop_floor'])}x | "
            f"{_fmt(r['pre_post_over_bandwidth_floor'])}x | "
            f"{_fmt(r['ours_muon_plus_cautious_ms'])} | {_fmt(r['torch_eager_ms'])} | "
            f"{_fmt(r.get('torch_compiled_ms'))} | {_fmt(r['speedtronic_2_0_0_ms'])} | "
            f"{_fmt(r['ours_peak_extra_mib'])} / {_fmt(r['torch_peak_extra_mib'])} |")
    lines += ["", "| update error vs float64 NS | ours Gaussian | torch Gaussian | "
              "ours power law | "
              "torch power law |", "|---|---|---|---|---|"]
    for name, r in results["muon_step"].items():
        lines.append(f"| {name} | {r['ours_gaussian']:.2e} | {r['torch_gaussian']:.2e} | "
                     f"{r['ours_power_law']:.2e} | {r['torch_power_law']:.2e} |")
    if results.get("symmetric"):
        lines += ["", "| X X^T, m | syrk ms | cuBLAS ms | speedup |", "|---|---|---|---|"]
        for m, r in results["symmetric"].items():
            lines.append(f"| {m} | {r['syrk_ms']:.3f} | {r['cublas_ms']:.3f} | "
                         f"{r['speedup']:.2f}x |")
    bw = results.get("bandwidth")
    if bw:
        lines += ["", f"| elementwise (copy = {bw['copy_GBps']:.0f} GB/s) | GB/s | of copy |",
                  "|---|---|---|"]
        for k, r in bw.items():
            if isinstance(r, dict):
                lines.append(f"| {k} | {r['GBps']:.0f} | {100 * r['fraction_of_copy']:.0f}% |")
    return "\n".join(lines)


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = set(next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split())
    return " ".join(sorted(f for f in flags if f.startswith(("avx512_bf16", "avx512_fp16",
                                                              "amx", "avx2", "avx512f"))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--quick", action="store_true", help="skip torch.compile (saves minutes)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run the Muon-step code paths on CPU at small sizes (CI); no files")
    ap.add_argument("--v200-python", default=None,
                    help="python of a venv with speedtronic==2.0.0, timed in its own process")
    args = ap.parse_args()
    if args.cpu_smoke:
        torch.set_num_threads(1)
        results: dict = {"device": f"cpu ({_cpu_flags()})", "torch": torch.__version__,
                         "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "muon_step": {}}
        bench_steps(results, torch.device("cpu"), quick=True, smoke=True,
                    v200_python=args.v200_python)
        print("\n" + table(results))
        return 0
    st = kernels.status()
    if not st.active:
        print(f"bench_kernels_gpu: needs the CUDA kernels: {st.reason}")
        return 3
    torch.backends.cuda.matmul.allow_tf32 = True
    results = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "host": platform.node(), "kernels": kernels.env_info(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "muon_step": {}, "symmetric": {},
        "bandwidth": {}}
    bench_symmetric(results)
    bench_bandwidth(results)
    bench_steps(results, torch.device("cuda"), args.quick, smoke=False,
                v200_python=args.v200_python)
    text = table(results)
    results["table"] = text
    name = f"gpu_check_{time.strftime('%Y%m%d-%H%M%S')}.json"
    for folder in filter(None, [args.out_dir, os.environ.get("RESULTS_DIR")]):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / name).write_text(json.dumps(results, indent=1, default=str))
        (Path(folder) / name.replace(".json", ".md")).write_text(text + "\n")
    print("\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
