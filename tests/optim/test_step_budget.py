"""The lean Muon step, counted on CPU: a launch budget set from the design, zero host syncs,
capture-safe hyper-parameters, one compiled graph under an LR schedule, the fp16 guard.

The shape sets are the GPT-2-small and Llama-1B-class sets scaled down 32x / 64x in every
dimension: same matrix counts and aspects, so the same grouping (checked below against the
grouping rule applied to the full-size shapes) and the same op sequence (no op count depends
on a size once the workspace budget gives one chunk per group)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo import utils as dynamo_utils

from speedtronic.kernels.counting import DispatchCounter, foreach_launches
from speedtronic.optim import Muon
from speedtronic.optim.muon_step import workspace_bytes_per_matrix

GPT2_SMALL = [(768, 768)] * 48 + [(3072, 768)] * 12 + [(768, 3072)] * 12
LLAMA_1B = [(2048, 2048)] * 32 + [(512, 2048)] * 32 + [(8192, 2048)] * 32 + [(2048, 8192)] * 16
SETS = {"gpt2_small": (GPT2_SMALL, 32), "llama_1b": (LLAMA_1B, 64)}
NS_STEPS = 5

# ---- the budget, from the design (muon_step's docstring), CPU fp32 path -------------------
# per shape group: gather 1 (+2 for a transposed part), momentum lerp 1, Nesterov lerp 1,
# norm + clamp + divide 3, update 2 per part (scale into the param dtype, _foreach_add_);
# Newton-Schulz at most 7 ops per iteration (Gram: poly 3, a*I 1, Q 1, R update 2) + 3
# (first Gram product, restart, last product); per param group 2 (1 - lr*wd, decay).
# The 16-bit guard, once for all K groups of a step: a sum and a masked_fill_ per group, plus
# x * 0, isnan and the hit-count add_ for all of them.
NS_OPS_PER_ITERATION = 7
NS_OPS_FIXED = 3
PER_PARAM_GROUP = 2
GUARD_PER_GROUP, GUARD_FIXED = 2, 3


def _expected_groups(shapes: list[tuple[int, int]]) -> dict[tuple[int, int], tuple[int, int]]:
    """The grouping rule on full-size shapes: wide shape -> (matrices, parts)."""
    out: dict[tuple[int, int], list] = {}
    for r, c in shapes:
        key = (min(r, c), max(r, c))
        out.setdefault(key, set()).add(r > c)
    counts = {k: sum(1 for r, c in shapes if (min(r, c), max(r, c)) == k) for k in out}
    return {k: (counts[k], len(v)) for k, v in out.items()}


def design_budget(shapes: list[tuple[int, int]], fp16: bool = False) -> int:
    total = PER_PARAM_GROUP + (GUARD_FIXED if fp16 else 0)
    for (_, parts) in _expected_groups(shapes).values():
        gather = 1 + (2 if parts > 1 else 0)
        total += gather + 2 + 3 + 2 * parts
        total += NS_OPS_PER_ITERATION * NS_STEPS + NS_OPS_FIXED
        total += GUARD_PER_GROUP if fp16 else 0
    return total


def _opt(shapes, scale, **kw):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(r // scale, c // scale)) for r, c in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = Muon(params, lr=0.02, weight_decay=0.01, **kw)
    opt.step()  # builds the plan and its banks; later steps are the steady state
    return opt, params


def _count(opt) -> DispatchCounter:
    with DispatchCounter() as c:
        opt.step()
    return c


@pytest.mark.parametrize("name", SETS)
def test_stand_ins_group_like_the_full_size_set(name):
    shapes, scale = SETS[name]
    opt, _ = _opt(shapes, scale)
    got = {(g.shape[0] * scale, g.shape[1] * scale): (g.momentum.shape[0], len(g.parts))
           for g in opt.muon_cache.groups}
    assert got == _expected_groups(shapes)
    if name == "gpt2_small":  # the figure: two groups, 48 x 768^2 and 24 x 768x3072
        assert got == {(768, 768): (48, 1), (768, 3072): (24, 2)}


@pytest.mark.parametrize("name,limit", [("gpt2_small", 120), ("llama_1b", 200)])
def test_one_step_stays_within_the_design_budget_with_no_host_sync(name, limit):
    shapes, scale = SETS[name]
    c = _count(_opt(shapes, scale)[0])
    assert c.host_syncs == 0, c.sync_names
    budget = design_budget(shapes)
    assert budget <= limit  # the target holds for the design itself
    assert c.ops <= budget, (c.ops, budget, c.by_name.most_common())
    # and it is O(groups), not O(matrices): far below one op per matrix per NS iteration
    assert c.ops < len(shapes) * NS_STEPS


@pytest.mark.parametrize("kw", [{"ns_dtype": "fp16"}, {"muon_plus": True}, {"cautious": True},
                                {"cautious": True, "cautious_rescale": False},
                                {"nesterov": False}, {"ns_dtype": "bf16", "muon_plus": True}])
def test_every_option_is_free_of_host_syncs(kw):
    c = _count(_opt(GPT2_SMALL, 32, **kw)[0])
    assert c.host_syncs == 0, c.sync_names
    assert c.ops <= design_budget(GPT2_SMALL, fp16=True) + 40, c.by_name.most_common()


def test_the_counter_sees_host_syncs_and_ignores_views():
    x = torch.randn(4, 4)
    with DispatchCounter() as c:
        y = x.view(2, 8).t()
        bool((y > 0).any())
        float(y.sum())
    assert c.host_syncs == 2
    assert c.ops == 3  # gt, any, sum: the transpose and view launch nothing


def test_foreach_launch_estimate_packs_chunks_like_multi_tensor_apply():
    assert foreach_launches([10] * 110, depth=1) == 1
    assert foreach_launches([10] * 111, depth=1) == 2
    assert foreach_launches([65536 * 320], depth=1) == 1
    assert foreach_launches([65536 * 320 + 1], depth=1) == 2
    assert foreach_launches([10] * 64, depth=2) == 1 and foreach_launches([10] * 65, depth=2) == 2


def test_a_step_before_the_muon_step_is_the_same_op_stream_and_the_same_buffers():
    """What a CUDA graph needs: a later step dispatches exactly the ops of the one before it,
    in order, and the persistent banks and workspaces stay where they are."""
    opt, params = _opt(GPT2_SMALL, 32, ns_dtype="fp16")
    ptrs = [(g.momentum.data_ptr(), g.grads.data_ptr(), g.work.data_ptr())
            for g in opt.muon_cache.groups]
    streams = []
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)  # new gradient tensors, as zero_grad(set_to_none)
        with DispatchCounter() as c:
            opt.step()
        streams.append(list(c.by_name.items()))
    assert streams[0] == streams[1]
    assert ptrs == [(g.momentum.data_ptr(), g.grads.data_ptr(), g.work.data_ptr())
                    for g in opt.muon_cache.groups]


def test_hyper_parameters_are_device_tensors_that_schedules_fill_in_place():
    opt, params = _opt([(16, 16), (16, 32)], 1)
    group = opt.param_groups[0]
    lr = group["lr"]
    assert all(isinstance(group[k], torch.Tensor) and group[k].dim() == 0
               for k in ("lr", "weight_decay", "momentum"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    before = [p.detach().clone() for p in params]
    opt.step()
    sched.step()
    assert group["lr"] is lr and float(lr) == pytest.approx(0.01)  # filled, not replaced
    # a float written by user code is taken (converted once more) at the next step
    group["lr"] = 0.0
    group["weight_decay"] = 0.0
    after = [p.detach().clone() for p in params]
    opt.step()
    assert all(torch.equal(a, p) for a, p in zip(after, params, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_state_dict_round_trip_rebuilds_the_banks_from_the_loaded_momentum():
    opt, params = _opt([(16, 16)] * 3 + [(32, 16)], 1)
    saved = opt.state_dict()
    twin = Muon([nn.Parameter(p.detach().clone()) for p in params], lr=0.02,
                weight_decay=0.01)
    twin.load_state_dict(saved)
    for a, b in zip(params, twin.param_groups[0]["params"], strict=True):
        b.grad = a.grad
    opt.step()
    twin.step()
    for a, b in zip(params, twin.param_groups[0]["params"], strict=True):
        torch.testing.assert_close(a, b)
    for p, q in zip(params, twin.param_groups[0]["params"], strict=True):
        torch.testing.assert_close(opt.state[p]["momentum_buffer"],
                                   twin.state[q]["momentum_buffer"])


def _compiled_graphs(opt, schedule, fullgraph: bool = True, steps: int = 10) -> tuple[int, dict]:
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    # the class's step, not opt.step: an LR scheduler wraps the instance's step in a counter
    # that dynamo does not trace (torch's own recipe then drops fullgraph)
    step = torch.compile(lambda: type(opt).step(opt), fullgraph=fullgraph, backend="aot_eager")
    for i in range(steps):
        step()
        schedule(opt, i)
    return (dynamo_utils.counters["stats"]["unique_graphs"],
            dict(dynamo_utils.counters.get("recompiles", {})))


@pytest.mark.parametrize("lr", [0.02, torch.tensor(0.02)], ids=["float", "tensor"])
def test_an_lr_schedule_never_recompiles_the_compiled_step(lr):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(8, 8)) for _ in range(3)] + [nn.Parameter(
        torch.randn(16, 8))]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = Muon(params, lr=lr)
    opt.step()  # the eager warm-up step: builds the plan and its banks outside any graph
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    graphs, recompiles = _compiled_graphs(opt, lambda o, i: sched.step())
    assert graphs == 1 and not recompiles, (graphs, recompiles)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.02 / 11)
    # torch.optim.Muon, side by side: a float lr written each step recompiles it (up to the
    # recompile limit, so not under fullgraph)
    ref = torch.optim.Muon([nn.Parameter(p.detach().clone()) for p in params], lr=0.02)
    for p, q in zip(params, ref.param_groups[0]["params"], strict=True):
        q.grad = p.grad

    def floats(o, i):
        o.param_groups[0]["lr"] = 0.02 / (1 + i)

    ref.step()
    torch_graphs, _ = _compiled_graphs(ref, floats, fullgraph=False, steps=3)
    assert torch_graphs > graphs


def test_a_non_finite_fp16_result_skips_that_update_without_a_sync():
    torch.manual_seed(0)
    bad = nn.Parameter(torch.randn(8, 8))
    good = nn.Parameter(torch.randn(8, 16))
    opt = Muon([bad, good], lr=0.1, weight_decay=0.0, ns_dtype="fp16")
    bad.grad = torch.full_like(bad, float("inf"))
    good.grad = torch.randn_like(good)
    before_bad, before_good = bad.detach().clone(), good.detach().clone()
    with DispatchCounter() as c:
        opt.step()
    assert c.host_syncs == 0
    assert torch.equal(bad, before_bad)             # skipped (the guard's policy)
    assert not torch.equal(good, before_good)       # the other shape group is untouched by it
    assert opt.nonfinite_counts() == [((8, 8), 1)]  # read where the trainer reads (a sync)


@pytest.mark.parametrize("chunked", [False, True])
def test_the_guard_skips_only_the_non_finite_matrix_and_counts_it_per_group(chunked):
    # One 16-bit NS batch per group (the guard runs once over all groups) or, with a budget of
    # 2 matrices, chunk by chunk: either way only the matrix with the inf is skipped (a whole
    # chunk once was, for good: the inf stayed in the momentum).
    torch.manual_seed(0)
    square = [nn.Parameter(torch.randn(8, 8)) for _ in range(4)]
    wide = nn.Parameter(torch.randn(8, 16))
    budget = 2 * workspace_bytes_per_matrix(8, 8, torch.float16) if chunked else None
    opt = Muon([*square, wide], lr=0.1, weight_decay=0.0, ns_dtype="fp16",
               workspace_budget=budget)
    for p in (*square, wide):
        p.grad = torch.randn_like(p)
    opt.step()
    square[3].grad = torch.full_like(square[3], float("inf"))
    for _ in range(2):
        before = [p.detach().clone() for p in (*square, wide)]
        with DispatchCounter() as c:
            opt.step()
        assert c.host_syncs == 0
        moved = [not torch.equal(p, b) for p, b in zip((*square, wide), before, strict=True)]
        assert moved == [True, True, True, False, True]
        assert all(torch.isfinite(p).all() for p in (*square, wide))
    assert opt.nonfinite_counts() == [((8, 8), 2)]  # two skipped updates of square[3]
    # what the trainer reads at log steps, with its other device values
    from speedtronic.train.step_log import guard_counters

    assert [(shape, int(t)) for shape, t in guard_counters(opt)] == [((8, 8), 2), ((8, 16), 0)]


@pytest.mark.parametrize("fused", [False, True])
def test_a_matrix_skipped_by_the_guard_trains_again_once_its_momentum_restarts(
        fused, monkeypatch):
    """The bad gradient stays in the skipped matrix's momentum (skipped again at its next,
    finite gradient) until restart_nonfinite_momentum, called where the counters are read;
    then its next step is Muon's first step on that gradient. The others never noticed."""
    from speedtronic.optim import muon_step
    from speedtronic.train.step_log import StepLog

    monkeypatch.setitem(muon_step.FUSED_ROUTE_OFF_CUDA, "cpu", fused)
    torch.manual_seed(0)
    hit, other = nn.Parameter(torch.randn(8, 16)), nn.Parameter(torch.randn(8, 16))
    tall = nn.Parameter(torch.randn(16, 8))  # joins the group transposed
    opt = Muon([hit, other, tall], lr=0.1, weight_decay=0.0, ns_dtype="fp16")
    hit.grad = torch.full_like(hit, float("nan"))
    other.grad, tall.grad = torch.randn_like(other), torch.randn_like(tall)
    held = hit.detach().clone()
    opt.step()
    hit.grad = torch.randn_like(hit)
    moved = [p.detach().clone() for p in (other, tall)]
    opt.step()
    assert torch.equal(hit, held) and opt.nonfinite_counts() == [((8, 16), 2)]
    assert all(not torch.equal(p, b) for p, b in zip((other, tall), moved, strict=True))
    # what the trainer does at a log step whose counters grew
    log = SimpleNamespace(_skipped_seen={}, step=2, optimizer=opt)
    StepLog._report_skipped_updates(log, opt.nonfinite_counts())
    assert opt.restart_nonfinite_momentum() == 0  # done: nothing left to restart
    fresh = nn.Parameter(hit.detach().clone())
    ref = Muon([fresh], lr=0.1, weight_decay=0.0, ns_dtype="fp16")
    g = torch.randn_like(hit)
    hit.grad, fresh.grad = g, g.clone()
    opt.step()
    ref.step()
    torch.testing.assert_close(hit, fresh)  # as if its first step
    assert opt.nonfinite_counts() == [((8, 16), 2)]


