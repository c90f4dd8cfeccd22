"""Host cost of out-of-order backprop per deferred layer, on CPU with fake CUDA streams.

A launch-bound GPU step is paced by the host: every microsecond of Python or stream API work per
layer adds to the step. This benchmark runs the scheduler's CUDA-streams code path on tiny CPU
tensors (so arithmetic is negligible) with ``torch.cuda`` stream, event and ``record_stream``
calls replaced by counting no-ops, and reports, per deferred ``nn.Linear``:

* the extra host time of a training step (forward + backward + flush) against the standard
  backward, in microseconds (real CUDA API calls would add their own cost on top: the calls are
  counted so they can be priced on a GPU);
* the stream API calls made (``wait_stream``, ``record_stream``, stream switches, events).

``--baseline-rev REV`` also loads ``speedtronic/ooo/scheduler.py`` from that git revision and
measures it in the same interleaved rounds (before/after of an optimisation, one run).

    python benchmarks/bench_ooo_host.py --baseline-rev HEAD~1
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

import speedtronic.ooo.scheduler as ooo_current

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]


class _Counting:
    """Fake ``torch.cuda`` stream machinery: no-ops that count what the scheduler calls."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.current: Any = None

    def stream(self, name: str) -> Any:
        counter = self.calls

        class Stream:
            def wait_stream(self, other: Any) -> None:
                counter["wait_stream"] += 1

            def wait_event(self, event: Any) -> None:
                counter["wait_event"] += 1

        s = Stream()
        s.name = name
        return s

    @contextlib.contextmanager
    def patched(self, ambient: Any):
        counter = self.calls
        self.current = ambient
        outer = self

        @contextlib.contextmanager
        def use(stream: Any):
            counter["stream_switch"] += 1
            before, outer.current = outer.current, stream
            try:
                yield
            finally:
                outer.current = before

        class Event:
            def __init__(self, *a: Any, **k: Any) -> None:
                counter["event"] += 1

            def record(self, stream: Any = None) -> None:
                counter["event_record"] += 1

        def record_stream(tensor: torch.Tensor, stream: Any) -> None:
            counter["record_stream"] += 1

        saved = (torch.cuda.current_stream, torch.cuda.stream, torch.cuda.Event,
                 torch.Tensor.record_stream)
        torch.cuda.current_stream = lambda device=None: outer.current
        torch.cuda.stream = use
        torch.cuda.Event = Event
        torch.Tensor.record_stream = record_stream
        try:
            yield
        finally:
            (torch.cuda.current_stream, torch.cuda.stream, torch.cuda.Event,
             torch.Tensor.record_stream) = saved


class MLPStack(nn.Module):
    """``n`` Linear(d, d) + GELU layers: the launch-bound case (tiny GEMMs)."""

    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return x.square().mean()


def _load_baseline(rev: str) -> Any:
    """The scheduler of ``rev``: its whole ``speedtronic/ooo/`` package, imported as
    ``speedtronic._ooo_baseline`` so its relative imports (``.deferred_linear``, ``..config``)
    resolve; loading ``scheduler.py`` alone broke once the package was split into modules."""
    folder = Path(tempfile.mkdtemp()) / "_ooo_baseline"
    folder.mkdir()
    listed = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:speedtronic/ooo"], cwd=ROOT,
                            capture_output=True, text=True)
    if listed.returncode != 0:
        sys.exit(f"--baseline-rev {rev}: no speedtronic/ooo/ package at that revision "
                 f"({listed.stderr.strip()})")
    for name in listed.stdout.split():
        if name.endswith(".py"):
            (folder / name).write_text(subprocess.run(
                ["git", "show", f"{rev}:speedtronic/ooo/{name}"], cwd=ROOT, check=True,
                capture_output=True, text=True).stdout)
    # an empty package around them: the revision's __init__ serves deprecated names by its
    # own package name, which this copy does not have
    package = types.ModuleType("speedtronic._ooo_baseline")
    package.__path__ = [str(folder)]
    sys.modules[package.__name__] = package
    return importlib.import_module(f"{package.__name__}.scheduler")


