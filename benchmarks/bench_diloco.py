"""The DiLoCo ladder at tiny scale on the bundled real text (Douillard et al., arXiv 2311.08105).

Rows (eval cross-entropy in nats/byte on 20 fixed held-out batches of 64 x 64 bytes):

* DP, 1 worker, batch 16                     (reference: what one node does alone)
* DP, batch 64 = 4 workers all-reducing every step
* DiLoCo M=4, H=20 at the tuned outer settings (OUTER_LR / OUTER_MOMENTUM / RESET_INNER below,
  chosen by ``--sweep``; delayed Nesterov = Nesterov when a round arrives together)
* DiLoCo at the config defaults (outer 0.7/0.9 as in the paper, inner reset on)
* plain averaging (outer SGD lr 1, no momentum = LocalSGD), same inner settings as the tuned row
* DiLoCo with each delta dropped with p = 0.5
* uneven workers (speeds 1, 1, 0.7, 0.35), asynchronous master polling every H/2 time units,
  default outer optimizer (delayed Nesterov) vs plain Nesterov per poll, both at the tuned
  settings, vs the synchronous barrier stopped at the same simulated wall-clock

The DP rows use the same inner settings (AdamW 2e-3, constant lr) as every DiLoCo row.

Length: 2000 inner steps per worker by default (100 rounds). The original recipe's 400 (20 rounds)
is the steepest part of this model's learning curve, where averaging four workers' rounds loses
most: the tuned DiLoCo row is +10.2% over DP 4x batch at 400 steps, +2.9% at 1200 and +1.1% at
2000 with the same settings (results/bench_diloco.md has all three). ``--steps 400``
reproduces the recipe's length. ``--seed``, ``--inner-schedule``, ``--warmup``, ``--inner-lr``
and ``--model diloco_recipe_gpt`` (the note's GPT-2-style toy, diloco_recipe_model.py) apply to
every row; they were tried when looking for the gap's cause and are recorded there too.

The DiLoCo rows run the real code path: :class:`~speedtronic.diloco.node.Worker` callbacks and a
:class:`~speedtronic.diloco.master.Master` over a ``file://`` store in a temp dir, with uploads on
the worker's background thread; the benchmark only decides *when* things happen (sequential,
deterministic schedule) so rows are comparable. ``train_thread_ms/step`` is the time the worker
callback spent on the training thread, next to the measured compute time of a step.

    OMP_NUM_THREADS=1 python benchmarks/bench_diloco.py [--steps 2000] [--out benchmarks/results]
    (about 50 min on one core of the 2-core CI machine: DP 1 worker ~100 s, every other row
    ~400 s, wall_s in results/bench_diloco.json; ``--only a,b`` runs
    some rows, so several processes can share the ladder)
    OMP_NUM_THREADS=1 python benchmarks/bench_diloco.py --sweep 0.5,0.7,1.0x0.5,0.7 --no-reset-inner
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import diloco_recipe_model  # noqa: F401  (registers the "diloco_recipe_gpt" model)
import torch

from speedtronic.config import load_config
from speedtronic.data import build_data
from speedtronic.diloco.master import Master
from speedtronic.diloco.node import Worker
from speedtronic.diloco.store import open_store
from speedtronic.models import build_model
from speedtronic.optim import build_optimizer
from speedtronic.train.runtime import lr_factor

M, H, SPEEDS = 4, 20, (1.0, 1.0, 0.7, 0.35)
# Outer settings of the tuned rows (chosen by the sweep recorded in results/bench_diloco.md).
OUTER_LR, OUTER_MOMENTUM, RESET_INNER = 0.5, 0.5, False
INNER_SCHEDULE, INNER_WARMUP = "constant", 0


def make_cfg(batch: int = 16, schedule: str = "constant", warmup: int = 0, lr: float = 2e-3,
             model: str = "reference_transformer", seed: int = 0):
    """The ladder's config; ``schedule``/``warmup`` set the inner lr schedule of every row (DP
    included), with the cosine horizon = each worker's own number of inner steps."""
    return load_config({
        "run": {"seed": seed, "device": "cpu"},
        "model": {"name": model, "n_layer": 2, "d_model": 128, "n_head": 4, "max_seq_len": 64},
        "data": {"micro_batch_size": batch, "block_size": 64, "stdlib_max_bytes": 4_000_000},
        "optimizer": {"name": "adamw", "lr": lr, "weight_decay": 0.1, "betas": [0.9, 0.95],
                      "grad_clip": 1.0},
        "scheduler": {"name": schedule, "warmup_steps": warmup, "min_lr_ratio": 0.1},
    })


