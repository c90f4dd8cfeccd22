"""The engine's LR schedule (speedtronic/train/schedule.py): LambdaLR's values and state dict,
at one device op per tensor lr and step."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from speedtronic.kernels.counting import DispatchCounter
from speedtronic.optim import build_optimizer
from speedtronic.train.schedule import FloatBaseLambdaLR


def _factor(step: int) -> float:
    return min(1.0, (step + 1) / 5) * 0.9 ** step


def _hybrid() -> torch.optim.Optimizer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 16), nn.Linear(16, 16), nn.Linear(16, 10))
    return build_optimizer(model, "muon")


def test_the_schedule_matches_lambdalr_at_one_op_per_tensor_lr():
    """torch's LambdaLR spends 3 device ops per tensor lr and step (mul, fill_, clone)."""
    ours, theirs = _hybrid(), _hybrid()
    assert any(isinstance(g["lr"], torch.Tensor) for g in ours.param_groups)
    assert any(not isinstance(g["lr"], torch.Tensor) for g in ours.param_groups)
    tensor_groups = sum(isinstance(g["lr"], torch.Tensor) for g in ours.param_groups)
    fast, reference = FloatBaseLambdaLR(ours, _factor), torch.optim.lr_scheduler.LambdaLR(
        theirs, _factor)
    for _ in range(12):
        ours.step()
        theirs.step()
        with DispatchCounter() as counter:
            fast.step()
        reference.step()
        assert counter.ops == tensor_groups and counter.host_syncs == 0
        for a, b in zip(ours.param_groups, theirs.param_groups, strict=True):
            assert isinstance(a["lr"], torch.Tensor) == isinstance(b["lr"], torch.Tensor)
            # torch multiplies in fp32; here in float64, rounded once into the fp32 tensor
            assert float(a["lr"]) == pytest.approx(float(b["lr"]), rel=2.5e-7)
        assert fast.get_last_lr() == pytest.approx([float(v) for v in reference.get_last_lr()],
                                                   rel=2.5e-7)


def test_its_state_dict_is_lambdalrs_both_ways():
    """A checkpoint written before (a LambdaLR) resumes here, and the other way round."""
    first, second = _hybrid(), _hybrid()
    reference = torch.optim.lr_scheduler.LambdaLR(first, _factor)
    for _ in range(7):
        first.step()
        reference.step()
    buf = io.BytesIO()
    torch.save(reference.state_dict(), buf)
    buf.seek(0)
    resumed = FloatBaseLambdaLR(second, _factor)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    assert set(resumed.state_dict()) == set(reference.state_dict())
    for _ in range(3):
        first.step()
        second.step()
        reference.step()
        resumed.step()
    assert [float(g["lr"]) for g in second.param_groups] == pytest.approx(
        [float(g["lr"]) for g in first.param_groups], rel=2.5e-7)
    third = _hybrid()
    back = torch.optim.lr_scheduler.LambdaLR(third, _factor)
    back.load_state_dict(resumed.state_dict())
    assert back.last_epoch == resumed.last_epoch == 10
    third.step()
    second.step()
    back.step()
    resumed.step()
    assert [float(g["lr"]) for g in third.param_groups] == pytest.approx(
        [float(g["lr"]) for g in second.param_groups], rel=2.5e-7)
