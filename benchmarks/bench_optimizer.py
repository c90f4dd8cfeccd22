"""Muon step benchmark: Speedtronic vs torch.optim.Muon vs the speedtronic 2.0.0 wheel.

Times the full ``optimizer.step()`` (momentum, Newton-Schulz, update) side by side in one run,
interleaving the implementations round by round so machine noise hits all of them alike, and
measures each implementation's error against a float64 evaluation of the same algorithm.

Sets of Muon matrices:
  reference    the Muon branch of the reference model at quickstart size (default ModelConfig)
  transformer  CPU: 4 layers x (4x 256x256, 256x1024, 1024x256); CUDA: GPT-2 small,
               12 layers x (4x 768x768, 768x3072, 3072x768)
  gpt2_small   GPT-2 small's matrices on any device (``--sets gpt2_small``)

speedtronic 2.0.0 runs in its own venv (``--ref-python``, default /work/venv-ref/bin/python:
``python3 -m venv /work/venv-ref && /work/venv-ref/bin/pip install torch==2.13.0
speedtronic==2.0.0``) as a worker subprocess that times its own steps on identical tensors.

``--memory`` adds peak-memory of one cautious step (ours vs the clone-every-parameter approach
of v2), each variant in a fresh process, from the kernel's peak-RSS counter.

Usage:  python benchmarks/bench_optimizer.py [--threads 2 1] [--repeats 5] [--memory]
Writes benchmarks/results/optimizer_<device>.json and .md.
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

import torch

HP = dict(lr=0.02, weight_decay=0.0, momentum=0.95, nesterov=True)
QUINTIC = (3.4445, -4.7750, 2.0315)
N_GRADS = 3  # distinct gradients, cycled; the error run takes exactly these 3 steps


# ---- problems -------------------------------------------------------------------------------

def transformer_shapes(device: str) -> list[tuple[int, int]]:
    if device == "cuda":
        layer = [(768, 768)] * 4 + [(768, 3072), (3072, 768)]
        return layer * 12
    return ([(256, 256)] * 4 + [(256, 1024), (1024, 256)]) * 4


#: GPT-2 small's Muon matrices at full size (``--sets gpt2_small``; ~6 s a step on one core).
GPT2_SMALL = ([(768, 768)] * 4 + [(768, 3072), (3072, 768)]) * 12


def reference_shapes() -> list[tuple[int, int]]:
    from speedtronic.config import ModelConfig
    from speedtronic.models import build_model
    from speedtronic.optim import route_parameters

    model = build_model(ModelConfig(vocab_size=256))
    return [tuple(p.shape) for _, p in route_parameters(model).muon]


def make_problem(shapes, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"W0": [torch.randn(s, generator=g) * 0.02 for s in shapes],
            "grads": [[torch.randn(s, generator=g) for s in shapes] for _ in range(N_GRADS)]}


def reference_delta(problem: dict) -> list[torch.Tensor]:
    """float64 evaluation of torch.optim.Muon's algorithm (EMA momentum, lerp Nesterov,
    quintic NS on the wide orientation, sqrt(max(1, A/B)) lr scale), N_GRADS steps."""
    out = []
    for i, w0 in enumerate(problem["W0"]):
        w = w0.double()
        buf = torch.zeros_like(w)
        for k in range(N_GRADS):
            g = problem["grads"][k][i].double()
            buf.lerp_(g, 1 - HP["momentum"])
            u = g.lerp(buf, HP["momentum"])
            x = u.T if u.shape[0] > u.shape[1] else u
            x = x / x.norm().clamp(min=1e-7)
            for _ in range(5):
                a_ = x @ x.T
                x = QUINTIC[0] * x + (QUINTIC[1] * a_ + QUINTIC[2] * a_ @ a_) @ x
            x = x.T if u.shape[0] > u.shape[1] else x
            scale = max(1.0, w.shape[0] / w.shape[1]) ** 0.5
            w = w * (1 - HP["lr"] * HP["weight_decay"]) - HP["lr"] * scale * x
        out.append(w - w0.double())
    return out


def rel_error(delta: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    num = sum(((d.double() - r) ** 2).sum() for d, r in zip(delta, ref, strict=True))
    den = sum((r ** 2).sum() for r in ref)
    return float((num / den) ** 0.5)


# ---- implementations (in-process) -----------------------------------------------------------

def build_optimizer(kind: str, params):
    if kind == "speedtronic_v2":  # worker side, inside the ref venv
        from speedtronic.optimizers import Muon as V2Muon
        return V2Muon(params, lr=HP["lr"], momentum=HP["momentum"], nesterov=HP["nesterov"],
                      weight_decay=HP["weight_decay"])
    if kind.startswith("speedtronic"):
        from speedtronic.optim import Muon
        return Muon(params, **HP, ns_dtype="bf16" if "bf16" in kind else "auto")
    if kind.startswith("torch"):
        return torch.optim.Muon(params, **HP)
    raise ValueError(kind)


class Local:
    """One implementation living in this process."""

    def __init__(self, kind: str, problem: dict, device: str) -> None:
        self.kind, self.device, self.problem = kind, device, problem
        self.params = [torch.nn.Parameter(w.clone().to(device)) for w in problem["W0"]]
        self.grads = [[g.to(device) for g in gs] for gs in problem["grads"]]
        self.opt = build_optimizer(kind, self.params)
        self.step_fn = self.opt.step
        self.compile_s = None
        if kind.endswith("compiled"):
            self.step_fn = torch.compile(self.opt.step)
        self.k = 0
        t0 = time.perf_counter()
        self.time_step()  # warm-up (and compilation)
        if kind.endswith("compiled"):
            self.compile_s = time.perf_counter() - t0

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def time_step(self) -> float:
        for p, g in zip(self.params, self.grads[self.k % N_GRADS], strict=True):
            p.grad = g
        self.k += 1
        self._sync()
        t0 = time.perf_counter()
        self.step_fn()
        self._sync()
        return time.perf_counter() - t0

    def delta(self) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(w.clone().to(self.device)) for w in self.problem["W0"]]
        opt = build_optimizer(self.kind, params)
        step = torch.compile(opt.step) if self.kind.endswith("compiled") else opt.step
        for k in range(N_GRADS):
            for p, g in zip(params, self.grads[k], strict=True):
                p.grad = g
            step()
        return [(p.detach() - w.to(self.device)).cpu() for p, w in
                zip(params, self.problem["W0"], strict=True)]

    def close(self) -> None:
        pass


class Worker:
    """speedtronic 2.0.0 in its own venv, driven over stdin/stdout."""

    def __init__(self, python: str, problem_path: str, threads: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH="")
        self.proc = subprocess.Popen(
            [python, __file__, "--worker", problem_path, "--threads", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd="/")
        self.compile_s = None
        self.version = self._ask(None)

    def _ask(self, line: str | None) -> str:
        if line is not None:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        reply = self.proc.stdout.readline().strip()
        if not reply:
            raise RuntimeError(f"v2 worker died (exit code {self.proc.poll()})")
        return reply

    def time_step(self) -> float:
        return float(self._ask("step"))

    def delta(self) -> list[torch.Tensor]:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "delta.pt")
            self._ask(f"delta {path}")
            return torch.load(path, weights_only=True)

    def close(self) -> None:
        self._ask("quit")
        self.proc.wait(timeout=60)


def worker_main(problem_path: str, threads: int) -> None:
    torch.set_num_threads(threads)
    import speedtronic as v2

    problem = torch.load(problem_path, weights_only=True)
    local = Local("speedtronic_v2", problem, "cpu")
    print(getattr(v2, "__version__", "unknown"), flush=True)
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "step":
            print(f"{local.time_step():.9f}", flush=True)
        elif cmd == "delta":
            torch.save(local.delta(), rest[0])
            print("ok", flush=True)
        elif cmd == "quit":
            print("bye", flush=True)
            return


# ---- memory of one cautious step ------------------------------------------------------------

MEMORY_VARIANTS = ["adamw", "adamw_cautious", "adamw_naive_clone_cautious",
                   "muon", "muon_cautious", "muon_naive_clone_cautious"]


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def memory_main(variant: str) -> None:
    """Peak RSS growth during the 2nd optimizer step (state already allocated)."""
    torch.set_num_threads(1)
    from speedtronic.config import ModelConfig, OptimizerConfig
    from speedtronic.models import build_model
    from speedtronic.optim import build_optimizer as build

    torch.manual_seed(0)
    model = build_model(ModelConfig(d_model=512, n_layer=8, n_head=8, vocab_size=256))
    name = "muon" if variant.startswith("muon") else "adamw"
    ours_cautious = variant.endswith("_cautious") and "naive" not in variant
    opt = build(model, OptimizerConfig(name=name, cautious=ours_cautious, fused=False))
    params = [p for g in opt.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.randn_like(p)

    def step() -> None:
        if "naive" not in variant:
            opt.step()
            return
        # speedtronic 2.0.0's CautiousOptimizer: snapshot every parameter, step, revert.
        with torch.no_grad():
            old = [p.detach().clone() for p in params]
            opt.step()
            for p, o in zip(params, old, strict=True):
                delta = o - p
                keep = (delta * p.grad) > 0
                p.copy_(o - delta * keep)

    step()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS counter (VmHWM)
    before = _rss_kib("VmRSS")
    step()
    peak = _rss_kib("VmHWM")
    n_params = sum(p.numel() for p in params)
    print(json.dumps({"variant": variant, "params": n_params,
                      "param_mib": n_params * 4 / 2**20,
                      "step_peak_extra_mib": (peak - before) / 1024}))


def run_memory() -> list[dict]:
    out = []
    # Large blocks straight from mmap so freed temporaries leave RSS (no dynamic threshold).
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    for variant in MEMORY_VARIANTS:
        res = subprocess.run([sys.executable, __file__, "--memory-worker", variant], env=env,
                             capture_output=True, text=True, check=True)
        out.append(json.loads(res.stdout.strip().splitlines()[-1]))
        print(f"  memory {variant:28s} +{out[-1]['step_peak_extra_mib']:.1f} MiB "
              f"(params {out[-1]['param_mib']:.1f} MiB)", flush=True)
    return out


# ---- driver ---------------------------------------------------------------------------------

def hardware() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = " ".join(f for f in line.split() if "bf16" in f or "amx" in f)
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cpu_bf16_flags": flags or "none", "logical_cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "load_average_at_start": os.getloadavg()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    else:
        info["gemm_gflops_1thread"] = gemm_calibration()
    return info


def gemm_calibration() -> dict[str, float]:
    """Best-of-15 single-thread GFLOP/s of a (256x1024)(1024x256) GEMM per dtype: tells whether
    this CPU has fast bf16 (AVX512-BF16/AMX) or the ~70x slower emulated path."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(256, 1024, dtype=dtype)
        b = torch.randn(1024, 256, dtype=dtype)
        best = float("inf")
        for _ in range(15):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        out[name] = 2 * 256 * 1024 * 256 / best / 1e9
    torch.set_num_threads(before)
    return out