class Node:
    """One simulated machine: model, inner optimizer, its data shard; the Trainer surface."""

    def __init__(self, cfg, rank: int, world: int, total_steps: int) -> None:
        torch.manual_seed(cfg.run.seed)  # same init on every node, as with a shared run.seed
        self.model = build_model(cfg.model)
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.peak_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.total_steps = total_steps  # horizon of the inner cosine
        self.data = iter(build_data(cfg, rank=rank, world=world).train)
        self.config, self.step, self.compute_s = cfg, 0, 0.0

    def train_step(self) -> None:
        t0 = time.perf_counter()
        s = self.config.scheduler
        factor = lr_factor(self.step, s.warmup_steps, self.total_steps, s.name, s.min_lr_ratio)
        for g, peak in zip(self.optimizer.param_groups, self.peak_lrs, strict=True):
            g["lr"] = peak * factor
        x, y = next(self.data)  # (B, T) int64 each
        loss = self.model(x, y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.step += 1
        self.compute_s += time.perf_counter() - t0

    def log_metrics(self, values: dict) -> None:
        pass


def evaluate(model, batches) -> float:
    model.eval()
    with torch.no_grad():
        out = sum(float(model(x, y)) for x, y in batches) / len(batches)
    model.train()
    return out


def param_bytes(model) -> int:
    return sum(p.numel() * 4 for p in model.parameters())


def run_dp(cfg, batch: int, steps: int, evals) -> dict:
    node = Node(replace_batch(cfg, batch), 0, 1, steps)
    t0 = time.perf_counter()
    for _ in range(steps):
        node.train_step()
    nbytes = param_bytes(node.model)
    workers = batch // 16
    return {"eval": evaluate(node.model, evals), "exchanges_per_worker": steps if workers > 1
            else 0, "bytes_per_worker": 2 * steps * nbytes if workers > 1 else 0,
            "wall_s": time.perf_counter() - t0}


def replace_batch(cfg, batch: int):
    cfg = load_config(cfg.to_dict(redact=False))
    cfg.data.micro_batch_size = cfg.data.target_batch_size = batch
    return cfg


def _diloco_setup(cfg, tmp: Path, horizons: list[int], workers: int = M,
                  tokens_per_step: int = 16 * 64, **dist):
    """A store, ``workers`` nodes with their Worker callbacks and a master holding the lease
    (bench_diloco_async.py builds its schedule on the same setup)."""
    # bench_diloco.md's rows (and bench_diloco_async's lock-step rows) ran with delayed Nesterov,
    # the default until eager Nesterov replaced it; a row that wants another method names it
    dist.setdefault("outer_optimizer", "delayed_nesterov")
    d = replace(cfg.distributed, enabled=True, store=f"file://{tmp}", inner_steps=H,
                poll_interval=1e6, lease_ttl=1e7, start_timeout=60, keep_versions=3,
                expected_workers=workers, max_staleness=100, **dist)
    d.validate()
    nodes = [Node(cfg, i, workers, horizons[i]) for i in range(workers)]
    master = Master(open_store(d.store), d, "master",
                    lambda: {k: p.detach().clone() for k, p in nodes[0].model.named_parameters()})
    assert master.acquire_lease(threading.Event(), timeout=10)
    master.load_or_bootstrap()
    callbacks = [Worker(d, node_id=f"w{i}", tokens_per_step=tokens_per_step)
                 for i in range(workers)]
    for w, n in zip(callbacks, nodes, strict=True):
        w.on_train_start(n)
    return d, nodes, master, callbacks


def _finish(nodes, workers, master, evals, wall: float, extra: dict | None = None) -> dict:
    for w in workers:
        w.close()
    final = master.weights
    model = nodes[0].model
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(final[k])
    steps = sum(n.step for n in nodes)
    ms = [w.metrics() for w in workers]
    train_ms = 1e3 * sum(m["train_thread_s"] for m in ms) / steps
    compute_ms = 1e3 * sum(n.compute_s for n in nodes) / steps
    out = {"eval": evaluate(model, evals), "versions": master.pointer.version,
           "exchanges_per_worker": sum(m["deltas_sent"] for m in ms) / len(ms),
           "bytes_per_worker": sum(m["bytes_up"] + m["bytes_down"] for m in ms) / len(ms),
           "train_thread_ms_per_step": train_ms, "compute_ms_per_step": compute_ms,
           "train_thread_frac": train_ms / compute_ms, "wall_s": wall}
    out.update(extra or {})
    return out


def run_diloco_sync(cfg, steps: int, evals, *, drop: float = 0.0, eval_at_round: int = 0,
                    **dist) -> dict:
    """Synchronous schedule: every worker does H steps, uploads, the master steps, all install."""
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        d, nodes, master, workers = _diloco_setup(cfg, Path(tmp), [steps] * M, **dist)
        t0, extra, dropped = time.perf_counter(), {}, 0
        for rnd in range(steps // H):
            for w, n in zip(workers, nodes, strict=True):
                for _ in range(H):
                    n.train_step()
                    w.after_optimizer_step(n, n.step)
                assert w.flush(60)
            if drop:
                for key in [k for k in master.store.list("nodes/") if "/d" in k]:
                    if key not in master.skip and rng.random() < drop:
                        master.store.delete(key)  # lost in transit
                        master.skip.add(key)
                        dropped += 1
            master.run_once()
            for w, n in zip(workers, nodes, strict=True):
                w.poll_now()
                w.install_now(n)
            if eval_at_round and rnd + 1 == eval_at_round:
                extra = {f"eval_at_round_{eval_at_round}": _eval_global(master, nodes, evals)}
        if drop:
            extra["deltas_dropped"] = dropped
        return _finish(nodes, workers, master, evals, time.perf_counter() - t0, extra)


def _eval_global(master, nodes, evals) -> float:
    torch.manual_seed(0)
    model = build_model(nodes[0].config.model)
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(master.weights[k])
    return evaluate(model, evals)


def run_async_uneven(cfg, total_steps: int, evals, **dist) -> dict:
    """Workers at SPEEDS; a step of worker i lasts 1/speed_i time units; the master polls every
    H/2 units and applies whatever arrived; workers adopt a new global at their round end."""
    with tempfile.TemporaryDirectory() as tmp:
        horizon = total_steps / sum(SPEEDS)  # equal total inner steps (= equal compute)
        d, nodes, master, workers = _diloco_setup(
            cfg, Path(tmp), [round(horizon * s) for s in SPEEDS], **dist)
        t0 = time.perf_counter()
        next_step = [1.0 / s for s in SPEEDS]
        next_poll, staleness = H / 2, []
        while True:
            i = min(range(M), key=lambda j: next_step[j])
            if min(next_step[i], next_poll) > horizon:
                break
            if next_poll <= next_step[i]:
                stats = master.run_once()
                if stats.published:
                    staleness.append(stats.mean_staleness)
                next_poll += H / 2
                continue
            n, w = nodes[i], workers[i]
            n.train_step()
            if (n.step % H) == 0:
                w.poll_now()  # what the background poll thread would have staged by now
            w.after_optimizer_step(n, n.step)
            if (n.step % H) == 0:
                assert w.flush(60)  # uploads complete within the step in simulated time
            next_step[i] += 1.0 / SPEEDS[i]
        extra = {"sim_time": horizon, "steps_by_worker": [n.step for n in nodes],
                 "mean_staleness": sum(staleness) / max(1, len(staleness))}
        res = _finish(nodes, workers, master, evals, time.perf_counter() - t0, extra)
        res["finite"] = math.isfinite(res["eval"])
        return res


def corpus_fingerprint(cfg) -> dict:
    """SHA-256 and size of the exact train and eval bytes (the stdlib text differs between
    Python versions, so every result records both)."""
    from speedtronic.data.sources import stdlib_corpus

    c = stdlib_corpus(cfg.data.stdlib_max_bytes, cfg.data.eval_fraction)
    train, held = c.train.tobytes(), c.eval.tobytes()
    return {"source": f"python {sys.version.split()[0]} stdlib *.py, cap "
                      f"{cfg.data.stdlib_max_bytes} bytes", "root": c.root,
            "train_bytes": len(train), "train_sha256": hashlib.sha256(train).hexdigest(),
            "eval_bytes": len(held), "eval_sha256": hashlib.sha256(held).hexdigest(),
            "files": [len(c.train_paths), len(c.eval_paths)]}


def run_sweep(cfg, steps: int, evals, grid: str, out: Path, reset: bool) -> None:
    """Synchronous DiLoCo rows over ``grid`` = "lr,lr,...xmu,mu,..."; appends each point to
    ``out/bench_diloco_sweep.json`` as it finishes and skips points already there (so a stopped
    sweep resumes). Run concurrent sweeps with different ``--out`` folders."""
    lrs, mus = (tuple(float(v) for v in part.split(",")) for part in grid.split("x"))
    path = out / "bench_diloco_sweep.json"
    done = json.loads(path.read_text()) if path.exists() else []
    for lr in lrs:
        for mu in mus:
            key = {"outer_lr": lr, "outer_momentum": mu, "reset_inner_optimizer": reset,
                   "steps_per_worker": steps, "inner_schedule": cfg.scheduler.name,
                   "warmup": cfg.scheduler.warmup_steps, "inner_lr": cfg.optimizer.lr,
                   "seed": cfg.run.seed, "model": cfg.model.name}
            if any(all(r.get(k) == v for k, v in key.items()) for r in done):
                continue
            t0 = time.perf_counter()
            r = run_diloco_sync(cfg, steps, evals, outer_lr=lr, outer_momentum=mu,
                                reset_inner_optimizer=reset)
            row = {**key, "eval": r["eval"], "wall_s": time.perf_counter() - t0}
            print(f"[bench_diloco] sweep {json.dumps(row)}", flush=True)
            done = json.loads(path.read_text()) if path.exists() else []
            done.append(row)
            path.write_text(json.dumps(done, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000,
                    help="inner steps per worker (the research recipe: 400)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--only", default="", help="comma-separated row keys to run")
    ap.add_argument("--outer-lr", type=float, default=OUTER_LR,
                    help="outer lr of the tuned DiLoCo rows")
    ap.add_argument("--outer-momentum", type=float, default=OUTER_MOMENTUM,
                    help="outer momentum of the tuned DiLoCo rows")
    ap.add_argument("--reset-inner", action=argparse.BooleanOptionalAction, default=RESET_INNER,
                    help="reset the inner optimizer after each confirmed upload (tuned rows)")
    ap.add_argument("--inner-schedule", choices=("constant", "cosine"), default=INNER_SCHEDULE,
                    help="inner lr schedule of every row (cosine decays to 0.1x at the end)")
    ap.add_argument("--model", choices=("reference_transformer", "diloco_recipe_gpt"),
                    default="reference_transformer",
                    help="our reference model, or the GPT-2-style toy of diloco_recipe_model.py")
    ap.add_argument("--seed", type=int, default=0, help="model init and data order of every row")
    ap.add_argument("--inner-lr", type=float, default=2e-3, help="inner AdamW lr of every row")
    ap.add_argument("--warmup", type=int, default=INNER_WARMUP, help="inner lr warmup steps")
    ap.add_argument("--sweep", default="", help='only run an outer sweep, e.g. "0.5,0.7x0.5,0.8"')
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = make_cfg(schedule=args.inner_schedule, warmup=args.warmup, lr=args.inner_lr,
                   model=args.model, seed=args.seed)
    evals = build_data(replace_batch(cfg, 64)).eval_batches(20)
    if args.sweep:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        run_sweep(cfg, args.steps, evals, args.sweep, Path(args.out), args.reset_inner)
        return
    rows: dict[str, dict] = {}
    dist = {"outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum,
            "reset_inner_optimizer": args.reset_inner}
    steps = args.steps
    plan = {
        "dp_1_worker": lambda: run_dp(cfg, 16, steps, evals),
        "dp_4x_batch": lambda: run_dp(cfg, 64, steps, evals),
        "diloco_m4_h20": lambda: run_diloco_sync(
            cfg, steps, evals, eval_at_round=_equal_wallclock_rounds(steps), **dist),
        # the config defaults (outer 0.7/0.9 as in the paper, inner reset on), for comparison
        "diloco_config_defaults": lambda: run_diloco_sync(cfg, steps, evals),
        "plain_averaging": lambda: run_diloco_sync(
            cfg, steps, evals, outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0,
            reset_inner_optimizer=args.reset_inner),
        "diloco_half_dropped": lambda: run_diloco_sync(cfg, steps, evals, drop=0.5, **dist),
        "async_uneven_default": lambda: run_async_uneven(cfg, M * steps, evals, **dist),
        "async_uneven_nesterov": lambda: run_async_uneven(cfg, M * steps, evals,
                                                          outer_optimizer="nesterov", **dist),
    }
    only = {k for k in args.only.split(",") if k}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for key, fn in plan.items():
        if only and key not in only:
            continue
        print(f"[bench_diloco] {key} ...", flush=True)
        rows[key] = fn()
        print(f"[bench_diloco] {key}: {json.dumps(rows[key])}", flush=True)
        (out / "bench_diloco.json").write_text(json.dumps(
            {"config": {"M": M, "H": H, "steps_per_worker": args.steps, "speeds": SPEEDS,
                        "tuned": dist, "threads": torch.get_num_threads(),
                        "model": args.model, "inner_lr": args.inner_lr, "seed": args.seed,
                        "inner_schedule": args.inner_schedule, "warmup": args.warmup,
                        "torch": torch.__version__, "python": sys.version.split()[0],
                        "corpus": corpus_fingerprint(cfg)}, "rows": rows}, indent=1))
    print(report(rows, args.steps))


def _equal_wallclock_rounds(steps: int) -> int:
    """Rounds a synchronous barrier (paced by the 0.35x worker) completes in the time the
    asynchronous run takes to spend the same total compute."""
    horizon = M * steps / sum(SPEEDS)
    return int(horizon // (H / min(SPEEDS)))


def report(rows: dict, steps: int) -> str:
    lines = ["| row | eval CE | exchanges/worker | MB/worker | train-thread ms/step "
             "(frac of compute) |", "|---|---|---|---|---|"]
    for key, r in rows.items():
        frac = (f"{r['train_thread_ms_per_step']:.3f} ({100 * r['train_thread_frac']:.2f}%)"
                if "train_thread_frac" in r else "-")
        lines.append(f"| {key} | {r['eval']:.4f} | {r['exchanges_per_worker']:.0f} | "
                     f"{r['bytes_per_worker'] / 1e6:.1f} | {frac} |")
    d = rows.get("diloco_m4_h20")
    if d:
        key = f"eval_at_round_{_equal_wallclock_rounds(steps)}"
        lines.append(f"\nsync barrier at equal wall-clock ({key}): {d.get(key, float('nan')):.4f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
