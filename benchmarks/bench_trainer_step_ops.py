"""Ops and host syncs the trainer adds per optimizer step, counted with DispatchCounter.

A fit of 7 steps minus a fit of 3 (a tiny model, 1 thread, CPU, logging at the end only, no
checkpoints, no eval) leaves exactly 4 steady steps: forward, backward, clipping, optimizer and
the trainer's own per-step work (the non-finite guard's count). Run it with PYTHONPATH pointing
at another checkout to compare side by side.

    python benchmarks/bench_trainer_step_ops.py
    python benchmarks/bench_trainer_step_ops.py --muon          # optimizer.name: muon
    python benchmarks/bench_trainer_step_ops.py --muon --reference   # the bundled model
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _engine_fixtures import FixedData, TinyLM, tiny_config  # noqa: E402

from speedtronic.kernels.counting import DispatchCounter  # noqa: E402
from speedtronic.train.runtime import build_trainer  # noqa: E402


def fit_counts(steps: int, muon: bool, reference: bool) -> tuple[int, int]:
    extra = {"optimizer": {"name": "muon"}} if muon else {}  # Muon's lr is a device tensor
    cfg = tiny_config(Path(tempfile.mkdtemp()), run={"max_steps": steps, "eval_every": 0},
                      logging={"every_steps": 100}, checkpoint={"enabled": False}, **extra)
    trainer = build_trainer(cfg, model=None if reference else TinyLM(), data=FixedData())
    with DispatchCounter() as counter:
        trainer.fit()
    getattr(trainer, "release_run_lock", lambda: None)()
    return counter.ops, counter.host_syncs


def main() -> None:
    torch.set_num_threads(1)
    muon, reference = "--muon" in sys.argv[1:], "--reference" in sys.argv[1:]
    (ops3, syncs3), (ops7, syncs7) = (fit_counts(n, muon, reference) for n in (3, 7))
    package = Path(sys.modules["speedtronic"].__file__).parent
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=package).stdout.strip()
    print(f"speedtronic {commit} (from {package}), torch {torch.__version__}, "
          f"{'reference model' if reference else 'TinyLM'}, "
          f"optimizer {'muon' if muon else 'default'}: per trainer step "
          f"{(ops7 - ops3) / 4:.1f} ops, {(syncs7 - syncs3) / 4:.1f} host syncs")


if __name__ == "__main__":
    main()