def bench_set(name: str, shapes, args, device: str, threads: int) -> list[dict]:
    torch.set_num_threads(threads)
    problem = make_problem(shapes)
    ref = reference_delta(problem)
    kinds = ["speedtronic", "speedtronic_bf16", "torch"]
    if args.compile:
        kinds += ["speedtronic_compiled", "torch_compiled"]
    impls: dict[str, object] = {}
    notes: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        problem_path = os.path.join(tmp, "problem.pt")
        torch.save(problem, problem_path)
        for kind in kinds:
            try:
                impls[kind] = Local(kind, problem, device)
            except Exception as exc:  # compile may be unavailable; record why
                notes[kind] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                print(f"  {kind}: {notes[kind]}", flush=True)
        if args.ref_python and device == "cpu":
            if Path(args.ref_python).exists():
                impls["speedtronic_v2"] = Worker(args.ref_python, problem_path, threads)
            else:
                notes["speedtronic_v2"] = f"skipped: {args.ref_python} not found"
        times: dict[str, list[float]] = {k: [] for k in impls}
        for r in range(args.repeats):  # interleaved rounds: noise hits everyone alike
            for kind, impl in impls.items():
                times[kind].append(impl.time_step())
            print(f"  [{name} t={threads}] round {r + 1}/{args.repeats}: " + ", ".join(
                f"{k} {v[-1] * 1e3:.1f} ms" for k, v in times.items()), flush=True)
        errors = {}
        for kind, impl in impls.items():
            if kind.endswith("compiled") and not args.compiled_error:
                continue
            if threads != args.threads[0]:
                continue  # numerics do not depend on the thread count; measured once
            errors[kind] = rel_error(impl.delta(), ref)
        for impl in impls.values():
            impl.close()
    rows = []
    for kind in kinds + ["speedtronic_v2"]:
        row = {"set": name, "threads": threads, "impl": kind, "n_matrices": len(shapes),
               "shapes": sorted({f"{m}x{n}" for m, n in shapes})}
        if kind in times:
            row.update(median_ms=statistics.median(times[kind]) * 1e3,
                       times_ms=[t * 1e3 for t in times[kind]],
                       error_vs_fp64=errors.get(kind),
                       compile_s=getattr(impls[kind], "compile_s", None),
                       version=getattr(impls[kind], "version", None))
        else:
            row["note"] = notes.get(kind, "not run")
        rows.append(row)
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    out = []
    keyed = {(r["set"], r["threads"], r["impl"]): r for r in rows}
    errs = {(r["set"], r["impl"]): r.get("error_vs_fp64") for r in rows
            if r.get("error_vs_fp64") is not None}
    for (set_name, threads, impl), r in keyed.items():
        if impl not in ("speedtronic", "speedtronic_bf16") or "median_ms" not in r:
            continue
        for other in ("torch", "torch_compiled", "speedtronic_v2"):
            o = keyed.get((set_name, threads, other))
            if o and "median_ms" in o:
                out.append({"set": set_name, "threads": threads, "ours": impl, "vs": other,
                            "speedup": o["median_ms"] / r["median_ms"],
                            "error_ours": errs.get((set_name, impl)),
                            "error_theirs": errs.get((set_name, other))})
    return out


