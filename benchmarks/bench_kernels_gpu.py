"""GPU benchmarks of the CUDA kernels (run by benchmarks/gpu_check.sh on a GPU machine).

1. Full Muon step (momentum -> Newton-Schulz -> update, every matrix) on the GPT-2-small set and
   a Llama-3.2-1B-class set: our kernels vs our pure-PyTorch fallback (same orchestration, the
   ops' Python implementations) vs torch.optim.Muon eager and torch.compile'd; plus the kernel
   step replayed as one CUDA graph, and Muon+ / cautious overheads.
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

import speedtronic.kernels as kernels
import speedtronic.ops as ops

GPT2_SMALL = [(768, 768)] * 48 + [(3072, 768)] * 12 + [(768, 3072)] * 12
LLAMA_1B = ([(2048, 2048)] * 32 + [(512, 2048)] * 32 + [(8192, 2048)] * 32 + [(2048, 8192)] * 16)


def cuda_time(fn: Callable[[], None], warmup: int = 5, repeat: int = 20) -> float:
    """Median milliseconds of fn() by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class Step:
    """One Muon step over a parameter set, grouped by shape (one batched NS call per shape)."""

    def __init__(self, shapes, impl: str, muon_plus=False, cautious=False, seed=0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.params = [torch.randn(s, device="cuda", generator=g) * 0.02 for s in shapes]
        self.grads = [torch.randn(s, device="cuda", generator=g) for s in shapes]
        self.bufs = [torch.zeros_like(p) for p in self.params]
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(self.params):
            groups.setdefault(tuple(p.shape), []).append(i)
        self.groups = list(groups.items())
        self.impl, self.muon_plus, self.cautious = impl, muon_plus, cautious

    def __call__(self) -> None:
        kern = self.impl == "kernels"
        pre = torch.ops.speedtronic.muon_pre_orthogonalize_ if kern else ops._muon_pre_impl
        ns = torch.ops.speedtronic.newton_schulz if kern else ops._newton_schulz_impl
        post = torch.ops.speedtronic.muon_post_update_ if kern else ops._muon_post_impl
        for (rows, cols), idx in self.groups:
            p = [self.params[i] for i in idx]
            g = [self.grads[i] for i in idx]
            b = [self.bufs[i] for i in idx]
            x = pre(b, g, 0.95, True, 1e-7, torch.bfloat16)
            orth = ns(x, 5, list(ops.QUINTIC), 1e-7, torch.bfloat16)
            post(p, orth, g, 0.02, 0.01, max(1.0, rows / cols) ** 0.5, self.muon_plus, 1e-8,
                 self.cautious, True)


def torch_muon_step(shapes, compiled: bool):
    params = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.Muon(params, lr=0.02, weight_decay=0.01)
    step = torch.compile(opt.step) if compiled else opt.step
    return lambda: step()


def count_kernels(fn: Callable[[], None]) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def graph_of(fn: Callable[[], None]) -> Callable[[], None]:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def bench_steps(results: dict, quick: bool) -> None:
    for name, shapes in (("gpt2_small", GPT2_SMALL), ("llama_1b", LLAMA_1B)):
        row: dict[str, float | int | str] = {"matrices": len(shapes)}
        rep = 10 if name == "llama_1b" else 30
        kstep = Step(shapes, "kernels")
        row["kernels_ms"] = cuda_time(kstep, repeat=rep)
        row["kernels_graph_ms"] = cuda_time(graph_of(Step(shapes, "kernels")), repeat=rep)
        row["kernels_muon_plus_cautious_ms"] = cuda_time(
            Step(shapes, "kernels", muon_plus=True, cautious=True), repeat=rep)
        row["fallback_ms"] = cuda_time(Step(shapes, "fallback"), repeat=rep)
        row["kernel_launches"] = count_kernels(kstep)
        row["torch_muon_eager_ms"] = cuda_time(torch_muon_step(shapes, False), repeat=rep)
        if not quick:
            try:
                t0 = time.perf_counter()
                fn = torch_muon_step(shapes, True)
                fn()
                row["torch_muon_compile_s"] = round(time.perf_counter() - t0, 1)
                row["torch_muon_compiled_ms"] = cuda_time(fn, repeat=rep)
            except Exception as exc:  # noqa: BLE001 - report, keep going
                row["torch_muon_compiled_ms"] = f"failed: {type(exc).__name__}: {exc}"[:200]
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


def table(results: dict) -> str:
    lines = ["| Muon step (ms) | kernels | graph | +Muon+/cautious | fallback | torch eager | "
             "torch compiled | launches |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results["muon_step"].items():
        comp = r.get("torch_muon_compiled_ms", "-")
        comp = f"{comp:.2f}" if isinstance(comp, float) else str(comp)[:20]
        lines.append(f"| {name} | {r['kernels_ms']:.2f} | {r['kernels_graph_ms']:.2f} | "
                     f"{r['kernels_muon_plus_cautious_ms']:.2f} | {r['fallback_ms']:.2f} | "
                     f"{r['torch_muon_eager_ms']:.2f} | {comp} | {r['kernel_launches']} |")
    lines += ["", "| X X^T, m | syrk ms | cuBLAS ms | speedup |", "|---|---|---|---|"]
    for m, r in results["symmetric"].items():
        lines.append(f"| {m} | {r['syrk_ms']:.3f} | {r['cublas_ms']:.3f} | {r['speedup']:.2f}x |")
    bw = results["bandwidth"]
    lines += ["", f"| elementwise (copy = {bw['copy_GBps']:.0f} GB/s) | GB/s | of copy |",
              "|---|---|---|"]
    for k, r in bw.items():
        if isinstance(r, dict):
            lines.append(f"| {k} | {r['GBps']:.0f} | {100 * r['fraction_of_copy']:.0f}% |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--quick", action="store_true", help="skip torch.compile (saves minutes)")
    args = ap.parse_args()
    st = kernels.load()
    if not st.active:
        print(f"bench_kernels_gpu: needs the CUDA kernels: {st.reason}")
        return 3
    torch.backends.cuda.matmul.allow_tf32 = True
    results: dict = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "host": platform.node(), "kernels": kernels.env_info(),
        "symmetric_min_m": torch.ops.speedtronic_debug.symmetric_min_m(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "muon_step": {}, "symmetric": {},
        "bandwidth": {}}
    bench_symmetric(results)
    bench_bandwidth(results)
    bench_steps(results, args.quick)
    text = table(results)
    results["table"] = text
    name = f"gpu_check_{time.strftime('%Y%m%d-%H%M%S')}.json"
    for folder in filter(None, [args.out_dir, os.environ.get("RESULTS_DIR")]):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / name).write_text(json.dumps(results, indent=1, default=str))
    print("\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
