"""The sharded Muon step (``process_group=``) on 2 and 3 CPU processes over gloo: each rank
orthogonalizes its contiguous ceil(b / W) share of every shape group (counted in matrices and
in FLOPs with torch's FlopCounterMode: the ranks' FLOPs add up to the replicated step's, none
done twice), and the parameters come out bitwise equal on every rank and to the replicated
step, for the plain, Muon+ and cautious steps, and for Muon+ with the cautious mask on the
fused route (muon_fused: the statistics and counts over the gathered results, applied by the
one update call; on CPU through the ops' PyTorch bodies)."""

from __future__ import annotations

import contextlib
import math
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from speedtronic.optim import Muon

STEPS = 3
# odd counts: a rank gets ceil(b / 2) slots, the other the rest (padding in the gather)
SHAPES = [(16, 16)] * 5 + [(48, 16)] * 3 + [(16, 48)] * 2
VARIANTS = {"plain": {}, "muon_plus": {"muon_plus": True}, "cautious": {"cautious": True},
            "fused muon_plus cautious": {"muon_plus": True, "cautious": True, "fused": True}}


@contextlib.contextmanager
def _route(kw: dict):
    """The optimizer's keywords, with the fused route on for a variant that asks for it."""
    from speedtronic.optim import muon_step

    kw = dict(kw)
    fused = kw.pop("fused", False)
    before = muon_step.FUSED_ROUTE_OFF_CUDA["cpu"]
    muon_step.FUSED_ROUTE_OFF_CUDA["cpu"] = fused
    try:
        yield kw
    finally:
        muon_step.FUSED_ROUTE_OFF_CUDA["cpu"] = before


def _params() -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)  # what every rank holds after the all-reduce
    return [torch.randn(s, generator=g) for s in SHAPES]


@contextlib.contextmanager
def _counting_newton_schulz():
    """Count the matrices the step's ``newton_schulz`` calls orthogonalize: yields ``[count]``
    (the lean step and the DTensor step both take the op through ``kernel_or_fallback``)."""
    from speedtronic.kernels import ops

    counted = [0]
    original = ops.kernel_or_fallback

    def counting(name, device, dtypes):
        fn = original(name, device, dtypes)
        if name != "newton_schulz":
            return fn

        def ns(X, *args):
            counted[0] += X.shape[0]
            return fn(X, *args)
        return ns

    ops.kernel_or_fallback = counting
    try:
        yield counted
    finally:
        ops.kernel_or_fallback = original


def _run(kw: dict, group) -> tuple[list[torch.Tensor], int, int]:
    """Final parameters, how many matrices this process orthogonalized, and the FLOPs its
    steps dispatched (torch's FlopCounterMode: the matrix products)."""
    from torch.utils.flop_counter import FlopCounterMode

    with _counting_newton_schulz() as counted, _route(kw) as kw:
        params = _params()
        opt = Muon(params, lr=0.02, weight_decay=0.01, process_group=group, **kw)
        flops = FlopCounterMode(display=False)
        with flops:
            for step in range(STEPS):
                for p, g in zip(params, _grads(step), strict=True):
                    p.grad = g
                opt.step()
    return [p.detach().clone() for p in params], counted[0], flops.get_total_flops()


def _step_flops(shape: tuple[int, int], kw: dict) -> int:
    """FLOPs of one replicated Muon step on one matrix of ``shape`` (the standard iteration
    for squares, the Gram iteration from aspect 2 on: whichever the step picks)."""
    from torch.utils.flop_counter import FlopCounterMode

    p = nn.Parameter(torch.randn(shape))
    p.grad = torch.randn(shape)
    with _route(kw) as kw:
        opt = Muon([p], lr=0.02, weight_decay=0.01, **kw)
        opt.step()  # the first step builds banks and state
        counter = FlopCounterMode(display=False)
        with counter:
            opt.step()
    return counter.get_total_flops()


