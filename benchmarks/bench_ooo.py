"""Step time with and without out-of-order backprop, side by side in one run.

Variants (each its own copy of the same initial model and AdamW, timed in interleaved rounds so
machine noise hits all of them alike; the median of the rounds is reported):

* ``standard``  plain backward - the baseline;
* ``off``       the trainer's path when ``ooo_backprop: false``: ``build_ooo_scheduler`` returned
                None and each step pays only the ``if sched is not None`` check;
* ``paused``    scheduler installed but paused (cost of the forward wrappers alone);
* ``on``        deferral on: CUDA side streams with ``--device cuda``, else the forced CPU queue.

Models: the reference transformer (``speedtronic.models.build_model``) and a model with
independent branches. Each step = 2 accumulated micro-batches, flush, clip to 1.0, AdamW step.

    python benchmarks/bench_ooo.py                 # CPU, 1 thread and all threads
    python benchmarks/bench_ooo.py --device cuda   # GPU (bf16 autocast; called by gpu_check.sh)

Writes ``benchmarks/results/ooo_<device>.json`` and ``.md`` (hardware, dtype, torch, command).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from speedtronic.config import load_config
from speedtronic.models import build_model
from speedtronic.ooo.scheduler import OOOScheduler, build_ooo_scheduler

VARIANTS = ("standard", "off", "paused", "on")


class Branches(nn.Module):
    """``n`` independent MLP branches over the same input, summed, then a classifier head."""

    def __init__(self, d: int, hidden: int, n: int, classes: int) -> None:
        super().__init__()
        self.branches = nn.ModuleList(
            nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)) for _ in range(n))
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = sum(branch(x) for branch in self.branches)  # (B, T, d)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def _sizes(device: str) -> dict[str, Any]:
    if device == "cuda":  # big enough that GEMMs, not launches, dominate
        return {"ref": {"d_model": 1024, "n_layer": 8, "n_head": 16, "max_seq_len": 512,
                        "vocab_size": 32768}, "B": 8, "T": 512, "branch": (1024, 4096, 4)}
    return {"ref": {"d_model": 256, "n_layer": 4, "n_head": 8, "max_seq_len": 128,
                    "vocab_size": 256}, "B": 4, "T": 128, "branch": (256, 1024, 4)}


def _models(device: str) -> dict[str, tuple[nn.Module, int]]:
    s = _sizes(device)
    torch.manual_seed(0)
    ref = build_model(load_config({"model": s["ref"]}).model)
    d, hidden, n = s["branch"]
    torch.manual_seed(0)
    return {"reference": (ref, s["ref"]["vocab_size"]),
            "branches": (_BranchesLM(d, hidden, n, vocab=512), 512)}


class _BranchesLM(nn.Module):
    """Token embedding in front of :class:`Branches` so it takes the same (ids, labels) batches."""

    def __init__(self, d: int, hidden: int, n: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.body = Branches(d, hidden, n, vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(x), y)


class _Runner:
    def __init__(self, variant: str, model: nn.Module, device: torch.device) -> None:
        self.variant = variant
        self.model = copy.deepcopy(model).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.sched: OOOScheduler | None = None
        cfg = load_config({"ooo_backprop": variant in ("paused", "on")})
        t0 = time.perf_counter()
        self.sched = build_ooo_scheduler(self.model, cfg, device,
                                         force_cpu=device.type == "cpu")
        self.build_ms = 1000 * (time.perf_counter() - t0)
        self._pause = self.sched.paused() if variant == "paused" and self.sched else None
        if self._pause is not None:
            self._pause.__enter__()
        self.device = device

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for x, y in batches:
            with torch.autocast(self.device.type, dtype=torch.bfloat16,
                                enabled=self.device.type == "cuda"):
                loss = self.model(x, y)
            loss.backward()
        if self.sched is not None:  # the trainer's check; all "off" pays per step
            self.sched.flush()
        nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        if self._pause is not None:
            self._pause.__exit__(None, None, None)
        if self.sched is not None:
            self.sched.close()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _grad_check(model: nn.Module, batches: list, device: torch.device) -> dict[str, Any]:
    """fp32 gradients of one accumulated step, standard vs on: bitwise equal? max abs diff."""
    grads = []
    for variant in ("standard", "on"):
        r = _Runner(variant, model, device)
        for x, y in batches:
            r.model(x, y).backward()
        if r.sched is not None:
            r.sched.flush()
        _sync(device)
        grads.append([p.grad.float().clone() for p in r.model.parameters()])
        r.close()
    diff = max((a - b).abs().max().item() for a, b in zip(*grads, strict=True))
    equal = all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    return {"bitwise_equal": equal, "max_abs_diff": diff}


def bench_model(name: str, model: nn.Module, vocab: int, device: torch.device, rounds: int,
                steps: int) -> dict[str, Any]:
    s = _sizes(device.type)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, vocab, (s["B"], s["T"]), generator=g).to(device),
                torch.randint(0, vocab, (s["B"], s["T"]), generator=g).to(device))
               for _ in range(2)]
    runners = {v: _Runner(v, model, device) for v in VARIANTS}
    for r in runners.values():  # warm-up: allocator, kernels, AdamW state
        r.step(batches)
    _sync(device)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu_times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(rounds):
        order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]  # no variant always goes first
        for v in order:
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                runners[v].step(batches)
            _sync(device)
            times[v].append(1000 * (time.perf_counter() - t0) / steps)
            cpu_times[v].append(1000 * (time.process_time() - c0) / steps)
    peak = None
    if device.type == "cuda":
        peak = {}
        for v in ("standard", "on"):
            torch.cuda.reset_peak_memory_stats(device)
            runners[v].step(batches)
            _sync(device)
            peak[v] = torch.cuda.max_memory_allocated(device)
    result: dict[str, Any] = {
        "model": name, "params": sum(p.numel() for p in model.parameters()),
        "layers_deferred": runners["on"].sched.num_layers if runners["on"].sched else 0,
        "batch": [s["B"], s["T"]], "micro_batches_per_step": len(batches),
        "step_ms": {v: statistics.median(t) for v, t in times.items()},
        "step_cpu_ms": {v: statistics.median(t) for v, t in cpu_times.items()},
        "step_ms_all": times, "step_cpu_ms_all": cpu_times,
        "build_ms": {v: r.build_ms for v, r in runners.items()}, "peak_memory_bytes": peak,
    }
    # On a shared CPU box wall time swings by +-10% between identical runs; process CPU time
    # does not see other tenants, so CPU overheads are computed from it (wall on CUDA).
    key = "step_ms" if device.type == "cuda" else "step_cpu_ms"
    result["overhead_basis"] = key
    base = result[key]["standard"]
    result["overhead_pct"] = {v: 100.0 * (result[key][v] / base - 1.0)
                              for v in VARIANTS if v != "standard"}
    for r in runners.values():
        r.close()
    result["grad_check_fp32"] = _grad_check(model, batches[:1], device)
    return result


def _hardware(device: torch.device) -> dict[str, Any]:
    from bench_data import cpu_flags  # this folder is sys.path[0] when run as a script

    info = {"load_average_1m_at_start": round(os.getloadavg()[0], 1),
            "platform": platform.platform(), "processor": cpu_flags(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["capability"] = list(torch.cuda.get_device_capability(device))
        info["cuda"] = torch.version.cuda
    return info


def _markdown(report: dict[str, Any]) -> str:
    lines = [f"# Out-of-order backprop benchmark ({report['device']})", "",
             f"Command: `{report['command']}`  ",
             f"torch {report['hardware']['torch']}, dtype {report['dtype']}, "
             f"{report['hardware'].get('gpu', report['hardware']['processor'])} "
             f"({report['hardware']['cpu_count']} CPUs, 1-min load average "
             f"{report['hardware']['load_average_1m_at_start']} at start), {report['rounds']} "
             f"interleaved rounds x {report['steps']} steps, median per step.", "",
             "| threads | model | standard ms | off | paused | on | wall ms (std / on) | "
             "grads fp32 |", "|---|---|---|---|---|---|---|---|"]
    for run in report["runs"]:
        for r in run["models"]:
            ms, pct = r[r["overhead_basis"]], r["overhead_pct"]
            wall = f"{r['step_ms']['standard']:.1f} / {r['step_ms']['on']:.1f}"
            check = r["grad_check_fp32"]
            grads = "bitwise equal" if check["bitwise_equal"] else \
                f"max diff {check['max_abs_diff']:.2e}"
            cells = [f"{ms[v]:.1f} ({pct[v]:+.1f}%)" for v in ("off", "paused", "on")]
            lines.append(f"| {run['threads']} | {r['model']} ({r['layers_deferred']} layers) | "
                         f"{ms['standard']:.1f} | " + " | ".join(cells) + f" | {wall} | {grads} |")
    basis = "process CPU time" if report["device"] == "cpu" else "wall time"
    lines += ["", f"Step times and overheads use {basis} (median of the rounds); a shared CPU "
              "machine makes wall time swing by about 10% between identical variants.",
              "", "`off` = ooo_backprop false (the trainer's per-step check only); `paused` = "
              "wrappers installed, standard backward; `on` = deferral ("
              + ("CUDA side streams" if report["device"] == "cuda" else "forced CPU queue")
              + "). Percentages are relative to `standard` in the same run."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=2, help="steps per round and variant")
    parser.add_argument("--threads", default="1,all", help="CPU thread settings, e.g. 1,all")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_ooo: error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    all_threads = torch.get_num_threads()
    settings = [all_threads] if device.type == "cuda" else sorted(
        {all_threads if t == "all" else int(t) for t in args.threads.split(",")})
    report: dict[str, Any] = {
        "device": device.type, "dtype": "bf16 autocast" if device.type == "cuda" else "fp32",
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else
                                                         sys.argv[1:])]),
        "hardware": _hardware(device), "rounds": args.rounds, "steps": args.steps, "runs": []}
    for threads in settings:
        torch.set_num_threads(threads)
        run = {"threads": threads, "models": []}
        for name, (model, vocab) in _models(device.type).items():
            res = bench_model(name, model, vocab, device, args.rounds, args.steps)
            run["models"].append(res)
            base = res[res["overhead_basis"]]["standard"]
            print(f"[threads={threads}] {name}: standard {base:.1f} ms, "
                  + ", ".join(f"{v} {p:+.1f}%" for v, p in res["overhead_pct"].items())
                  + f", grads {res['grad_check_fp32']}", flush=True)
        report["runs"].append(run)
    torch.set_num_threads(all_threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"ooo_{device.type}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"ooo_{device.type}.md").write_text(_markdown(report))
    print(_markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
