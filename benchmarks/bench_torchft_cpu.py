"""torchft replica groups on CPU: overhead per step, and what a lost and a restarted group cost.

Side by side in one invocation, 2 processes at a time on the same 2 cores (1 thread each), so
both sides share the machine alike; rounds interleave the settings:

* ``2 independent processes`` (torchft.mode off): the baseline step time of a process that
  shares the machine with another one;
* ``2 groups, ddp``: a quorum per step, a flat gradient all-reduce (gloo, loopback) and a
  commit vote;
* ``2 groups, diloco``: 10 local steps per round, then a pseudo-gradient all-reduce.

Step time is the median of each run's ``step_ms`` log rows after the first (both groups'
rows pooled); overhead = groups / independent.

**Recovery** (ddp, 1 round): group 1 is SIGKILLed after step 20 of 60; the survivor's step
times are logged every step, so its stall is the slowest of its steps after the kill minus its
median step (the Lighthouse drops a group whose heartbeat stops for ``--heartbeat-ms``;
torchft_lighthouse's default is 5000 ms, this bench uses 1000 like the tests). Then group 1 is
restarted from its checkpoint: the heal is the restarted group's healing step minus its median
step (quorum, HTTP transfer of the survivor's state, load).

    OMP_NUM_THREADS=1 python benchmarks/bench_torchft_cpu.py [--rounds 3] [--steps 60]

Writes ``benchmarks/results/torchft_cpu.{json,md}``. Needs torchft (``pip install '.[ft]'``).
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
import yaml

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FT_JOB = ROOT / "tests" / "distributed" / "ft_job.py"  # the tests' group runner (fault hooks)
# the torchrun bench's model (~5M parameters, 20 MB of fp32 gradients per all-reduce)
MODEL = {"d_model": 256, "n_layer": 6, "n_head": 4, "max_seq_len": 128}


def _config(tmp: Path, name: str, group: int, mode: str, steps: int, every: int) -> Path:
    raw = {
        "run": {"name": name, "output_dir": str(tmp), "max_steps": steps, "eval_every": 0,
                "seed": 0, "device": "cpu", "num_threads": 1},
        "model": MODEL,
        "data": {"micro_batch_size": 8, "target_batch_size": 8, "stdlib_max_bytes": 4_000_000},
        "optimizer": {"name": "muon"},
        "logging": {"every_steps": every, "progress_bar": False},
        "checkpoint": {"every_steps": 10},
        "shape_validation": {"enabled": False},
        "compile": False,
    }
    if mode != "off":
        raw["torchft"] = {"mode": mode, "replica_group": group, "replica_groups": 2,
                          "hostname": "127.0.0.1", "inner_steps": 10, "timeout_s": 30}
    else:
        raw["run"]["name"] = f"{name}-{group}"
    path = tmp / f"{name}-{group}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _env(lighthouse: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), RUST_LOG="warn",
               TORCHFT_LIGHTHOUSE=lighthouse)
    env.pop("WORLD_SIZE", None)
    return env


def _start(args: list[str], lighthouse: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env(lighthouse), cwd=ROOT)


def _wait(proc: subprocess.Popen, what: str, expect: int = 0) -> None:
    out, _ = proc.communicate(timeout=1800)
    if proc.returncode != expect:
        raise SystemExit(f"{what} exited {proc.returncode}:\n{out[-3000:]}")


def _rows(run_dir: Path, event: str) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["event"] == event]


class Lighthouse:
    def __init__(self, heartbeat_ms: int) -> None:
        from torchft._torchft import LighthouseServer

        self.server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1,
                                       join_timeout_ms=10_000, heartbeat_timeout_ms=heartbeat_ms)
        self.address = f"http://127.0.0.1:{self.server.address().rsplit(':', 1)[1]}"

    def close(self) -> None:
        self.server.shutdown()


def run_pair(tmp: Path, name: str, mode: str, steps: int, heartbeat_ms: int) -> float:
    """Two processes at once; the median step_ms of both's log rows after the first."""
    lh = Lighthouse(heartbeat_ms)
    try:
        gate = tmp / f"{name}.up"
        cfgs = [_config(tmp, name, g, mode, steps, 10) for g in (0, 1)]
        procs = [_start([str(FT_JOB), str(cfgs[0]), "--wait-start", str(gate)], lh.address),
                 _start([str(FT_JOB), str(cfgs[1]), "--announce", str(gate)], lh.address)]
        for proc in procs:
            _wait(proc, name)
    finally:
        lh.close()
    dirs = ([tmp / name / f"replica_group_{g}" for g in (0, 1)] if mode != "off"
            else [tmp / f"{name}-{g}" for g in (0, 1)])
    return statistics.median(r["step_ms"] for d in dirs for r in _rows(d, "train_step")[1:])


