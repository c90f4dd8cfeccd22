"""Why ``ooo_backprop`` is refused under torchrun: what it would do under DDP, shown.

DDP's reducer marks a parameter ready when its AccumulateGrad hook fires and, in its final
callback, writes the reduced bucket into ``.grad``. The out-of-order scheduler folds the Linear
weight (and bias) gradients in *after* the backward, outside the hooks DDP watches: the reducer
has finished by then: the gradients it leaves are zeros, and the deferred ones are lost.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from speedtronic.ooo.scheduler import OOOScheduler, find_deferrable_linears


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_ooo_backprop_under_ddp_would_lose_every_deferred_gradient(one_rank_group):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 4))
    x = torch.randn(8, 16)
    ref = copy.deepcopy(model)
    ref(x).square().sum().backward()
    expected = _grads(ref)

    alone = copy.deepcopy(model)  # the scheduler itself is exact without DDP
    sched = OOOScheduler(alone, "cpu")
    alone(x).square().sum().backward()
    sched.flush()
    assert all(torch.equal(expected[n], g) for n, g in _grads(alone).items())

    ddp = DDP(copy.deepcopy(model))
    sched = OOOScheduler(ddp.module, "cpu")
    assert len(find_deferrable_linears(ddp.module)) == 3
    ddp(x).square().sum().backward()
    sched.flush()
    assert sched.deferred_total > 0
    got = _grads(ddp.module)
    # every Linear was deferred: every gradient DDP leaves is zero, the real ones are not
    assert all(float(g.abs().max()) == 0.0 for g in got.values()), got
    assert all(float(g.abs().max()) > 0.0 for g in expected.values())
