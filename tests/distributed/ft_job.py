"""One torchft replica group for tests/distributed/test_torchft.py: ``speedtronic train`` of the
given config, with the test's fault and pacing hooks.

    python ft_job.py CONFIG [--resume] [--die-at N] [--wait-at N --gate FILE] [--announce FILE]

``--die-at N`` kills this process (SIGKILL: no cleanup, as a lost machine) after step N;
``--wait-at N --gate FILE`` holds this group after step N until FILE exists (the test's
condition for "the restarted group is up", not a timed pause), and ``--reached FILE``
creates FILE when it gets there (the test starts the restarted group only then);
``--announce FILE`` creates FILE once this group's torchft Manager is running (it heartbeats
from then on);
``--wait-start FILE`` holds the first step until FILE exists (both groups in the first quorum);
``--save-weights DIR`` writes this rank's final weights to DIR/rank{RANK}.pt (a torchrun group:
every rank's, not only rank 0's checkpoint).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from speedtronic.train.runtime import train_from_config  # noqa: E402


class Faults:
    name = "faults"

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def on_train_start(self, trainer) -> None:
        if self.args.announce:
            Path(self.args.announce).write_text(str(trainer.step))
        if self.args.wait_start:
            _wait_for(Path(self.args.wait_start))

    def after_optimizer_step(self, trainer, step: int) -> None:
        a = self.args
        if a.die_at is not None and step >= a.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if a.wait_at is not None and step == a.wait_at:
            if a.reached:
                Path(a.reached).write_text(str(step))
            _wait_for(Path(a.gate))


def _wait_for(path: Path) -> None:
    """Hold until ``path`` exists (a condition another process sets, polled)."""
    deadline = time.monotonic() + 120
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} never appeared")
        time.sleep(0.02)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--die-at", type=int)
    p.add_argument("--wait-at", type=int)
    p.add_argument("--gate")
    p.add_argument("--reached")
    p.add_argument("--announce")
    p.add_argument("--wait-start")
    p.add_argument("--save-weights")
    args = p.parse_args()
    weights: dict = {}

    class KeepWeights:  # the trainer's model, read at the end (train_from_config returns no model)
        name = "keep_weights"

        def on_train_end(self, trainer) -> None:
            weights.update({k: v.clone() for k, v in trainer.model.state_dict().items()})

    callbacks = [Faults(args)] + ([KeepWeights()] if args.save_weights else [])
    result = train_from_config(args.config, resume=args.resume, callbacks=callbacks,
                               plot=False)
    if args.save_weights:
        import torch

        out = Path(args.save_weights)
        out.mkdir(parents=True, exist_ok=True)
        torch.save(weights, out / f"rank{os.environ.get('RANK', '0')}.pt")
    print(f"done: steps={result.steps}")
    from speedtronic.distributed.process_group import exit_after_distributed

    exit_after_distributed(0)  # torchft's and torchrun's gloo groups: see its docstring


if __name__ == "__main__":
    main()
