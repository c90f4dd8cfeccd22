"""The reference model's CPU layer paths against the forms they replaced, forward + backward.

* RMSNorm: torch's ``F.rms_norm`` (composite on CPU in torch 2.13) against the model's torch-ops
  path (``_RMSNormCPU``, a hand-written backward), and that against the fused C++ kernel of
  ``speedtronic.kernels.cpu``, at (8, 128, 128) fp32.
* SwiGLU: ``silu(gate) * up`` in torch ops against the fused kernel, at (8, 128, 384).
* The short-run YAML's model (benchmarks/bench_short_run.py), forward + backward at batch 8,
  with the fused kernels off and on, at 1 and 2 threads (the kernels are single-threaded: the
  2-thread row is why ``cpu_kernels.MAX_THREADS`` is 2).
* The same kernels built as their AVX2 copy alone (``-mavx2 -mfma -DST_SINGLE_COPY``) against
  torch and MKL held to AVX2 (a child process with ``ATEN_CPU_CAPABILITY=avx2`` and
  ``MKL_ENABLE_INSTRUCTIONS=AVX2``): what a CPU without AVX-512 runs, measured on this one.
* RoPE: the textbook half-split rotation (four half-width muls, a sub, an add, a cat), and the
  three-pass form with its ``[x2, x1]`` swap built by a ``cat`` of two slices, against the
  model's ``_rotate`` (the swap is a ``roll``), for q (8, 4, 128, 32) and k (8, 2, 128, 32) laid
  out as the model makes them (a transposed view of the projection's output).

One thread unless a case says otherwise, interleaved rounds, medians; the numbers quoted in
``speedtronic/models/reference.py``, ``speedtronic/kernels/cpu.py`` and ``csrc/cpu/`` come from
here.

    python benchmarks/bench_cpu_layers.py
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from speedtronic.config import ModelConfig
from speedtronic.kernels import cpu as cpu_kernels
from speedtronic.models import extract_loss
from speedtronic.models import reference as ref

RESULTS = Path(__file__).resolve().parent / "results"


def textbook_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def cat_swap_rope(x: torch.Tensor, cos_full: torch.Tensor,
                  sin_signed: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos_full, swapped, sin_signed)


Case = tuple[str, Callable[[], None], Callable[[], None], int]


def _kernels(on: bool, fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` with the fused CPU kernels forced on or off (the gate is read at every call)."""
    gate = cpu_kernels.usable

    def run() -> None:
        cpu_kernels.usable = gate if on else (lambda *t, **kw: False)
        try:
            fn()
        finally:
            cpu_kernels.usable = gate
    return run


def _avx2_library() -> ctypes.CDLL | None:
    """The kernels built as their AVX2 copy alone (what a CPU without AVX-512 runs), or None."""
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        return None
    folder = Path(tempfile.mkdtemp(prefix="st-avx2-"))
    lib = folder / "fused_cpu_avx2.so"
    src = Path(__file__).resolve().parent.parent / "csrc" / "cpu" / "fused_cpu.cpp"
    subprocess.run([cxx, "-O3", "-std=c++17", "-fno-math-errno", "-fno-trapping-math",
                    "-fPIC", "-shared", "-mavx2", "-mfma", "-DST_SINGLE_COPY", str(src), "-o",
                    str(lib)], check=True)
    out = ctypes.CDLL(str(lib))
    cpu_kernels.bind(out)
    return out