def test_workspace_bytes_follow_the_budget():
    per = workspace_bytes_per_matrix(16, 16, torch.float32)
    opt, _ = _opt([(16, 16)] * 10, 1, workspace_budget=4 * per)
    (group,) = opt.muon_cache.groups
    assert group.chunk == 4 and group.grads.shape[0] == 4


def test_cuda_graph_off_cpu_says_why_once_and_matches_eager(caplog):
    import logging

    ref, ref_params = _opt([(16, 16)] * 2 + [(32, 16)], 1)
    with caplog.at_level(logging.INFO, logger="speedtronic.optim"):
        opt, params = _opt([(16, 16)] * 2 + [(32, 16)], 1, cuda_graph=True)
        for _ in range(3):
            ref.step()
            opt.step()
    lines = [r.getMessage() for r in caplog.records if "cuda graph" in r.getMessage()]
    assert lines == ["muon cuda graph: off (no CUDA device)"]
    for a, b in zip(ref_params, params, strict=True):
        assert torch.equal(a, b)


def test_the_cuda_graph_key_changes_with_what_invalidates_a_capture():
    from speedtronic.optim.cuda_graph import _key

    p, q = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    group = {"params": [p, q], "lr": torch.tensor(0.1), "weight_decay": torch.tensor(0.0),
             "momentum": torch.tensor(0.9), "ns_steps": 5}
    base = _key([group], [p, q])
    group["lr"].fill_(0.05)                      # a scheduler: same tensor, same graph
    assert _key([group], [p, q]) == base
    assert _key([group], [p]) != base            # a parameter without a gradient
    assert _key([{**group, "ns_steps": 4}], [p, q]) != base
    assert _key([{**group, "lr": torch.tensor(0.05)}], [p, q]) != base  # a new lr tensor