def _rank(rank: int, world: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        results = {name: _run(kw, dist.group.WORLD) for name, kw in VARIANTS.items()}
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()
    from speedtronic.distributed.process_group import exit_after_distributed

    exit_after_distributed(0)  # only after success: a gloo rank can abort in finalization


def _share(b: int, world: int, rank: int) -> int:
    """Matrices of a group of ``b`` in share ``rank``: contiguous ceil(b / W) slots."""
    per = math.ceil(b / world)
    return max(0, min(per, b - rank * per))


def _rotations(world: int, groups: int) -> list[tuple[int, ...]]:
    import itertools

    return list(itertools.product(range(world), repeat=groups))


@pytest.mark.skipif(sys.platform == "win32", reason="gloo file rendezvous")
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_step_is_bitwise_the_replicated_step_with_1_over_w_of_the_newton_schulz(
        tmp_path, world):
    out = str(tmp_path / "params")
    mp.spawn(_rank, args=(world, str(tmp_path / "init"), out), nprocs=world, join=True)
    ranks = [torch.load(f"{out}.{r}") for r in range(world)]
    per_group = [5, 3 + 2]  # (16, 16) x 5; (16, 48) x 5 with the tall ones transposed
    for name, kw in VARIANTS.items():
        replicated, all_matrices, _ = _run(kw, None)
        assert all_matrices == sum(per_group) * STEPS
        for rank_result in ranks:
            for a, b in zip(rank_result[name][0], replicated, strict=True):
                assert torch.equal(a, b), name
        # FLOPs by formula: each rank one share of each group, nothing orthogonalized twice
        groups = [(5, _step_flops((16, 16), kw)), (5, _step_flops((16, 48), kw))]
        flops = [rank_result[name][2] for rank_result in ranks]
        shares = [[_share(b, world, r) for r in range(world)] for b, _ in groups]
        for r in range(world):  # some rotation of each group's shares
            per_step = flops[r] // STEPS
            assert per_step in {sum(f * shares[i][(r - rot[i]) % world]
                                    for i, (_, f) in enumerate(groups))
                                for rot in _rotations(world, len(groups))}, name
        assert sum(flops) == _run(kw, None)[2] == STEPS * sum(b * f for b, f in groups)
        # 1/W of the work each, within one matrix per step (not one per group: the shares
        # rotate, so both groups' odd matrices do not land on one rank)
        assert max(flops) - min(flops) <= STEPS * max(f for _, f in groups), (name, flops)
        counts = [rank_result[name][1] for rank_result in ranks]
        assert sum(counts) == sum(per_group) * STEPS
        assert max(counts) - min(counts) <= STEPS, counts


def test_a_process_group_without_torch_distributed_is_a_clear_error():
    p = nn.Parameter(torch.randn(4, 4))
    p.grad = torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="init_process_group"):
        Muon([p], process_group=object()).step()


def test_the_sharded_step_and_a_cuda_graph_are_refused_together():
    with pytest.raises(ValueError, match="process_group"):
        Muon([nn.Parameter(torch.randn(4, 4))], cuda_graph=True, process_group=object())


# ---- FSDP2: DTensor parameters (optim/dtensor_step.py) ----------------------------------------

