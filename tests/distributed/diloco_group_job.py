"""One DiLoCo worker that is a torchrun group (tests/distributed/test_hierarchical.py): trains
from CONFIG with build_trainer, then every rank saves its final weights into OUT_DIR.

    torchrun --nproc-per-node 2 diloco_group_job.py CONFIG OUT_DIR
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch


def main(config: str, out: Path) -> None:
    from speedtronic.train import build_trainer

    torch.set_num_threads(1)
    trainer = build_trainer(config)
    try:
        trainer.fit()
    finally:
        trainer.metrics.close()
        trainer.release_run_lock()
    out.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.clone() for k, v in trainer.model.state_dict().items()},
               out / f"rank{os.environ.get('RANK', '0')}.pt")
    if trainer.dp is not None:
        trainer.dp.close()
        from speedtronic.distributed.process_group import exit_after_distributed

        exit_after_distributed(0)  # a gloo rank can abort in finalization: see its docstring


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