def run_recovery(tmp: Path, steps: int, heartbeat_ms: int) -> dict[str, float]:
    lh = Lighthouse(heartbeat_ms)
    name, kill_at = "recovery", 20
    try:
        up, back = tmp / "recovery.up", tmp / "recovery.back"
        cfgs = [_config(tmp, name, g, "ddp", steps, 1) for g in (0, 1)]
        survivor = _start([str(FT_JOB), str(cfgs[0]), "--wait-start", str(up), "--wait-at",
                           str(kill_at + 20), "--gate", str(back)], lh.address)
        doomed = _start([str(FT_JOB), str(cfgs[1]), "--announce", str(up), "--die-at",
                         str(kill_at)], lh.address)
        _wait(doomed, "doomed group", expect=-9)
        restarted = _start([str(FT_JOB), str(cfgs[1]), "--resume", "--announce", str(back)],
                           lh.address)
        _wait(survivor, "survivor")
        _wait(restarted, "restarted group")
    finally:
        lh.close()
    g0, g1 = (tmp / name / f"replica_group_{g}" for g in (0, 1))
    s_rows = {r["step"]: r["step_ms"] for r in _rows(g0, "train_step")}
    median0 = statistics.median(s_rows.values())
    after_kill = [s_rows[s] for s in range(kill_at + 1, kill_at + 6) if s in s_rows]
    heal = _rows(g1, "torchft_heal")[-1]
    r_rows = {r["step"]: r["step_ms"] for r in _rows(g1, "train_step")}
    healed_step = heal["step"] + 1
    median1 = statistics.median(v for s, v in r_rows.items() if s > healed_step + 1)
    return {"survivor_median_step_ms": median0,
            "survivor_stall_ms": max(after_kill) - median0,
            "heal_step_ms_over_median": r_rows[healed_step] - median1,
            "healed_at_step": healed_step, "steps_behind": heal["behind"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--heartbeat-ms", type=int, default=1000)
    args = ap.parse_args()
    os.environ.setdefault("RUST_LOG", "warn")  # the Lighthouse here logs each quorum otherwise
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_data import cpu_flags

    settings = {"2 independent processes (torchft off)": "off", "2 groups, ddp": "ddp",
                "2 groups, diloco (10 inner steps)": "diloco"}
    rows: dict[str, list[float]] = {k: [] for k in settings}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for label, mode in settings.items():
                ms = run_pair(Path(tmp), f"{mode}-{r}", mode, args.steps, args.heartbeat_ms)
                rows[label].append(ms)
                print(f"[torchft_cpu] round {r} {label}: {ms:.1f} ms/step", flush=True)
        recovery = run_recovery(Path(tmp), args.steps, args.heartbeat_ms)
    from importlib.metadata import version

    meta = {"torch": torch.__version__, "torchft": version("torchft"),
            "python": platform.python_version(), "cpu": cpu_flags(), "model": MODEL,
            "command": "OMP_NUM_THREADS=1 python benchmarks/bench_torchft_cpu.py --rounds "
            f"{args.rounds} --steps {args.steps} --heartbeat-ms {args.heartbeat_ms}",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    result = {"meta": meta, "step_ms": rows, "recovery": recovery}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "torchft_cpu.json").write_text(json.dumps(result, indent=1))
    base = statistics.median(rows["2 independent processes (torchft off)"])
    lines = ["# torchft replica groups on CPU", "",
             f"`{meta['command']}`; torch {meta['torch']}, torchft {meta['torchft']}, "
             f"{meta['cpu']}; {meta['date']}; fp32, gloo on loopback.", "",
             f"Reference model {MODEL} (~5M parameters), 8 x 128 tokens per group per step, "
             f"hybrid Muon, {args.steps} steps per run, 2 processes at a time with 1 thread "
             f"each, {args.rounds} interleaved rounds (median of the rounds' median ms/step).",
             "", "| setting | ms/step | vs independent |", "|---|---:|---:|"]
    for label, values in rows.items():
        med = statistics.median(values)
        lines.append(f"| {label} | {med:.1f} | {med / base:.2f}x |")
    rec = recovery
    lines += ["", f"Recovery (ddp, Lighthouse heartbeat timeout {args.heartbeat_ms} ms): group 1 "
              f"SIGKILLed after step 20; the survivor's slowest step after it took "
              f"{rec['survivor_stall_ms']:.0f} ms more than its median "
              f"({rec['survivor_median_step_ms']:.1f} ms). Group 1 restarted from its "
              f"checkpoint {rec['steps_behind']} steps behind and healed at step "
              f"{rec['healed_at_step']}: that step took {rec['heal_step_ms_over_median']:.0f} "
              "ms more than its median (quorum + HTTP transfer of the weights and "
              "optimizer state + load); the groups then ended bitwise equal (tested in "
              "tests/distributed/test_torchft.py)."]
    (RESULTS / "torchft_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