def fmt(x, spec=".3g") -> str:
    return "-" if x is None else format(x, spec)


def write_markdown(path: Path, meta: dict, rows, speedups, memory) -> None:
    lines = [f"# Muon optimizer step benchmark ({meta['device']})", "",
             f"Command: `{meta['command']}`  ", f"Date: {meta['date']}  ",
             f"Hardware: {meta['hardware']['cpu']}, {meta['hardware']['logical_cpus']} logical "
             f"CPUs{', ' + meta['hardware']['gpu'] if 'gpu' in meta['hardware'] else ''}; "
             f"torch {meta['hardware']['torch']}; single-thread GEMM GFLOP/s "
             f"{meta['hardware'].get('gemm_gflops_1thread', {})}; load average at start "
             f"{', '.join(f'{x:.1f}' for x in meta['hardware']['load_average_at_start'])}  ",
             f"CPU flags: {meta['hardware'].get('cpu_bf16_flags', '-')}  ",
             f"Params/grads/state: fp32. Hyperparameters: {HP}, 5 quintic NS steps. "
             f"Median of {meta['repeats']} interleaved rounds after one warm-up step. "
             "Error = relative Frobenius error of the parameter change after 3 steps vs a "
             "float64 evaluation of the same algorithm.", "",
             "| set | threads | implementation | NS dtype | median step (ms) | min (ms) | "
             "error vs fp64 | note |", "|---|---|---|---|---|---|---|---|"]
    dtype = {"speedtronic": "fp32 (auto on CPU)" if meta["device"] == "cpu" else "bf16 (auto)",
             "speedtronic_compiled": "same as eager", "speedtronic_bf16": "bf16 (opt-in)",
             "torch": "bf16 (forced)",
             "torch_compiled": "bf16 (forced)", "speedtronic_v2": "fp32"}
    for r in rows:
        note = r.get("note") or (f"compile {r['compile_s']:.1f} s" if r.get("compile_s")
                                 else "")
        lines.append(f"| {r['set']} | {r['threads']} | {r['impl']} | {dtype[r['impl']]} | "
                     f"{fmt(r.get('median_ms'), '.1f')} | "
                     f"{fmt(min(r['times_ms']) if r.get('times_ms') else None, '.1f')} | "
                     f"{fmt(r.get('error_vs_fp64'), '.2e')} "
                     f"| {note} |")
    lines += ["", "## Speedup of Speedtronic Muon (other median / ours)", "",
              "| set | threads | ours | vs | speedup | our error | their error |",
              "|---|---|---|---|---|---|---|"]
    for s in speedups:
        lines.append(f"| {s['set']} | {s['threads']} | {s['ours']} | {s['vs']} | "
                     f"{s['speedup']:.2f}x | "
                     f"{fmt(s['error_ours'], '.2e')} | {fmt(s['error_theirs'], '.2e')} |")
    if memory:
        lines += ["", "## Peak extra memory of one optimizer step (cautious)", "",
                  "Reference model d_model=512, 8 layers (fp32); each variant in a fresh process; "
                  "peak RSS growth during the 2nd step over the RSS before it (VmHWM reset via "
                  "/proc/self/clear_refs, MALLOC_MMAP_THRESHOLD_=65536, 1 thread). "
                  "`naive_clone` = speedtronic 2.0.0's approach (clone every parameter, step, "
                  "revert masked entries).", "",
                  "| variant | params (MiB) | step peak extra (MiB) |", "|---|---|---|"]
        for m in memory:
            lines.append(f"| {m['variant']} | {m['param_mib']:.1f} | "
                         f"{m['step_peak_extra_mib']:.1f} |")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sets", default="transformer,reference")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--ref-python", default="/work/venv-ref/bin/python",
                    help="python of a venv with speedtronic==2.0.0 ('' to skip)")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--compiled-error", action="store_true",
                    help="also measure the error of the compiled variants (slow on CPU)")
    ap.add_argument("--memory", action="store_true", help="also measure cautious step memory")
    ap.add_argument("--out", default=None, help="output stem (default benchmarks/results/"
                    "optimizer_<device>)")
    ap.add_argument("--render", help="re-write the markdown of an existing result JSON")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--memory-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(args.worker, args.threads[0])
        return
    if args.memory_worker:
        memory_main(args.memory_worker)
        return
    if args.render:
        data = json.loads(Path(args.render).read_text())
        write_markdown(Path(args.render).with_suffix(".md"), data["meta"], data["results"],
                       data["speedups"], data["memory"])
        return
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
        else args.device
    meta = {"device": device, "command": " ".join([Path(sys.executable).name] + sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "hardware": hardware(),
            "repeats": args.repeats, "hyperparameters": HP}
    rows: list[dict] = []
    for set_name in args.sets.split(","):
        shapes = (transformer_shapes(device) if set_name == "transformer" else
                  GPT2_SMALL if set_name == "gpt2_small" else reference_shapes())
        for threads in args.threads:
            print(f"set {set_name} ({len(shapes)} matrices), {threads} thread(s)", flush=True)
            rows += bench_set(set_name, shapes, args, device, threads)
    memory = run_memory() if args.memory else []
    speedups = ratios(rows)
    for s in speedups:
        print(f"{s['set']:12s} t={s['threads']} {s['ours']:17s} vs {s['vs']:15s} "
              f"{s['speedup']:7.2f}x  "
              f"err ours {fmt(s['error_ours'], '.2e')} theirs {fmt(s['error_theirs'], '.2e')}")
    stem = Path(args.out) if args.out else Path(__file__).parent / "results" / f"optimizer_{device}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(
        {"meta": meta, "results": rows, "speedups": speedups, "memory": memory}, indent=1))
    write_markdown(stem.with_suffix(".md"), meta, rows, speedups, memory)
    print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
