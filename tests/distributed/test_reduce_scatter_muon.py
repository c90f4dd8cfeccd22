"""``data_parallel.reduce_scatter_muon``: each Muon matrix has one owning rank
(speedtronic/distributed/muon_owners.py). On 2 and 3 gloo processes, against DDP with the
replicated step on the same data: every rank ends on the same weights, those of the replicated
step (bitwise at 2 ranks, fp32 rounding at 3), with the clip on the averaged gradients; each
rank orthogonalizes ~1/W of the matrices; the collectives send DDP's all-reduce bytes plus
padding; the first reduce-scatter starts while backward still runs; a checkpoint holds every
momentum in the plain format and resumes (bitwise at 2 ranks; at 3, plain DDP over gloo is not
bitwise across a rebuilt DDP either: its first-iteration bucket rebuild changes the gradient
sums by ~1e-10). Then the engine under torchrun."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "optim"))
from test_sharded_muon import _counting_newton_schulz  # noqa: E402

from .test_torchrun import _final_weights, _ok, _rows, engine_config, torchrun  # noqa: E402

STEPS = 4
MICRO = 2  # micro-batches per step from step 1 on (step 0 has one: see _first_launch)
VARIANTS = {"plain": ({}, 25.0, True),
            # a 2 KB bucket cap: several buckets per shape, shares rotated across them
            "muon_plus cautious, small buckets": ({"muon_plus": True, "cautious": True},
                                                  0.002, True),
            # gloo's default: an all-reduce of each bucket, this rank's chunk kept
            "plain, gloo all-reduce": ({}, 0.002, False)}


def _model() -> nn.Module:
    """Muon matrices in pairs of each packed shape: (16, 8)^T with (8, 16), 4 x 16^2, (48,
    16)^T with (16, 48); the biases go to AdamW (DDP)."""
    torch.manual_seed(0)
    dims = [8, 16, 16, 48, 16, 16, 16, 16, 8]
    layers: list[nn.Module] = []
    for a, b in zip(dims, dims[1:], strict=False):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def _build(owner: bool, kw: dict, cap: float):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from speedtronic.config import OptimizerConfig
    from speedtronic.distributed.muon_owners import OwnerShardedHybrid, owner_sharded_optimizer
    from speedtronic.optim import build_optimizer

    model = _model()
    opt = build_optimizer(model, OptimizerConfig(name="muon", lr=1e-2, grad_clip=0.5, **kw))
    if owner:
        opt = owner_sharded_optimizer(opt, bucket_cap_mb=cap)
        ignore = OwnerShardedHybrid.ddp_ignored_names(model, opt)
        DDP._set_params_and_buffers_to_ignore_for_model(model, ignore)
    ddp = DDP(model)
    if owner:
        opt.attach(ddp)
    return model, ddp, opt


def _train(model, ddp, opt, owner: bool, steps: range, first_launch: list | None = None):
    rank = dist.get_rank()
    for step in steps:
        k = 1 if step == 0 else MICRO
        for micro in range(k):
            x, y = _batch(step, micro, rank)
            with contextlib.nullcontext() if micro == k - 1 else ddp.no_sync():
                ((ddp(x) - y) ** 2).mean().div(k).backward()
        if owner:
            opt.clip_grad_norm_(0.5)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()


@contextlib.contextmanager
def _recording():
    """Bytes handed to the owner's collectives, and at its first reduce-scatter how many Muon
    gradients backward had not produced yet."""
    sent = {"reduce_scatter": 0, "all_gather": 0, "first_launch_missing": None}
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    watch: list = []

    def reduce_scatter(out, inp, *args, **kw):
        sent["reduce_scatter"] += inp.numel() * inp.element_size()
        if sent["first_launch_missing"] is None and watch:
            sent["first_launch_missing"] = sum(p.grad is None for p in watch[0])
        return rs(out, inp, *args, **kw)

    def all_gather(out, inp, *args, **kw):
        sent["all_gather"] += out.numel() * out.element_size()
        return ag(out, inp, *args, **kw)

    names = [n for n in ("reduce_scatter_tensor", "reduce_scatter_single") if hasattr(dist, n)]
    gathers = [n for n in ("all_gather_into_tensor", "all_gather_single") if hasattr(dist, n)]
    saved = {n: getattr(dist, n) for n in names + gathers}
    for n in names:
        setattr(dist, n, reduce_scatter)
    for n in gathers:
        setattr(dist, n, all_gather)
    try:
        yield sent, watch
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def _cost(shape: tuple[int, ...]) -> float:
    from speedtronic.distributed.muon_owners import _cost as cost

    return cost(shape)


def _run(kw: dict, cap: float) -> dict:
    ref_model, ref_ddp, ref_opt = _build(False, kw, cap)
    _train(ref_model, ref_ddp, ref_opt, False, range(STEPS))
    model, ddp, opt = _build(True, kw, cap)
    with _counting_newton_schulz() as counted, _recording() as (sent, watch):
        watch.append([p for b in opt.buckets for p in b.params])
        _train(model, ddp, opt, True, range(STEPS))
        bytes_sent = dict(sent)
    state = opt.state_dict()  # a collective: every rank's momentum
    # resume: 2 steps, a state dict, a fresh optimizer loads it and takes the other 2
    part_model, part_ddp, part_opt = _build(True, kw, cap)
    _train(part_model, part_ddp, part_opt, True, range(2))
    saved = part_opt.state_dict()
    weights = {k: v.clone() for k, v in part_model.state_dict().items()}
    res_model, res_ddp, res_opt = _build(True, kw, cap)
    res_model.load_state_dict(weights)
    res_opt.load_state_dict(saved)
    _train(res_model, res_ddp, res_opt, True, range(2, STEPS))
    pad = sum(opt.world * b.per - len(b.params) for b in opt.buckets)
    return {"params": [p.detach().clone() for p in model.parameters()],
            "replicated": [p.detach().clone() for p in ref_model.parameters()],
            "resumed": [p.detach().clone() for p in res_model.parameters()],
            "state": state, "replicated_state": ref_opt.state_dict(),
            "kept_momentum": sum("momentum_buffer" in opt.state[p] for p in opt.state),
            "orthogonalized": counted[0], "sent": bytes_sent, "pad_slots": pad,
            "buckets": len(opt.buckets),
            "owned_cost": sum(_cost(b.packed) for b in opt.buckets for _ in b.mine),
            "max_cost": max(_cost(b.packed) for b in opt.buckets),
            "slot_numel": [b.params[0].numel() for b in opt.buckets for _ in range(
                opt.world * b.per - len(b.params))],
            "muon_numel": sum(p.numel() for b in opt.buckets for p in b.params),
            "numel": sum(p.numel() for p in model.parameters())}


def _rank(rank: int, world: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        from speedtronic.distributed import muon_owners

        results = {}
        for name, (kw, cap, reduce_scatter) in VARIANTS.items():
            muon_owners.GLOO_REDUCE_SCATTER = reduce_scatter
            results[name] = _run(kw, cap)
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()
    from speedtronic.distributed.process_group import exit_after_distributed

    exit_after_distributed(0)  # only after success: a gloo rank can abort in finalization


@pytest.mark.skipif(sys.platform == "win32", reason="gloo file rendezvous")
@pytest.mark.parametrize("world", [2, 3])
def test_owned_matrices_step_like_the_replicated_step_with_ddps_bytes(tmp_path, world):
    out = str(tmp_path / "owner")
    mp.spawn(_rank, args=(world, str(tmp_path / "init"), out), nprocs=world, join=True)
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]
    muon_matrices = 8
    for name in VARIANTS:
        results = [r[name] for r in ranks]
        first = results[0]
        for res in results:  # the same weights on every rank, after the gather
            for a, b in zip(res["params"], first["params"], strict=True):
                assert torch.equal(a, b), name
            for a, b in zip(res["resumed"], first["params"], strict=True):
                if world == 2:
                    assert torch.equal(a, b), f"{name}: resume is not bitwise"
                else:  # DDP itself: a rebuilt DDP buckets (so sums) its gradients otherwise
                    torch.testing.assert_close(a, b, rtol=0, atol=2e-6, msg=name)
        for a, b in zip(first["params"], first["replicated"], strict=True):
            if world == 2:  # a / 2 + b / 2 rounds alike in either collective
                assert torch.equal(a, b), name
            else:
                torch.testing.assert_close(a, b, rtol=0, atol=2e-6, msg=name)
        # the checkpoint: every momentum, in the replicated optimizer's format
        state, ref = first["state"], first["replicated_state"]
        assert state["state"].keys() == ref["state"].keys()
        for pid, st in ref["state"].items():
            for key, value in st.items():
                torch.testing.assert_close(state["state"][pid][key], value, rtol=0,
                                           atol=0 if world == 2 else 2e-6)
        # each rank keeps only its own momentum, and orthogonalizes ~1/W of the matrices
        kept = [res["kept_momentum"] for res in results]
        assert sum(kept) == muon_matrices and max(kept) - min(kept) <= first["buckets"]
        counts = [res["orthogonalized"] for res in results]
        assert sum(counts) == muon_matrices * STEPS
        # balanced by Newton-Schulz cost (m^2 n): within one matrix of each other
        costs = [res["owned_cost"] for res in results]
        assert max(costs) - min(costs) <= first["max_cost"], costs
        assert all(c > 0 for c in counts), counts
        # bytes: the Muon values out of DDP's all-reduce and into a reduce-scatter and an
        # all-gather of the same size: DDP's 2 (W-1)/W 4 P plus the padding slots
        f = (world - 1) / world
        for res in results:
            sent = res["sent"]
            if not VARIANTS[name][2]:  # the all-reduce stand-in: no reduce-scatter at all
                assert sent["reduce_scatter"] == 0 and sent["all_gather"] > 0
                continue
            assert sent["reduce_scatter"] == sent["all_gather"]
            padded = res["muon_numel"] + sum(res["slot_numel"])
            assert sent["reduce_scatter"] == STEPS * 4 * padded
            ddp_rest = 2 * f * 4 * (res["numel"] - res["muon_numel"])
            total = f * (sent["reduce_scatter"] + sent["all_gather"]) / STEPS + ddp_rest
            assert total == pytest.approx(2 * f * 4 * (res["numel"] + sum(res["slot_numel"])))
            if world == 2:
                assert res["pad_slots"] == 0  # every packed shape comes in pairs
            # overlap: the first bucket left while backward still had gradients to make
            assert res["sent"]["first_launch_missing"] > 0, name


def test_what_it_does_not_combine_with_is_refused_with_the_reason():
    from speedtronic.config import ConfigError, load_config
    from speedtronic.distributed.muon_owners import check_reduce_scatter_muon

    base = {"data_parallel": {"reduce_scatter_muon": True}, "optimizer": {"name": "muon"}}
    check_reduce_scatter_muon(load_config(base))
    for over, words in [({"data_parallel": {"zero1": True}}, "zero1"),
                        ({"precision": {"mode": "fp16"}}, "overflow"),
                        ({"optimizer": {"cuda_graph": "on"}}, "captured"),
                        ({"optimizer": {"name": "adamw"}}, "optimizer.name: muon")]:
        raw = {k: dict(v) for k, v in base.items()}
        for sec, values in over.items():
            raw.setdefault(sec, {}).update(values)
        with pytest.raises(ConfigError, match=words):
            check_reduce_scatter_muon(load_config(raw))


def test_the_engine_under_torchrun_trains_what_ddp_trains_and_resumes_bitwise(tmp_path):
    """2 ranks: the run matches plain DDP (shard_muon), resumes bitwise from its checkpoint,
    and the checkpoint (the plain format) continues with the option off."""
    import shutil

    plain = engine_config(tmp_path, "plain")
    _ok(torchrun(["-m", "speedtronic", "train", "--config", str(plain)]))
    owned = engine_config(tmp_path, "owned", data_parallel={"reduce_scatter_muon": True})
    proc = torchrun(["-m", "speedtronic", "train", "--config", str(owned)])
    _ok(proc)
    assert "reduce-scatter Muon: rank 0 of 2 owns" in proc.stdout
    runs = tmp_path / "runs"
    wp, wo = _final_weights(runs / "plain"), _final_weights(runs / "owned")
    for k in wp:
        torch.testing.assert_close(wo[k], wp[k], rtol=0, atol=1e-6, msg=k)
    for a, b in zip(_rows(runs / "owned", "train_step"), _rows(runs / "plain", "train_step"),
                    strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)

    part = engine_config(tmp_path, "part", data_parallel={"reduce_scatter_muon": True})
    _ok(torchrun(["-m", "speedtronic", "train", "--config", str(part), "--max-steps", "3"]))
    shutil.copytree(runs / "part" / "checkpoints", runs / "off" / "checkpoints")
    _ok(torchrun(["-m", "speedtronic", "train", "--config", str(part), "--resume"]))
    resumed = _final_weights(runs / "part")
    for k in wo:
        assert torch.equal(resumed[k], wo[k]), k
    off = engine_config(tmp_path, "off")
    _ok(torchrun(["-m", "speedtronic", "train", "--config", str(off), "--resume"]))
    for k in wp:
        torch.testing.assert_close(_final_weights(runs / "off")[k], wp[k], rtol=0, atol=1e-6,
                                   msg=k)


class _SkipOnRank1(nn.Module):
    """Four square Muon matrices; ``skip`` (bias-free: DDP has nothing of it to wait for) is
    used by rank 0 only, so its gradient hook never fires on rank 1."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (nn.Linear(16, 16) for _ in range(3))
        self.skip = nn.Linear(16, 16, bias=False)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if dist.get_rank() == 0:
            h = h + torch.tanh(self.skip(h))
        return self.out(torch.tanh(self.c(torch.tanh(self.b(h)))))


