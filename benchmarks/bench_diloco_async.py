"""Asynchronous DiLoCo on a simulated clock: the real Worker and Master, scheduled events.

Why simulated time: on the 2-core CI box real processes share the cores with the noise, and the
asynchronous schedule's quality depends on *when* a worker installs relative to the master's
listings (the lag, docs/diloco.md#consistent-base); repeating a real-process run gave 1.28-1.71.
Here every actor's timing is drawn from a seeded generator (the "timing seed") and the events
run one at a time in time order, so a row is reproducible and only the timing seed varies it:

* worker i takes ``1/speed_i`` time units per inner step, times a per-round factor
  ``exp(N(0, 0.15))``; a round of H steps at speed 1 is H units;
* the master lists every ``master_ratio * H`` units, from a random phase, and applies what it
  finds (``Master.run_once``: the real validation, outer step and publication);
* a worker polls every ``worker_ratio * H`` units from a random phase (``Worker.poll_now``, what
  its poll thread does) and, at each round boundary, runs its real ``after_optimizer_step``:
  snapshot, delta, upload (completed before the next event), install;
* push-pull: a worker whose boundary finds its delta not yet in a global waits (idle, its clock
  runs) until a master publication holds it, or ``push_pull_timeout * H`` units, then installs.

Uploads land at the boundary's instant; publication lands at the master's. The store is a real
``file://`` store in a temp dir. Eval: cross-entropy (nats/byte) of the final global (after one
last master round drains every delta) on 20 held-out batches.

    OMP_NUM_THREADS=1 python benchmarks/bench_diloco_async.py --rows all --model-seeds 0
    OMP_NUM_THREADS=1 python benchmarks/bench_diloco_async.py --report   (markdown from json)
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import json
import logging
import math
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_diloco import Node, _diloco_setup, evaluate, make_cfg, replace_batch  # noqa: E402

from speedtronic.data import build_data  # noqa: E402
from speedtronic.diloco.node import Worker  # noqa: E402

H = 20
OUTER_LR, OUTER_MOMENTUM = 0.5, 0.5  # the tuned lock-step settings (bench_diloco.md)
BATCH = 8
D_MODEL = 64
JITTER = 0.15
RESULTS = Path(__file__).parent / "results" / "bench_diloco_async"
UNEVEN = (1.0, 1.0, 0.7, 0.35)
OUTER_SWEEP = ((0.4, 0.5), (0.7, 0.5), (0.5, 0.7), (0.6, 0.6))  # (outer lr, outer momentum)
# Larger outer steps, lock-step only: where lock-step DiLoCo itself stops gaining
LOCKSTEP_SWEEP = ((0.8, 0.6), (0.9, 0.5), (1.0, 0.5))
# The shipped defaults' schedule (consistent base, lookahead, rebase, eager Nesterov share 0.5,
# master listing every 1/20 round, worker polls every 1/4): rows vary it with _default(...)
DEFAULT_SCHEDULE = {"carry": True, "master_ratio": 0.05, "worker_ratio": 0.25, "lookahead": 0.25,
                    "rebase": True, "method": "eager_nesterov", "eager_share": 0.5}


def _default(**changes) -> dict:
    return {**DEFAULT_SCHEDULE, **changes}


def bench_cfg(seed: int):
    cfg = make_cfg(batch=BATCH, seed=seed)
    cfg.model.d_model = D_MODEL
    return cfg


def _setup(cfg, tmp: Path, M: int, horizons: list[int],
           outer: tuple[float, float] = (OUTER_LR, OUTER_MOMENTUM), **dist):
    # polls and listings never fire on their own: the event loop calls them
    _, nodes, master, workers = _diloco_setup(
        cfg, tmp, horizons, workers=M, tokens_per_step=BATCH * 64, master_poll_interval=1e6,
        outer_lr=outer[0], outer_momentum=outer[1], reset_inner_optimizer=False,
        unapplied_wait=0.0, max_unapplied=16, **dist)
    return nodes, master, workers


def _final_eval(cfg, master, evals) -> float:
    while master.run_once().found:  # drain: the final global holds every delta
        pass
    torch.manual_seed(0)
    node = Node(cfg, 0, 1, 1)
    with torch.no_grad():
        for k, p in node.model.named_parameters():
            p.copy_(master.weights[k])
    return evaluate(node.model, evals)


def run_async(cfg, evals, *, M: int, steps: int, speeds: tuple[float, ...], carry: bool,
              master_ratio: float, worker_ratio: float, timing_seed: int,
              push_pull: float = 0.0, horizon: float | None = None,
              adaptive: bool = False, lookahead: float = 0.0, rebase: bool = False,
              outer: tuple[float, float] = (OUTER_LR, OUTER_MOMENTUM),
              method: str = "delayed_nesterov", eager_share: float = 1.0) -> dict:
    """One asynchronous run on the simulated clock; ``horizon`` (time units) stops every worker
    there (equal wall-clock), else each trains ``steps`` inner steps (equal tokens)."""
    rng = random.Random(timing_seed)
    limits = ([max(H, int(horizon * s)) for s in speeds] if horizon is not None
              else [steps] * M)
    t_wall = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        nodes, master, workers = _setup(cfg, Path(tmp), M, limits, consistent_base=carry,
                                        adaptive_inner_steps=adaptive,
                                        carry_lookahead=lookahead, outer=tuple(outer),
                                        rebase_within_round=rebase, outer_optimizer=method,
                                        eager_share=eager_share)
        now = [0.0]
        master._clock = lambda: now[0]
        for w in workers:
            w.cfg = replace(w.cfg, push_pull_timeout=0.0)  # push-pull waits are scheduled here
            w._clock = lambda: now[0]  # adaptive H measures simulated step times
        pm, pw = master_ratio * H, worker_ratio * H
        events: list[tuple[float, int, str, int]] = []
        order = 0

        def push(t: float, kind: str, i: int) -> None:
            nonlocal order
            order += 1
            heapq.heappush(events, (t, order, kind, i))

        factor = [math.exp(rng.gauss(0, JITTER)) for _ in range(M)]
        for i in range(M):
            push(factor[i] / speeds[i], "step", i)
            push(rng.random() * pw, "poll", i)
        push(rng.random() * pm, "master", -1)
        blocked: dict[int, float] = {}  # worker -> time it started waiting (push-pull)
        published, installs_wait = 0, 0.0

        def release(i: int, now: float) -> None:
            nonlocal installs_wait
            installs_wait += now - blocked.pop(i)
            Worker._install(workers[i], nodes[i])
            push(now + factor[i] / speeds[i], "step", i)

        while events:
            t, _, kind, i = heapq.heappop(events)
            now[0] = t
            if kind == "master":
                if all(n.step >= lim for n, lim in zip(nodes, limits, strict=True)):
                    continue
                if master.run_once().published:
                    published += 1
                    for j in list(blocked):
                        workers[j].poll_now()
                        if workers[j]._held() >= workers[j]._seq - 1:
                            release(j, t)
                push(t + pm, "master", -1)
            elif kind == "poll":
                if nodes[i].step < limits[i]:
                    workers[i].poll_now()
                    push(t + pw, "poll", i)
            elif kind == "timeout":
                if i in blocked and t - blocked[i] >= push_pull * H - 1e-9:
                    release(i, t)
            else:  # one inner step of worker i
                n, w = nodes[i], workers[i]
                n.train_step()
                if push_pull:
                    w._install = lambda trainer, force=False: None  # deferred below
                w.after_optimizer_step(n, n.step)
                boundary = w._steps_in_round == 0
                if push_pull and not boundary:
                    del w._install
                if boundary:
                    assert w.flush(60)
                    factor[i] = math.exp(rng.gauss(0, JITTER))
                if boundary and push_pull:
                    del w._install
                    if n.step < limits[i]:
                        blocked[i] = t
                        push(t + push_pull * H, "timeout", i)
                        continue
                if n.step < limits[i]:
                    push(t + factor[i] / speeds[i], "step", i)
                elif w._steps_in_round:  # a partial last round is sent too
                    w._snapshot()
                    assert w.flush(60)
        for w in workers:
            w.close()
        lag = [w.m["lag_mean"] for w in workers]
        steps_done = [n.step for n in nodes]
        sim_end = t
        loss = _final_eval(cfg, master, evals)
    return {"eval": loss, "lag_mean": statistics.mean(lag), "versions": published,
            "round_steps": [w.round_steps for w in workers],
            "steps_done": steps_done, "sim_time": sim_end, "push_pull_wait": installs_wait,
            "wall_s": time.perf_counter() - t_wall}


def run_lockstep(cfg, evals, *, M: int, steps: int, rounds: int | None = None,
                 outer: tuple[float, float] = (OUTER_LR, OUTER_MOMENTUM)) -> dict:
    """Lock-step DiLoCo: every worker does H steps, uploads; the master applies all M; every
    worker installs. ``rounds`` stops early (the barrier at an equal wall-clock)."""
    t_wall = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        nodes, master, workers = _setup(cfg, Path(tmp), M, [steps] * M, consistent_base=True,
                                        outer=tuple(outer))
        for _ in range(rounds if rounds is not None else steps // H):
            for w, n in zip(workers, nodes, strict=True):
                for _ in range(H):
                    n.train_step()
                    w.after_optimizer_step(n, n.step)
                assert w.flush(60)
            master.run_once()
            for w, n in zip(workers, nodes, strict=True):
                w.poll_now()
                w.install_now(n)
        for w in workers:
            w.close()
        loss = _final_eval(cfg, master, evals)
    return {"eval": loss, "wall_s": time.perf_counter() - t_wall}


def run_single(cfg, evals, *, batch: int, steps: int) -> dict:
    t_wall = time.perf_counter()
    node = Node(replace_batch(cfg, batch), 0, 1, steps)
    for _ in range(steps):
        node.train_step()
    return {"eval": evaluate(node.model, evals), "wall_s": time.perf_counter() - t_wall}


# ---------------------------------------------------------------------- the plan
def plan(M: int, steps: int, timing_seeds: list[int]) -> dict:
    """Row name -> (kind, kwargs); asynchronous rows get one entry per timing seed."""
    rows: dict[str, tuple[str, dict]] = {
        "one node": ("single", {"batch": BATCH, "steps": steps}),
        f"one node, {M}x batch": ("single", {"batch": BATCH * M, "steps": steps}),
        "lock-step DiLoCo": ("lockstep", {"M": M, "steps": steps}),
    }
    variants = {
        "async as shipped (no carry, polls 1 round)": {"carry": False, "master_ratio": 1.0,
                                                        "worker_ratio": 1.0},
        "consistent base, master poll 0.05 round": {"carry": True, "master_ratio": 0.05,
                                                     "worker_ratio": 0.25},
        "consistent base, master poll 0.25 round": {"carry": True, "master_ratio": 0.25,
                                                     "worker_ratio": 0.25},
        "consistent base, master poll 1 round": {"carry": True, "master_ratio": 1.0,
                                                  "worker_ratio": 0.25},
        "consistent base + lookahead 0.25, master poll 0.05 round": {
            "carry": True, "master_ratio": 0.05, "worker_ratio": 0.25, "lookahead": 0.25},
        "consistent base + lookahead 0.25, master poll 0.25 round": {
            "carry": True, "master_ratio": 0.25, "worker_ratio": 0.25, "lookahead": 0.25},
        "consistent base + lookahead 0.25, master poll 1 round": {
            "carry": True, "master_ratio": 1.0, "worker_ratio": 0.25, "lookahead": 0.25},
        "consistent base + lookahead 0.5, master poll 0.05 round": {
            "carry": True, "master_ratio": 0.05, "worker_ratio": 0.25, "lookahead": 0.5},
        # rebase_within_round (the default since it measured better): newer globals are
        # absorbed mid-round; the rows above ran without it
        "consistent base + lookahead 0.25 + rebase, master poll 0.05 round": {
            "carry": True, "master_ratio": 0.05, "worker_ratio": 0.25, "lookahead": 0.25,
            "rebase": True},
        "consistent base + lookahead 0.25 + rebase, master poll 0.25 round": {
            "carry": True, "master_ratio": 0.25, "worker_ratio": 0.25, "lookahead": 0.25,
            "rebase": True},
        "consistent base + lookahead 0.25 + rebase, master poll 1 round": {
            "carry": True, "master_ratio": 1.0, "worker_ratio": 0.25, "lookahead": 0.25,
            "rebase": True},
        # eager Nesterov (outer.py): each arrival's own Nesterov share applied at once
        **{f"consistent base + lookahead 0.25 + rebase + eager Nesterov, master poll {r} "
           "round": {"carry": True, "master_ratio": r, "worker_ratio": 0.25, "lookahead": 0.25,
                     "rebase": True, "method": "eager_nesterov"} for r in (0.05, 0.25, 1)},
        # half of each delta's momentum share on arrival, half at the round's close
        **{f"consistent base + lookahead 0.25 + rebase + eager Nesterov share 0.5, master poll "
           f"{r} round": _default(master_ratio=r) for r in (0.05, 0.25, 1)},
        # workers polling 5x as often (every 1/20 round): each newer global is absorbed sooner
        "consistent base + lookahead 0.25 + rebase + eager Nesterov share 0.5, master poll 0.05 "
        "round, worker poll 0.05 round": _default(worker_ratio=0.05),
        "consistent base + rebase, master poll 0.05 round": {
            "carry": True, "master_ratio": 0.05, "worker_ratio": 0.25, "rebase": True},
        "no carry, master poll 0.05 round": {"carry": False, "master_ratio": 0.05,
                                              "worker_ratio": 0.25},
        "push-pull (timeout 0.5 round), master poll 0.05": {
            "carry": True, "master_ratio": 0.05, "worker_ratio": 0.25, "push_pull": 0.5},
    }
    # The outer step size lr / (1 - mu) against the 0.5/0.5 above (1.0): lock-step and the
    # default asynchronous schedule, each at the same settings
    for lr, mu in OUTER_SWEEP:
        rows[f"lock-step DiLoCo, outer {lr}/{mu}"] = ("lockstep", {"M": M, "steps": steps,
                                                                  "outer": (lr, mu)})
        variants[f"consistent base + lookahead 0.25, master poll 0.05 round, outer {lr}/{mu}"] = {
            "carry": True, "master_ratio": 0.05, "worker_ratio": 0.25, "lookahead": 0.25,
            "outer": (lr, mu)}
        variants[f"consistent base + lookahead 0.25 + rebase, master poll 0.05 round, outer "
                 f"{lr}/{mu}"] = {"carry": True, "master_ratio": 0.05, "worker_ratio": 0.25,
                                  "lookahead": 0.25, "rebase": True, "outer": (lr, mu)}
        variants[f"consistent base + lookahead 0.25 + rebase + eager Nesterov, master poll "
                 f"0.05 round, outer {lr}/{mu}"] = {
            "carry": True, "master_ratio": 0.05, "worker_ratio": 0.25, "lookahead": 0.25,
            "rebase": True, "outer": (lr, mu), "method": "eager_nesterov"}
        variants[f"consistent base + lookahead 0.25 + rebase + eager Nesterov share 0.5, master "
                 f"poll 0.05 round, outer {lr}/{mu}"] = _default(outer=(lr, mu))
        variants[f"consistent base + lookahead 0.25 + rebase + eager Nesterov share 0.5, master "
                 f"poll 0.05 round, worker poll 0.05 round, outer {lr}/{mu}"] = _default(
            worker_ratio=0.05, outer=(lr, mu))
    for lr, mu in LOCKSTEP_SWEEP:
        rows[f"lock-step DiLoCo, outer {lr}/{mu}"] = ("lockstep", {"M": M, "steps": steps,
                                                                  "outer": (lr, mu)})
    # the carry lookahead under eager Nesterov (0.25 was chosen with delayed Nesterov)
    for la in (0.0, 0.125):
        variants[f"consistent base + rebase + eager Nesterov, lookahead {la:g}, master poll "
                 "0.05 round"] = {"carry": True, "master_ratio": 0.05, "worker_ratio": 0.25,
                                  "lookahead": la, "rebase": True, "method": "eager_nesterov"}
    for name, kw in variants.items():
        for seed in timing_seeds:
            rows[f"{name} | t{seed}"] = ("async", {"M": M, "steps": steps,
                                                   "speeds": (1.0,) * M, "timing_seed": seed,
                                                   **kw})
    return rows


def plan_uneven(steps: int, timing_seeds: list[int]) -> dict:
    M = len(UNEVEN)
    horizon = M * steps / sum(UNEVEN)  # equal total tokens as M workers x steps
    barrier_rounds = int(horizon // (H / min(UNEVEN)))
    rows: dict[str, tuple[str, dict]] = {
        "uneven: lock-step barrier, equal tokens": ("lockstep", {"M": M, "steps": steps}),
        "uneven: lock-step barrier, equal wall-clock": (
            "lockstep", {"M": M, "steps": steps, "rounds": barrier_rounds}),
    }
    for seed in timing_seeds:
        rows[f"uneven: consistent base, master poll 0.05 | t{seed}"] = ("async", {
            "M": M, "steps": steps, "speeds": UNEVEN, "timing_seed": seed, "carry": True,
            "master_ratio": 0.05, "worker_ratio": 0.25, "horizon": horizon})
        rows[f"uneven: consistent base + adaptive H, master poll 0.05 | t{seed}"] = ("async", {
            "M": M, "steps": steps, "speeds": UNEVEN, "timing_seed": seed, "carry": True,
            "master_ratio": 0.05, "worker_ratio": 0.25, "horizon": horizon, "adaptive": True})
        rows[f"uneven: consistent base + adaptive H + lookahead 0.25 | t{seed}"] = ("async", {
            "M": M, "steps": steps, "speeds": UNEVEN, "timing_seed": seed, "carry": True,
            "master_ratio": 0.05, "worker_ratio": 0.25, "horizon": horizon, "adaptive": True,
            "lookahead": 0.25})
        rows[f"uneven: consistent base + adaptive H + lookahead 0.25 + rebase | t{seed}"] = (
            "async", {"M": M, "steps": steps, "speeds": UNEVEN, "timing_seed": seed,
                      "carry": True, "master_ratio": 0.05, "worker_ratio": 0.25,
                      "horizon": horizon, "adaptive": True, "lookahead": 0.25, "rebase": True})
        rows[f"uneven: consistent base + adaptive H + lookahead 0.25 + rebase + eager Nesterov "
             f"| t{seed}"] = ("async", {
                 "M": M, "steps": steps, "speeds": UNEVEN, "timing_seed": seed, "carry": True,
                 "master_ratio": 0.05, "worker_ratio": 0.25, "horizon": horizon,
                 "adaptive": True, "lookahead": 0.25, "rebase": True,
                 "method": "eager_nesterov"})
        rows[f"uneven: consistent base + adaptive H + lookahead 0.25 + rebase + eager Nesterov "
             f"share 0.5 | t{seed}"] = ("async", {
                 "M": M, "steps": steps, "speeds": UNEVEN, "timing_seed": seed,
                 "horizon": horizon, **_default(adaptive=True)})
        rows[f"uneven: async as shipped | t{seed}"] = ("async", {
            "M": M, "steps": steps, "speeds": UNEVEN, "timing_seed": seed, "carry": False,
            "master_ratio": 1.0, "worker_ratio": 1.0, "horizon": horizon})
    return rows


RUNNERS = {"single": run_single, "lockstep": run_lockstep, "async": run_async}


def _meta() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=Path(__file__).parent, check=False).stdout.strip()
    except OSError:
        commit = "?"
    from bench_data import cpu_flags

    return {"torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cpu_flags": cpu_flags(),
            "threads": torch.get_num_threads(),
            "speedtronic_commit": commit, "H": H, "outer": [OUTER_LR, OUTER_MOMENTUM],
            "batch": BATCH, "d_model": D_MODEL, "jitter": JITTER,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--M", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--model-seeds", default="0")
    ap.add_argument("--timing-seeds", default="0,1,2")
    ap.add_argument("--rows", default="all", help="'all', 'uneven', optionally ':' and "
                    "substrings a row name must contain (one of), separated by ';' or, "
                    "when there is no ';', by ','")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--report", action="store_true", help="only rewrite the markdown")
    ap.add_argument("--part", default="0/1", help="k/n: run every n-th row from the k-th, so "
                    "n processes share the plan (they append to one json under a lock)")
    args = ap.parse_args()
    out_json = Path(args.out + ".json")
    done = json.loads(out_json.read_text()) if out_json.exists() else {"meta": {}, "runs": []}
    if args.report:
        Path(args.out + ".md").write_text(report(done))
        return
    torch.set_num_threads(1)
    logging.getLogger("speedtronic").setLevel(logging.ERROR)
    tseeds = [int(s) for s in args.timing_seeds.split(",")]
    for mseed in [int(s) for s in args.model_seeds.split(",")]:
        cfg = bench_cfg(mseed)
        evals = build_data(replace_batch(cfg, 64)).eval_batches(20)
        which, _, only = args.rows.partition(":")  # "uneven:lookahead", "all:master poll"
        if which not in ("all", "uneven"):
            which, only = "all", args.rows
        rows = plan_uneven(args.steps, tseeds) if which == "uneven" else plan(
            args.M, args.steps, tseeds)
        if only:
            wanted = [o for o in only.split(";" if ";" in only else ",") if o]
            rows = {k: v for k, v in rows.items() if any(o in k for o in wanted)}
        k, n = (int(v) for v in args.part.split("/"))
        for index, (name, (kind, kw)) in enumerate(rows.items()):
            if index % n != k:
                continue
            key = {"row": name, "M": kw.get("M", args.M), "steps": args.steps,
                   "model_seed": mseed}
            if any(all(r.get(k) == v for k, v in key.items()) for r in done["runs"]):
                continue
            res = RUNNERS[kind](cfg, evals, **kw)
            row = {**key, **res, "commit": _meta()["speedtronic_commit"]}
            print(f"[bench_diloco_async] {json.dumps(row)}", flush=True)
            out_json.parent.mkdir(parents=True, exist_ok=True)
            with open(str(out_json) + ".lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                done = json.loads(out_json.read_text()) if out_json.exists() else done
                done["meta"] = _meta()
                done["runs"].append(row)
                out_json.write_text(json.dumps(done, indent=1))
    Path(args.out + ".md").write_text(report(done))


def report(done: dict) -> str:
    """Markdown: per (M, steps, model seed), each row's mean / worst / spread over timing seeds."""
    groups: dict[tuple, dict[str, list[dict]]] = {}
    for r in done["runs"]:
        base = r["row"].split(" | ")[0]
        groups.setdefault((r["M"], r["steps"], r["model_seed"]), {}).setdefault(base, []).append(r)
    lines = ["# Asynchronous DiLoCo on a simulated clock", "",
             "Made by `python benchmarks/bench_diloco_async.py` (the rows below came from "
             "several invocations with `--rows`, `--M`, `--steps`, `--model-seeds`, `--part`; "
             "`--report` rewrites this file from the json). Method: the module docstring. "
             "Eval: cross-entropy (nats/byte) of the final global, lower is better; mean, "
             "worst and spread over the timing seeds t0-t2; `lag mean`: own deltas the "
             "installed global lacked, per install (the consistent base carries them). "
             "Outer settings are lr/momentum 0.5/0.5 unless a row says `outer lr/mu`; such a "
             "row's `mean / lock-step` is against lock-step DiLoCo at its settings (a "
             "lock-step row's against lock-step at 0.5/0.5). `mean / DP`: against one node "
             "with an M-fold batch (data parallelism on the same tokens, #31's DP target).", "",
             f"meta: `{json.dumps(done.get('meta', {}))}`", ""]
    for (M, steps, mseed), rows in sorted(groups.items()):
        lines += [f"## M={M}, {steps} steps per worker, model seed {mseed}", "",
                  "| row | eval CE mean | worst | spread (% of mean) | mean / lock-step | "
                  "mean / DP | worst / one node | lag mean | runs |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

        def ref(name: str, rows: dict = rows) -> float | None:
            return statistics.mean(r["eval"] for r in rows[name]) if name in rows else None

        lock, alone = ref("lock-step DiLoCo"), ref("one node")
        data_parallel = ref(f"one node, {M}x batch")
        # baselines first, then the asynchronous rows in the order they were run
        order = sorted(rows, key=lambda n: (not n.startswith(("one node", "lock-step")),
                                            not n.startswith("one node")))
        for name in order:
            rs = rows[name]
            ev = [r["eval"] for r in rs]
            mean = statistics.mean(ev)
            spread = 100 * (max(ev) - min(ev)) / mean if len(ev) > 1 else 0.0
            # own deltas the installed global lacked, mean per install (runs of the shipped
            # mode from before it recorded a lag have 0 there: left out)
            lags = [r["lag_mean"] for r in rs if r.get("lag_mean")]
            lag = f"{statistics.mean(lags):.2f}" if lags else "-"
            # a row at other outer settings is compared with lock-step at the same settings
            outer = name.partition(", outer ")[2]
            # (lock-step itself at other settings: against lock-step at 0.5/0.5)
            same = ref(f"lock-step DiLoCo, outer {outer}") if outer else lock
            if name.startswith("lock-step DiLoCo, outer"):
                same = lock
            vs_lock = f"{mean / same:.3f}" if same and name != "lock-step DiLoCo" else "-"
            vs_alone = f"{max(ev) / alone:.3f}" if alone and name != "one node" else "-"
            vs_dp = (f"{mean / data_parallel:.3f}" if data_parallel and not name.startswith(
                "one node") else "-")
            lines.append(f"| {name} | {mean:.4f} | {max(ev):.4f} | {spread:.1f} | {vs_lock} | "
                         f"{vs_dp} | {vs_alone} | {lag} | {len(rs)} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