def _with_library(lib: ctypes.CDLL, fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` with the kernels' calls going to ``lib``."""
    def run() -> None:
        saved, cpu_kernels._lib = cpu_kernels._lib, lib
        try:
            fn()
        finally:
            cpu_kernels._lib = saved
    return run


def _model_step() -> Callable[[], None]:
    """Forward + backward of the short-run YAML's model on one batch of 8 x 128 tokens."""
    cfg = ModelConfig(vocab_size=256, max_seq_len=128, n_layer=4, n_head=4, n_kv_head=2,
                      d_model=128)
    model = ref.build_reference_transformer(cfg)
    x = torch.randint(0, 256, (8, 128))

    def step() -> None:
        extract_loss(model(x, x)).backward()
        model.zero_grad(set_to_none=True)
    return step


def cases(avx2_child: bool = False) -> dict[str, Case]:
    """name -> (what "before" is, before, after, threads), each one forward + backward.

    ``avx2_child``: only the AVX2-copy rows (run in a child process held to AVX2)."""
    cpu_kernels.status()  # load now: _with_library must not be the first to touch the library
    torch.manual_seed(0)
    out: dict[str, Case] = {}
    x = torch.randn(8, 128, 128, requires_grad=True)
    g = torch.randn(8, 128, 128)
    norm = ref.RMSNorm(128)
    gate = torch.randn(8, 128, 384, requires_grad=True)
    up = torch.randn(8, 128, 384, requires_grad=True)
    gh = torch.randn(8, 128, 384)
    if avx2_child:
        avx2 = _avx2_library()
        step = _model_step()
        if avx2 is None:
            return out
        out["SwiGLU (8, 128, 384), fused kernel, AVX2 copy"] = (
            "`silu(gate) * up`", lambda: (F.silu(gate) * up).backward(gh),
            _with_library(avx2, lambda: cpu_kernels.swiglu(gate, up).backward(gh)), 1)
        out["RMSNorm (8, 128, 128), fused kernel, AVX2 copy"] = (
            "torch-ops path", _kernels(False, lambda: norm(x).backward(g)),
            _with_library(avx2, _kernels(True, lambda: norm(x).backward(g))), 1)
        out["short-run model, 1 thread(s), fused kernels, AVX2 copy"] = (
            "kernels off", _kernels(False, step), _with_library(avx2, _kernels(True, step)), 1)
        return out
    out["RMSNorm (8, 128, 128)"] = (
        "`F.rms_norm`", lambda: F.rms_norm(x, (128,), norm.weight, norm.eps).backward(g),
        _kernels(False, lambda: norm(x).backward(g)), 1)
    if cpu_kernels.status().loaded:
        out["RMSNorm (8, 128, 128), fused kernel"] = (
            "torch-ops path", _kernels(False, lambda: norm(x).backward(g)),
            _kernels(True, lambda: norm(x).backward(g)), 1)
        out["SwiGLU (8, 128, 384), fused kernel"] = (
            "`silu(gate) * up`", lambda: (F.silu(gate) * up).backward(gh),
            lambda: cpu_kernels.swiglu(gate, up).backward(gh), 1)
        # Small tensors: where the Function + ctypes overhead stops paying (SWIGLU_MIN_NUMEL).
        for rows in (128, 512):
            gs = torch.randn(rows, 128, requires_grad=True)
            us = torch.randn(rows, 128, requires_grad=True)
            hs = torch.randn(rows, 128)
            out[f"SwiGLU ({rows}, 128) = {rows * 128:,} elements, fused kernel"] = (
                "`silu(gate) * up`",
                lambda gs=gs, us=us, hs=hs: (F.silu(gs) * us).backward(hs),
                lambda gs=gs, us=us, hs=hs: cpu_kernels.fused_swiglu(gs, us).backward(hs), 1)
        step = _model_step()
        for threads in (1, 2):
            out[f"short-run model, {threads} thread(s), fused kernels"] = (
                "kernels off", _kernels(False, step), _kernels(True, step), threads)
    cos, sin = ref.rope_tables(32, 128, 10_000.0)
    cos_full, sin_signed = ref._full_tables(cos, sin)
    for heads in (4, 2):
        q = torch.randn(8, 128, heads, 32).transpose(1, 2).requires_grad_()  # (B, H, T, hd) view
        gq = torch.randn(8, heads, 128, 32)
        after = lambda q=q, gq=gq: ref._rotate(q, cos_full, sin_signed).backward(gq)  # noqa: E731
        out[f"RoPE (8, {heads}, 128, 32)"] = (
            "textbook", lambda q=q, gq=gq: textbook_rope(q, cos, sin).backward(gq), after, 1)
        out[f"RoPE (8, {heads}, 128, 32), swap"] = (
            "`cat` swap",
            lambda q=q, gq=gq: cat_swap_rope(q, cos_full, sin_signed).backward(gq), after, 1)
    return out


def measure(chosen: dict[str, Case], rounds: int, calls: int) -> dict[str, dict]:
    """Interleaved rounds of before / after per case; medians in microseconds."""
    results = {}
    for name, (what, before, after, threads) in chosen.items():
        torch.set_num_threads(threads)
        n = calls if "model" not in name else 5
        times: dict[str, list[float]] = {"before": [], "after": []}
        for fn in (before, after):
            for _ in range(10):
                fn()
        for _ in range(rounds):
            for label, fn in (("before", before), ("after", after)):
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                times[label].append((time.perf_counter() - t0) / n * 1e6)
        med = {k: statistics.median(v) for k, v in times.items()}
        results[name] = {"before": what, "before_us": med["before"], "after_us": med["after"],
                         "ratio": med["after"] / med["before"]}
        print(f"{name}: {med['before']:.0f} -> {med['after']:.0f} us", file=sys.stderr,
              flush=True)
    return results


def main() -> None:
    from bench_data import cpu_flags  # this folder is sys.path[0] when run as a script

    rounds, calls = 9, 50
    if "--avx2-child" in sys.argv:
        print(json.dumps(measure(cases(avx2_child=True), rounds, calls)))
        return
    results = measure(cases(), rounds, calls)
    if cpu_kernels.status().loaded and shutil.which(os.environ.get("CXX", "g++")):
        # torch's own kernels dispatch on the CPU too: hold torch and MKL to AVX2 in a child.
        env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2",
                   OMP_NUM_THREADS="1")
        child = subprocess.run([sys.executable, __file__, "--avx2-child"], env=env, check=True,
                               capture_output=True, text=True)
        print(child.stderr, file=sys.stderr, end="")
        results.update(json.loads(child.stdout))
    meta = {"command": "python benchmarks/bench_cpu_layers.py", "cpu": cpu_flags(),
            "torch": torch.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "threads": "1 unless the case says",
            "dtype": "fp32", "cpu_kernels": cpu_kernels.status().line(),
            "rounds": rounds, "calls_per_round": calls}
    (RESULTS / "cpu_layers.json").write_text(json.dumps({**meta, "results": results},
                                                        indent=1) + "\n")
    lines = ["# Reference-model layers on CPU: forward + backward, before and after", "",
             f"Command: `{meta['command']}`, {meta['date']} UTC; {meta['cpu']}; torch "
             f"{meta['torch']}, Python {meta['python']}, 1 thread unless the case says, fp32. "
             f"Median of {rounds} interleaved rounds of {calls} calls (5 for the model). "
             f"`{meta['cpu_kernels']}`.", "",
             "| case | before | before (us) | after (us) | after / before |",
             "|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['before']} | {r['before_us']:.0f} | {r['after_us']:.0f} | "
                     f"{r['ratio']:.2f} |")
    lines += ["", "RMSNorm: `F.rms_norm` against the model's torch-ops path (a hand-written "
              "backward), and that against the fused C++ kernel (`speedtronic.kernels.cpu`). "
              "SwiGLU: torch ops against the fused kernel. RoPE: the textbook half-split form "
              "and the three-pass form with its swap as a `cat` of two slices, against "
              "`_rotate` (swap by `roll`). Model: the short-run YAML's model, forward + backward "
              "of one 8 x 128 batch, kernels off against on. AVX2 copy: the kernels compiled "
              "with `-mavx2 -mfma -DST_SINGLE_COPY`, the code a CPU without AVX-512 runs. "
              "AVX2 rows run in a child process with torch and MKL held to AVX2 too "
              "(`ATEN_CPU_CAPABILITY=avx2`, `MKL_ENABLE_INSTRUCTIONS=AVX2`): both sides as on "
              "such a CPU."]
    (RESULTS / "cpu_layers.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
