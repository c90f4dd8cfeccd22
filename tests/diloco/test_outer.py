"""The outer optimizer (diloco/outer.py): Nesterov parity with torch SGD, delayed Nesterov, descent.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import (  # noqa: E402
    FakeTrainer,
    TinyModel,
    batch,
    eval_loss,
)

from speedtronic.diloco.outer import OuterOptimizer, carry_weight  # noqa: E402


# ----------------------------------------------------------------------------- outer step
def _matches_torch_nesterov(seed: int, steps: int, weights: list[float]) -> None:
    """Outer Nesterov on ``len(weights)`` weighted deltas per step equals torch's Nesterov SGD
    on their weighted mean sum(w_i d_i) / sum(w_i)."""
    torch.manual_seed(seed)
    theta = {"w": torch.randn(4, 3)}
    ref = torch.nn.Parameter(theta["w"].clone())
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    opt = OuterOptimizer("nesterov", 0.7, 0.9)
    for i in range(steps):
        ds = [torch.randn(4, 3) for _ in weights]
        opt.step(theta, [({"w": d}, w) for d, w in zip(ds, weights, strict=True)])
        ref.grad = sum(w * d for d, w in zip(ds, weights, strict=True)) / sum(weights)
        sgd.step()
        torch.testing.assert_close(theta["w"], ref.detach(), rtol=0, atol=1e-6, msg=f"step {i}")


def test_nesterov_matches_torch_sgd():
    _matches_torch_nesterov(seed=0, steps=5, weights=[1.0])


@pytest.mark.parametrize("method", ["delayed_nesterov", "eager_nesterov"])
def test_round_methods_equal_nesterov_when_a_round_arrives_together(method):
    torch.manual_seed(1)
    a = {"w": torch.randn(6)}
    b = {"w": a["w"].clone()}
    dn, nest = OuterOptimizer(method, 0.7, 0.9), OuterOptimizer("nesterov", 0.7, 0.9)
    for _ in range(4):
        ds = [({"w": torch.randn(6)}, 1.0) for _ in range(3)]
        dn.step(a, ds, workers=3)
        nest.step(b, ds)
        torch.testing.assert_close(a["w"], b["w"])


def test_eager_nesterov_applies_each_arrival_share_at_once_and_the_round_total_at_its_close():
    """Deltas arriving one per poll (M=3, 4 rounds): mid-round, eager Nesterov is ahead of
    delayed Nesterov by exactly ``lr * mu * (sum of the round's arrivals so far) / M`` (the
    share delayed Nesterov holds back until the round's last arrival); at every round's close
    the two are equal again."""
    torch.manual_seed(2)
    lr, mu, M = 0.5, 0.6, 3
    eager_w = {"w": torch.randn(5)}
    delayed_w = {"w": eager_w["w"].clone()}
    eager, delayed = OuterOptimizer("eager_nesterov", lr, mu, eager_share=1.0), OuterOptimizer(
        "delayed_nesterov", lr, mu)
    for _ in range(4):
        arrived = torch.zeros(5)
        for j in range(M):
            d = {"w": torch.randn(5)}
            arrived += d["w"]
            eager.step(eager_w, [(d, 1.0)], workers=M)
            delayed.step(delayed_w, [(d, 1.0)], workers=M)
            gap = delayed_w["w"] - eager_w["w"]
            expected = lr * mu * arrived / M if j < M - 1 else torch.zeros(5)
            torch.testing.assert_close(gap, expected, rtol=0, atol=1e-5)
        assert eager.arrived == 0 and not eager.acc  # the round closed


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_eager_share_splits_each_delta_momentum_share_between_arrival_and_round_close(share):
    """``eager_share`` s: mid-round the weights trail full eager Nesterov by exactly
    ``lr * mu * (1 - s) * arrived / M``; at each round's close every s agrees; s = 0 is delayed
    Nesterov step for step."""
    torch.manual_seed(4)
    lr, mu, M = 0.5, 0.6, 3
    start = torch.randn(5)
    part, full, delayed = ({"w": start.clone()} for _ in range(3))
    opt_part = OuterOptimizer("eager_nesterov", lr, mu, eager_share=share)
    opt_full = OuterOptimizer("eager_nesterov", lr, mu, eager_share=1.0)
    opt_delayed = OuterOptimizer("delayed_nesterov", lr, mu)
    for _ in range(3):
        arrived = torch.zeros(5)
        for j in range(M):
            d = {"w": torch.randn(5)}
            arrived += d["w"]
            for opt, theta in ((opt_part, part), (opt_full, full), (opt_delayed, delayed)):
                opt.step(theta, [(d, 1.0)], workers=M)
            expected = lr * mu * (1 - share) * arrived / M if j < M - 1 else torch.zeros(5)
            torch.testing.assert_close(part["w"] - full["w"], expected, rtol=0, atol=1e-5)
            if share == 0.0:
                torch.testing.assert_close(part["w"], delayed["w"], rtol=0, atol=1e-5)


def test_eager_share_keeps_the_carry_weight():
    """One delta among M=2, then only empty rounds: at share 0.5 the global still ends up moved by
    the carry weight c = lr / (M (1 - mu)) that workers subtract."""
    lr, mu, M = 0.5, 0.5, 2
    theta = {"w": torch.zeros(3, dtype=torch.float64)}
    d = {"w": torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)}
    zero = {"w": torch.zeros(3, dtype=torch.float64)}
    outer = OuterOptimizer("eager_nesterov", lr, mu, eager_share=0.5)
    outer.step(theta, [(d, 1.0), (zero, 1.0)], workers=M)
    for _ in range(400):
        outer.step(theta, [(zero, 1.0), (zero, 1.0)], workers=M)
    c = carry_weight("eager_nesterov", lr, mu, M)
    torch.testing.assert_close(theta["w"], -c * d["w"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("saved, restarted", [
    (("eager_nesterov", 0.5), ("eager_nesterov", 1.0)),
    (("delayed_nesterov", 1.0), ("eager_nesterov", 0.5)),  # the old default to the new one
    (("eager_nesterov", 1.0), ("delayed_nesterov", 1.0)),
])
def test_a_restart_with_another_round_method_or_share_finishes_the_round_as_it_began(
        saved, restarted):
    """A master saved mid-round and restarted with another share or round method: the round in
    progress closes exactly as an uninterrupted run would have closed it (its arrivals already
    applied their part at the saved share), and the next round runs the new setting."""
    torch.manual_seed(5)
    lr, mu, M = 0.5, 0.6, 3
    start = torch.randn(5)
    deltas = [{"w": torch.randn(5)} for _ in range(2 * M)]
    # Uninterrupted reference: the first round at the saved setting, the second at the new one.
    ref_w = {"w": start.clone()}
    ref = OuterOptimizer(saved[0], lr, mu, eager_share=saved[1])
    for d in deltas[:M]:
        ref.step(ref_w, [(d, 1.0)], workers=M)
    ref.method, ref.eager_share = restarted[0], restarted[1]
    ref.round_method, ref.round_share = restarted  # the round boundary: switch now
    for d in deltas[M:]:
        ref.step(ref_w, [(d, 1.0)], workers=M)

    run_w = {"w": start.clone()}
    first = OuterOptimizer(saved[0], lr, mu, eager_share=saved[1])
    for d in deltas[:1]:
        first.step(run_w, [(d, 1.0)], workers=M)
    second = OuterOptimizer(restarted[0], lr, mu, eager_share=restarted[1])
    second.load(first.state_tensors(), first.state_meta())
    for i, d in enumerate(deltas[1:], start=1):
        second.step(run_w, [(d, 1.0)], workers=M)
        if i == M - 1:  # the interrupted round closed: equal to the reference there
            assert (second.round_method, second.round_share) == restarted
    torch.testing.assert_close(run_w["w"], ref_w["w"], rtol=0, atol=1e-6)


def test_a_restart_that_drops_the_share_mid_round_differs_from_one_that_keeps_it():
    """The pinning above matters: closing a share-0.5 round at share 1 skips
    ``lr * mu * 0.5 * arrived / M``, which is what a state saved before the share was recorded
    (read as the configured share) does."""
    lr, mu, M = 0.5, 0.6, 2
    d = {"w": torch.ones(3)}
    saved = OuterOptimizer("eager_nesterov", lr, mu, eager_share=0.5)
    theta = {"w": torch.zeros(3)}
    saved.step(theta, [(d, 1.0)], workers=M)
    meta = saved.state_meta()
    pinned = OuterOptimizer("eager_nesterov", lr, mu, eager_share=1.0)
    pinned.load(saved.state_tensors(), meta)
    unpinned = OuterOptimizer("eager_nesterov", lr, mu, eager_share=1.0)
    unpinned.load(saved.state_tensors(), {k: meta[k] for k in ("method", "arrived")})
    a, b = {"w": theta["w"].clone()}, {"w": theta["w"].clone()}
    pinned.step(a, [({"w": torch.zeros(3)}, 1.0)], workers=M)
    unpinned.step(b, [({"w": torch.zeros(3)}, 1.0)], workers=M)
    torch.testing.assert_close(b["w"] - a["w"], torch.full((3,), lr * mu * 0.5 / M))


def test_eager_share_outside_0_1_is_refused():
    with pytest.raises(ValueError, match="eager_share"):
        OuterOptimizer("eager_nesterov", 0.5, 0.5, eager_share=1.5)


def test_outer_step_moves_downhill():
    """Guards against the pseudo-gradient sign bug (delta = old - new, subtracted)."""
    model = TinyModel(0)
    tr = FakeTrainer(model, lr=1e-2)
    start = {k: p.detach().clone() for k, p in model.named_parameters()}
    before = eval_loss(model)
    for step in range(20):
        x, y = batch(step, 0)
        tr.optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        tr.optimizer.step()
    delta = {k: start[k] - p.detach() for k, p in model.named_parameters()}
    OuterOptimizer("nesterov", 0.7, 0.9).step(start, [(delta, 1.0)])
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(start[k])
    assert eval_loss(model) < before


def test_sgd_at_lr_1_averages_also_when_deltas_arrive_one_per_poll():
    """Each lone arrival was applied in full: 3 workers' deltas in 3 polls moved the weights by
    their sum, not their mean."""
    deltas = [{"w": torch.full((4,), v)} for v in (1.0, 2.0, 6.0)]
    together, apart = {"w": torch.zeros(4)}, {"w": torch.zeros(4)}
    OuterOptimizer("sgd", 1.0, 0.0).step(together, [(d, 1.0) for d in deltas], workers=3)
    one_by_one = OuterOptimizer("sgd", 1.0, 0.0)
    for d in deltas:
        one_by_one.step(apart, [(d, 1.0)], workers=3)
    assert torch.allclose(together["w"], torch.full((4,), -3.0))  # minus the mean
    assert torch.allclose(apart["w"], together["w"])


# ----------------------------------------------------------------------------- weights
def test_staleness_weights_are_the_documented_curves():
    from speedtronic.diloco.outer import staleness_weight

    for s in (0, 1, 3, 8):
        assert staleness_weight(s, "none") == 1.0
        assert staleness_weight(s, "inverse") == pytest.approx(1.0 / (1 + s))
        assert staleness_weight(s, "inverse_sqrt") == pytest.approx((1 + s) ** -0.5)
    with pytest.raises(ValueError, match="unknown staleness_weighting"):
        staleness_weight(1, "linear")


def test_nesterov_takes_the_weighted_mean_of_the_deltas():
    """Token- or staleness-weighted deltas: the step is torch's Nesterov SGD on
    sum(w_i d_i) / sum(w_i), not on the sum divided by the count."""
    _matches_torch_nesterov(seed=3, steps=3, weights=[1.0, 0.5])


@pytest.mark.parametrize("method", ["delayed_nesterov", "eager_nesterov"])
def test_a_backlog_larger_than_a_round_carries_its_excess_into_the_next_round(method):
    """5 deltas in one poll with M=3 close one round and count 2 towards the next: one more
    arrival then closes that round (its momentum refresh happens), not three more."""
    opt = OuterOptimizer(method, 0.5, 0.5)
    theta = {"w": torch.zeros(3)}
    opt.step(theta, [({"w": torch.ones(3)}, 1.0)] * 5, workers=3)
    assert opt.arrived == 2.0
    buf = opt.buf["w"].clone()
    opt.step(theta, [({"w": torch.ones(3)}, 1.0)], workers=3)
    assert opt.arrived == 0.0 and not torch.equal(opt.buf["w"], buf)  # the round closed
