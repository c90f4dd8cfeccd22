"""Helpers shared by tests/ooo/test_scheduler.py and tests/ooo/test_trial.py."""

from __future__ import annotations

import torch

from speedtronic.ooo.scheduler import OOOScheduler


def _lm_batches(n: int, vocab: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (3, 16), generator=g),
             torch.randint(0, vocab, (3, 16), generator=g)) for _ in range(n)]


def _force_cpu_queue(monkeypatch) -> list[OOOScheduler]:
    """The config path falls back on CPU: patch the builder to force the CPU queue; returns the
    list every built scheduler is appended to."""
    import speedtronic.ooo.scheduler as ooo_mod

    real = ooo_mod.build_ooo_scheduler
    built: list[OOOScheduler] = []

    def forced(model, cfg, device):
        sched = real(model, cfg, device, force_cpu=True)
        built.extend([sched] if sched else [])
        return sched

    monkeypatch.setattr(ooo_mod, "build_ooo_scheduler", forced)
    return built


class _FixedLMData:
    def __init__(self, batches: list) -> None:
        self.batches = batches
        self.train = iter(self._cycle())

    def _cycle(self):
        while True:
            yield from self.batches

    def eval_batches(self, n: int) -> list:
        return self.batches[:n]