def _make(variant: str, module: Any, base: nn.Module, fake: _Counting) -> tuple[nn.Module, Any]:
    model = copy.deepcopy(base)
    if variant == "standard":
        return model, None
    sched = module.OOOScheduler(model, "cpu", num_streams=4)
    streams = [fake.stream(f"side{i}") for i in range(4)]
    sched.mode, sched.streams = "cuda-streams", streams
    for i, layer in enumerate(sched._layers):
        for slot in (layer.weight, layer.bias):
            if slot is not None:
                slot.stream = streams[i % len(streams)]
    return model, sched


def _step(model: nn.Module, sched: Any, x: torch.Tensor) -> None:
    model(x).backward()
    if sched is not None:
        sched.flush()
    for p in model.parameters():
        p.grad = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-rev", default=None)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=40, help="steps per round and variant")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = MLPStack(args.width, args.layers)
    x = torch.randn(8, args.width)
    modules = {"current": ooo_current}
    if args.baseline_rev:
        modules = {f"baseline ({args.baseline_rev})": _load_baseline(args.baseline_rev),
                   **modules}
    fake = _Counting()
    ambient = fake.stream("ambient")
    times: dict[str, list[float]] = {"standard": []}
    calls: dict[str, dict[str, float]] = {}
    with fake.patched(ambient):
        runners = {"standard": _make("standard", None, base, fake)}
        for label, module in modules.items():
            runners[label] = _make("on", module, base, fake)
            times[label] = []
        for label, (model, sched) in runners.items():  # warm-up, and count the calls
            fake.calls.clear()
            _step(model, sched, x)
            calls[label] = {k: v / args.layers for k, v in sorted(fake.calls.items())}
        for _ in range(args.rounds):
            for label, (model, sched) in runners.items():
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    _step(model, sched, x)
                times[label].append((time.perf_counter() - t0) / args.steps * 1e6)
    med = {k: statistics.median(v) for k, v in times.items()}
    per_layer = {k: (v - med["standard"]) / args.layers for k, v in med.items()}
    result = {"layers": args.layers, "width": args.width, "rounds": args.rounds,
              "steps": args.steps, "step_us": med, "extra_us_per_layer": per_layer,
              "stream_calls_per_layer": calls, "torch": torch.__version__,
              "machine": platform.processor() or platform.machine(),
              "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "command": "python benchmarks/bench_ooo_host.py" +
                         (f" --baseline-rev {args.baseline_rev}" if args.baseline_rev else "")}
    (RESULTS / "ooo_host_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# Out-of-order backprop: host cost per deferred layer (CPU, fake CUDA streams)", "",
             f"Command: `{result['command']}`, {result['date']} UTC; {result['machine']}, "
             f"Python {result['python']}, torch {result['torch']}, 1 thread, fp32.", "",
             f"Model: {args.layers} x (Linear({args.width}, {args.width}) + GELU), input "
             f"(8, {args.width}): arithmetic is negligible, so the step is host time. Median "
             f"of {args.rounds} interleaved rounds of {args.steps} steps (forward, backward, "
             "flush).", "",
             "| variant | step (us) | extra per layer (us) | stream API calls per layer |",
             "|---|---|---|---|"]
    for label in times:
        call_text = ", ".join(f"{k} {v:g}" for k, v in calls.get(label, {}).items()) or "-"
        extra = "-" if label == "standard" else f"{per_layer[label]:.1f}"
        lines.append(f"| {label} | {med[label]:.0f} | {extra} | {call_text} |")
    lines += ["", "Stream API calls are no-ops here; on a GPU each costs host time of its own "
              "(a few microseconds), which is why their count is reported."]
    (RESULTS / "ooo_host_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