# The CUDA-path estimate (ns_dtype fp16 takes the 16-bit branches the GPU takes), with the
# extension's fused passes (muon_fused.fused_step): per table of up to 128 matrices (every
# group's matrices together) the pre-pass 2 launches (momentum + sums of squares, then scale +
# cast) and the update 1 (decay, guard skip and update); the guard a sum per group + 3.
# Newton-Schulz: standard (square groups) X X^T 1 + (a I + b A + c A^2) 2 (an add writing
# A + (a/b) I, then an in-place GEMM with beta = b: newton_schulz_gemm._fold_poly) + P X 1 = 4 per
# iteration; Gram (rectangular) at most 5 per iteration (the polynomial 2, P Q 1, then R P and
# P (R P), or at a restart Q X and X X^T) + 3. GPT-2 small: 3 + 3 + (1 + 20) + (1 + 25 + 3) = 56,
# within the 60. Without the extension the batched torch passes run: 79 (bench rows).
STANDARD_NS_PER_ITERATION, GRAM_NS_PER_ITERATION = 4, 5
LEAN_MATS = 128


def design_cuda_budget(shapes: list[tuple[int, int]]) -> int:
    total = 3 * -(-len(shapes) // LEAN_MATS) + GUARD_FIXED
    for (m, n), _ in _expected_groups(shapes).items():
        total += 1  # the guard's sum
        total += (STANDARD_NS_PER_ITERATION * NS_STEPS if m == n
                  else GRAM_NS_PER_ITERATION * NS_STEPS + NS_OPS_FIXED)
    return total


def test_the_cuda_design_budget_meets_the_launch_target():
    assert design_cuda_budget(GPT2_SMALL) <= 60


@pytest.mark.parametrize("name", SETS)
def test_the_cuda_path_estimate_stays_within_its_design_budget(name):
    """Counted on meta tensors: what the CUDA path dispatches (CPU-only branches, such as the
    blocked symmetric products and the in-place 16-bit divide, do not apply). The scaled
    stand-ins keep one chunk per group, as an H200's budget gives both full-size sets."""
    shapes, scale = SETS[name]
    c = _meta_step_count([(r // scale, c // scale) for r, c in shapes])
    assert c.host_syncs == 0
    assert c.launches <= design_cuda_budget(shapes), (c.launches, c.by_name.most_common())


def test_cuda_graph_auto_keeps_the_graph_only_when_its_median_is_faster():
    from speedtronic.optim.cuda_graph import auto_keeps_graph

    assert auto_keeps_graph([2.0, 2.1, 9.0], [1.0, 1.2, 1.1])
    assert not auto_keeps_graph([1.0, 1.1, 1.2], [1.3, 0.5, 1.4])  # one fast replay is no median
    assert not auto_keeps_graph([], [1.0]) and not auto_keeps_graph([1.0], [])


def test_engine_cuda_graph_setting_reaches_the_optimizer_and_is_refused_without_muon(caplog):
    from speedtronic.config import ConfigError, load_config
    from speedtronic.optim import build_optimizer

    cfg = load_config({"optimizer": {"name": "muon", "cuda_graph": "auto"}})
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.Linear(16, 4))
    opt = build_optimizer(model, cfg.optimizer)
    assert opt.cuda_graph == "auto"
    model(torch.randn(3, 16)).sum().backward()
    with caplog.at_level("INFO", logger="speedtronic.optim"):
        opt.step()
    assert "muon cuda graph: off (no CUDA device)" in caplog.text
    assert build_optimizer(model, load_config({"optimizer": {"name": "muon"}}).optimizer
                           ).cuda_graph is False
    with pytest.raises(ConfigError, match="optimizer.cuda_graph"):
        load_config({"optimizer": {"name": "adamw", "cuda_graph": "on"}})
    with pytest.raises(ConfigError, match="optimizer.cuda_graph"):
        load_config({"optimizer": {"name": "muon", "cuda_graph": "yes"}})
    with pytest.raises(ValueError, match="cuda_graph"):
        Muon([nn.Parameter(torch.randn(4, 4))], cuda_graph="sometimes")


def _meta_step_count(shapes, **kw) -> DispatchCounter:
    params = [nn.Parameter(torch.empty(r, c, device="meta")) for r, c in shapes]
    for p in params:
        p.grad = torch.empty_like(p)
    opt = Muon(params, lr=0.02, weight_decay=0.01, ns_dtype="fp16", **kw)
    opt.step()
    return _count(opt)


# On the CUDA path (the fused passes) both options ride on the one update call, which applies
# Muon+'s row/column scales and the cautious mask as it writes. What each adds for every matrix
# of the step, per table of 128 matrices: Muon+ one muon_lean_plus_stats_ op (4 launches: row
# partials, rows, column partials, columns); the rescaled cautious mask one
# muon_lean_cautious_count_ op (2: zero the counts, count); the plain mask nothing. Each within
# the issue's +10% ops.
@pytest.mark.parametrize("kw, extra_ops, extra_launches", [
    ({"muon_plus": True}, 1, 4),
    ({"cautious": True}, 1, 2),
    ({"cautious": True, "cautious_rescale": False}, 0, 0),
    ({"cautious": True, "muon_plus": True}, 2, 6),
])
def test_muon_plus_and_cautious_are_fused_into_the_update_on_the_cuda_path(kw, extra_ops,
                                                                           extra_launches):
    base = _meta_step_count(GPT2_SMALL)
    c = _meta_step_count(GPT2_SMALL, **kw)
    assert c.host_syncs == 0
    assert c.launches - base.launches <= extra_launches, (c.launches, base.launches)
    assert c.ops - base.ops <= extra_ops, c.by_name.most_common()
    assert not any(k in c.by_name for k in ("speedtronic::muon_plus_normalize",
                                            "speedtronic::cautious_mask_")), c.by_name
    if len(kw) == 1 or "cautious_rescale" in kw:  # each option alone: the target
        assert c.ops - base.ops <= 0.10 * base.ops, (c.ops, base.ops)


def test_the_fused_cautious_branch_matches_the_batched_cpu_mask():
    """The CUDA branch hands each matrix to ``cautious_mask_``; its PyTorch body on CPU gives
    what the batched CPU formula gives."""
    from speedtronic.kernels import ops
    from speedtronic.optim.muon_chunks import _cautious

    g = torch.Generator().manual_seed(0)
    orth, grad = torch.randn(3, 8, 16, generator=g), torch.randn(3, 8, 16, generator=g)
    for rescale in (True, False):
        group = {"cautious_rescale": rescale}
        batched = _cautious(orth.clone(), grad.clone(), group, (8, 16))  # in place on CPU
        per_matrix = orth.clone()
        ops.cautious_mask_(list(per_matrix.unbind(0)), list(grad.unbind(0)), rescale)
        torch.testing.assert_close(batched, per_matrix, rtol=1e-6, atol=0)
        assert (batched == 0).any() and not torch.equal(batched, orth)