def _uneven_rank(rank: int, world: int, init_file: str, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from speedtronic.config import OptimizerConfig
    from speedtronic.distributed import muon_owners
    from speedtronic.optim import build_optimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    muon_owners.GLOO_REDUCE_SCATTER = True
    try:
        finals = []
        for owner in (False, True):
            model = _SkipOnRank1()
            opt = build_optimizer(model, OptimizerConfig(name="muon", lr=1e-2))
            if owner:  # 2 KB buckets: two squares each, the one holding `skip` due first
                opt = muon_owners.owner_sharded_optimizer(opt, bucket_cap_mb=0.002)
                DDP._set_params_and_buffers_to_ignore_for_model(
                    model, opt.ddp_ignored_names(model, opt))
            ddp = DDP(model, find_unused_parameters=not owner)
            if owner:
                opt.attach(ddp)
            for step in range(3):
                x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step + 10 * rank))
                ddp(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            finals.append([p.detach().clone() for p in model.parameters()])
        torch.save(finals, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()
    from speedtronic.distributed.process_group import exit_after_distributed

    exit_after_distributed(0)  # only after success: a gloo rank can abort in finalization


@pytest.mark.skipif(sys.platform == "win32", reason="gloo file rendezvous")
def test_a_matrix_unused_on_one_rank_delays_its_buckets_instead_of_misordering_them(tmp_path):
    """Buckets start in one plan order on every rank: rank 1, whose hook for `skip` never
    fires, starts nothing until the step, and its collectives still pair with rank 0's (out of
    order, same-sized buckets would have been summed with the wrong partner, silently). The
    result is DDP's with find_unused_parameters (the unused gradient counts as zero)."""
    out = str(tmp_path / "uneven")
    mp.spawn(_uneven_rank, args=(2, str(tmp_path / "init"), out), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}", weights_only=True) for r in range(2)]
    for replicated, owned in zip(ranks[0][0], ranks[0][1], strict=True):
        assert torch.equal(replicated, owned)
    for a, b in zip(ranks[0][1], ranks[1][1], strict=True):
        assert torch.equal(a, b)
