"""The reference model's CPU layer paths against the forms they replaced, forward + backward.

* RMSNorm: torch's ``F.rms_norm`` (composite on CPU in torch 2.13) against the model's
  ``RMSNorm`` (a hand-written backward on CPU eager), at (8, 128, 128) fp32.
* RoPE: the textbook half-split rotation (four half-width muls, a sub, an add, a cat), and the
  three-pass form with its ``[x2, x1]`` swap built by a ``cat`` of two slices, against the
  model's ``_rotate`` (the swap is a ``roll``), for q (8, 4, 128, 32) and k (8, 2, 128, 32) laid
  out as the model makes them (a transposed view of the projection's output).

One thread, interleaved rounds, medians; the numbers quoted in ``speedtronic/models/reference.py``
come from here.

    python benchmarks/bench_cpu_layers.py
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

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


Case = tuple[str, Callable[[], None], Callable[[], None]]


def cases() -> dict[str, Case]:
    """name -> (what "before" is, before, after), each one forward + backward."""
    torch.manual_seed(0)
    out: dict[str, Case] = {}
    x = torch.randn(8, 128, 128, requires_grad=True)
    g = torch.randn(8, 128, 128)
    norm = ref.RMSNorm(128)
    out["RMSNorm (8, 128, 128)"] = (
        "`F.rms_norm`", lambda: F.rms_norm(x, (128,), norm.weight, norm.eps).backward(g),
        lambda: norm(x).backward(g))
    cos, sin = ref.rope_tables(32, 128, 10_000.0)
    cos_full, sin_signed = ref._full_tables(cos, sin)
    for heads in (4, 2):
        q = torch.randn(8, 128, heads, 32).transpose(1, 2).requires_grad_()  # (B, H, T, hd) view
        gq = torch.randn(8, heads, 128, 32)
        after = lambda q=q, gq=gq: ref._rotate(q, cos_full, sin_signed).backward(gq)  # noqa: E731
        out[f"RoPE (8, {heads}, 128, 32)"] = (
            "textbook", lambda q=q, gq=gq: textbook_rope(q, cos, sin).backward(gq), after)
        out[f"RoPE (8, {heads}, 128, 32), swap"] = (
            "`cat` swap",
            lambda q=q, gq=gq: cat_swap_rope(q, cos_full, sin_signed).backward(gq), after)
    return out


def main() -> None:
    from bench_data import cpu_flags  # this folder is sys.path[0] when run as a script

    torch.set_num_threads(1)
    rounds, calls = 9, 50
    results = {}
    for name, (what, before, after) in cases().items():
        times: dict[str, list[float]] = {"before": [], "after": []}
        for fn in (before, after):
            for _ in range(10):
                fn()
        for _ in range(rounds):
            for label, fn in (("before", before), ("after", after)):
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                times[label].append((time.perf_counter() - t0) / calls * 1e6)
        med = {k: statistics.median(v) for k, v in times.items()}
        results[name] = {"before": what, "before_us": med["before"], "after_us": med["after"],
                         "ratio": med["after"] / med["before"]}
        print(f"{name}: {med['before']:.0f} -> {med['after']:.0f} us", flush=True)
    meta = {"command": "python benchmarks/bench_cpu_layers.py", "cpu": cpu_flags(),
            "torch": torch.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "threads": 1, "dtype": "fp32",
            "rounds": rounds, "calls_per_round": calls}
    (RESULTS / "cpu_layers.json").write_text(json.dumps({**meta, "results": results},
                                                        indent=1) + "\n")
    lines = ["# Reference-model layers on CPU: forward + backward, before and after", "",
             f"Command: `{meta['command']}`, {meta['date']} UTC; {meta['cpu']}; torch "
             f"{meta['torch']}, Python {meta['python']}, 1 thread, fp32. Median of {rounds} "
             f"interleaved rounds of {calls} calls.", "",
             "| case | before | before (us) | after (us) | after / before |",
             "|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['before']} | {r['before_us']:.0f} | {r['after_us']:.0f} | "
                     f"{r['ratio']:.2f} |")
    lines += ["", "Before: `F.rms_norm`; the textbook half-split RoPE; the three-pass RoPE with "
              "its swap as a `cat` of two slices. After: the reference model's `RMSNorm` (CPU "
              "eager path) and `_rotate` (swap by `roll`)."]
    (RESULTS / "cpu_layers.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