class _Net(nn.Module):
    """Square, tall and wide matrices, one with 5 rows (uneven over 2 ranks), biases and a norm
    for AdamW: what build_optimizer routes."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 12)
        self.hidden = nn.ModuleList([nn.Linear(12, 12, bias=False), nn.Linear(12, 12),
                                     nn.Linear(12, 5), nn.Linear(5, 24, bias=False),
                                     nn.Linear(24, 12)])
        self.norm = nn.LayerNorm(12)
        self.out = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.hidden:
            h = torch.tanh(layer(h))
        return self.out(self.norm(h))


FSDP_VARIANTS = {"plain": {}, "muon_plus": {"muon_plus": True},
                 "cautious": {"cautious": True}, "no_nesterov": {"muon_nesterov": False}}


def _fsdp_train(kw: dict, shard: bool) -> tuple[list[torch.Tensor], dict, int]:
    """Final parameters, momentum info and matrices orthogonalized, after STEPS steps."""
    with _counting_newton_schulz() as counted:
        params, info = _fsdp_steps(kw, shard)
    return params, info, counted[0]


def _fsdp_steps(kw: dict, shard: bool) -> tuple[list[torch.Tensor], dict]:
    from speedtronic.config import OptimizerConfig
    from speedtronic.optim import build_optimizer

    torch.manual_seed(0)
    model = _Net()
    if shard:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    opt = build_optimizer(model, OptimizerConfig(name="muon", muon_weight_decay=0.1, **kw))
    for step in range(STEPS):  # every rank the same batch: FSDP2's averaged grad is the batch's
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    params = [p.full_tensor() if shard else p.detach().clone() for p in model.parameters()]
    buffers = [st["momentum_buffer"] for st in opt.state.values() if "momentum_buffer" in st]
    return [p.detach() for p in params], {"momentum": {type(b).__name__ for b in buffers},
                                          "muon_matrices": len(buffers)}


def _fsdp_rank(rank: int, world: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        torch.save({name: _fsdp_train(kw, True) for name, kw in FSDP_VARIANTS.items()},
                   f"{out}.{rank}")
    finally:
        dist.destroy_process_group()
    from speedtronic.distributed.process_group import exit_after_distributed

    exit_after_distributed(0)  # only after success: a gloo rank can abort in finalization


@pytest.mark.skipif(sys.platform == "win32", reason="gloo file rendezvous")
def test_fsdp2_dtensor_parameters_get_the_single_process_update(tmp_path):
    """fully_shard on 2 ranks: Muon orthogonalizes each whole matrix (gathered) and updates
    each rank's rows; AdamW takes the rest. After 3 steps every rank holds the parameters one
    process computes on the unsharded model, to fp32 rounding, and the momentum stays sharded."""
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch >= 2.4")
    out = str(tmp_path / "fsdp")
    mp.spawn(_fsdp_rank, args=(2, str(tmp_path / "init"), out), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    for name, kw in FSDP_VARIANTS.items():
        expected, _, _ = _fsdp_train(kw, False)
        for result in ranks:
            got, info, _ = result[name]
            assert info["momentum"] == {"DTensor"}, name
            for a, b in zip(got, expected, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=2e-6, msg=name)
        # Newton-Schulz split like the sharded step: the two 12x12 matrices one per rank, the
        # one-matrix shape groups spread over both ranks (not all on rank 0: 6 + 1 before the
        # shares rotated); none orthogonalized twice
        counts = [result[name][2] for result in ranks]
        assert sum(counts) == info["muon_matrices"] * STEPS, counts
        assert max(counts) - min(counts) <= STEPS, counts
    # the options are not silently dropped: their updates differ
    assert not torch.allclose(ranks[0]["plain"][0][1], ranks[0]["muon_plus"][0][1])


def test_a_dtensor_that_is_not_a_row_sharded_matrix_is_refused():
    from speedtronic.optim.muon_groups import _check_dtensor

    with pytest.raises(ValueError, match="layout 'matrix'"):
        _check_dtensor(torch.randn(4, 4), "split")


def _fsdp_resume_rank(rank: int, world: int, init_file: str, out: str) -> None:
    import copy

    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        def make():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 12, bias=False), nn.Linear(12, 5, bias=False))
            fully_shard(model)
            return model, Muon(list(model.parameters()), lr=0.05, weight_decay=0.1)

        def step(model, opt, seed):
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

        a, opt_a = make()
        for seed in range(2):
            step(a, opt_a, seed)
        b, opt_b = make()  # a fresh process's objects, loaded from a's state
        with torch.no_grad():
            for pb, pa in zip(b.parameters(), a.parameters(), strict=True):
                pb.copy_(pa)
        opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
        step(a, opt_a, 5)
        step(b, opt_b, 5)
        torch.save({"equal": [torch.equal(pa.full_tensor(), pb.full_tensor()) for pa, pb in
                              zip(a.parameters(), b.parameters(), strict=True)],
                    "momentum": {type(st["momentum_buffer"]).__name__
                                 for st in opt_b.state.values()}}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()
    from speedtronic.distributed.process_group import exit_after_distributed

    exit_after_distributed(0)  # only after success: a gloo rank can abort in finalization


@pytest.mark.skipif(sys.platform == "win32", reason="gloo file rendezvous")
def test_fsdp2_optimizer_state_round_trips_and_resumes_bitwise(tmp_path):
    out = str(tmp_path / "resume")
    mp.spawn(_fsdp_resume_rank, args=(2, str(tmp_path / "init"), out), nprocs=2, join=True)
    for rank in range(2):
        result = torch.load(f"{out}.{rank}", weights_only=False)
        assert result["momentum"] == {"DTensor"}
        assert all(result["equal"]), result


def test_one_matrix_groups_alternate_ranks_and_every_rank_agrees_on_the_plan():
    """Four one-matrix shape groups on 2 ranks: two each (the contiguous split gave rank 0 all
    four); every rank computes the same rotations, so the gathered order agrees."""
    from speedtronic.optim.sharded import ShardSpec

    def spec(rank: int, world: int) -> ShardSpec:
        s = ShardSpec.__new__(ShardSpec)
        s.world, s.rank, s.loads = world, rank, [0.0] * world
        return s

    groups = [(1, 64.0**3), (1, 64.0**3), (1, 32.0**3), (1, 32.0**3), (3, 16.0**3)]
    plans, mine = [], []
    for rank in range(2):
        s = spec(rank, 2)
        s.begin_step()
        rotations = [s.place(count, cost) for count, cost in groups]
        plans.append(rotations)
        mine.append([s.slots(count, rot)[1] - s.slots(count, rot)[0]
                     for (count, _), rot in zip(groups, rotations, strict=True)])
    assert plans[0] == plans[1]
    assert [a + b for a, b in zip(*mine, strict=True)] == [c for c, _ in groups]  # all covered
    assert mine[0][:4].count(1) == 2 and mine[1][:4].count(1) == 2
