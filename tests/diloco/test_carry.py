"""The consistent-base carry: its weight c, what it installs, when it stops carrying a delta.

Driven by hand (poll_interval 1e6: the poll thread never runs by itself) over a real file://
store with the real Master, so every install and publication happens where the test says."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import FakeTrainer, TinyModel, batch, initial_weights, make_cfg  # noqa: E402

from speedtronic.diloco import codec  # noqa: E402
from speedtronic.diloco.master import Master  # noqa: E402
from speedtronic.diloco.node import Worker  # noqa: E402
from speedtronic.diloco.outer import OuterOptimizer, carry_weight  # noqa: E402
from speedtronic.diloco.store import open_store  # noqa: E402

H = 3


@pytest.mark.parametrize("method,lr,mu", [("delayed_nesterov", 0.5, 0.5),
                                          ("delayed_nesterov", 0.7, 0.9), ("sgd", 1.0, 0.0),
                                          ("nesterov", 0.5, 0.5), ("eager_nesterov", 0.5, 0.5),
                                          ("eager_nesterov", 0.7, 0.9)])
def test_carry_weight_is_the_total_weight_the_outer_step_gives_one_delta(method, lr, mu):
    """One delta d among M=2 arrivals, then only empty rounds: the global ends up moved by
    -c * d, c = lr / (M (1 - mu)) (lr / M without momentum)."""
    M = 2
    theta = {"w": torch.zeros(3, dtype=torch.float64)}
    d = {"w": torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)}
    zero = {"w": torch.zeros(3, dtype=torch.float64)}
    outer = OuterOptimizer(method, lr, mu)
    outer.step(theta, [(d, 1.0), (zero, 1.0)], workers=M)
    for _ in range(400):
        outer.step(theta, [(zero, 1.0), (zero, 1.0)], workers=M)
    c = carry_weight(method, lr, mu, M)
    assert c == pytest.approx(lr / (M * (1 - mu)))
    torch.testing.assert_close(theta["w"], -c * d["w"], rtol=1e-5, atol=1e-6)  # fp32 state


def _cluster(tmp_path, n_workers: int, **kw):
    url = f"file://{tmp_path}/store"
    # carry_lookahead 0: these tests pin the exact algebra (one test sets it)
    settings = dict(inner_steps=H, poll_interval=1e6, lease_ttl=1e7, outer_lr=0.5,
                    outer_momentum=0.5, expected_workers=n_workers, reset_inner_optimizer=False,
                    carry_lookahead=0.0)
    cfg = make_cfg(url, **{**settings, **kw})
    master = Master(open_store(url), cfg, "m", lambda: initial_weights())
    assert master.acquire_lease(threading.Event(), timeout=5)
    master.load_or_bootstrap()
    workers, trainers = [], []
    for i in range(n_workers):
        w, t = Worker(cfg, node_id=f"w{i}"), FakeTrainer(TinyModel(0))
        w.on_train_start(t)
        workers.append(w)
        trainers.append(t)
    return cfg, master, workers, trainers


def _steps(w: Worker, t: FakeTrainer, n: int, shard: int) -> None:
    for _ in range(n):
        x, y = batch(t.step, shard)
        t.optimizer.zero_grad()
        torch.nn.functional.mse_loss(t.model(x), y).backward()
        t.optimizer.step()
        t.step += 1
        w.after_optimizer_step(t, t.step)


def _params(t: FakeTrainer) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in t.model.named_parameters()}


def test_a_boundary_installs_the_global_minus_c_times_the_deltas_it_lacks(tmp_path):
    _, master, (w,), (t,) = _cluster(tmp_path, 1)
    try:
        g0 = {k: v.clone() for k, v in master.weights.items()}
        c = master.carry_weight()
        assert c == pytest.approx(0.5 / (1 * 0.5))
        _steps(w, t, H - 1, 0)
        _steps(w, t, 1, 0)  # the boundary: delta d0 = g0 - weights, then install g0 - c d0
        d0 = w._carry.find(0).tensors
        for k, p in _params(t).items():
            torch.testing.assert_close(p, g0[k] - c * d0[k])
        assert w.m["lag"] == 1 and [d.seq for d in w._carry] == [0]
        assert w.flush(30)
        _steps(w, t, H, 0)  # no global holds d0 yet: both are carried
        d1 = w._carry.find(1).tensors
        for k, p in _params(t).items():
            torch.testing.assert_close(p, g0[k] - c * (d0[k] + d1[k]))
        assert w.flush(30)
        stats = master.run_once()  # v1 holds d0 and d1
        assert stats.applied == 2 and codec.Pointer.holds(master.pointer, "w0", w.session) == 1
        w.poll_now()
        _steps(w, t, H, 0)  # the carry now holds only d2: d0 and d1 are never carried again
        assert [d.seq for d in w._carry] == [2]
        g1, d2 = master.weights, w._carry.find(2).tensors
        for k, p in _params(t).items():
            torch.testing.assert_close(p, g1[k] - c * d2[k])
        assert w.m["installs"] == 2 and w.m["lag_mean"] == pytest.approx((0 + 1 + 2 + 1) / 4)
    finally:
        w.close()


def _lockstep(tmp_path, consistent: bool, rounds: int = 4) -> dict[str, torch.Tensor]:
    _, master, workers, trainers = _cluster(tmp_path, 2, consistent_base=consistent)
    try:
        for _ in range(rounds):
            for i, (w, t) in enumerate(zip(workers, trainers, strict=True)):
                _steps(w, t, H, i)
                assert w.flush(30)
            assert master.run_once().applied == 2  # the whole round in one master round
            for w, t in zip(workers, trainers, strict=True):
                w.poll_now()
                w.install_now(t)
        return {k: v.clone() for k, v in master.weights.items()}
    finally:
        for w in workers:
            w.close()


def test_with_zero_lag_the_consistent_base_is_lockstep_diloco(tmp_path):
    """All M deltas arrive in one master round and every worker installs the result: the carry
    is empty at each install, so the run is the lock-step run without it, to fp32 rounding."""
    with_carry = _lockstep(tmp_path / "a", True)
    without = _lockstep(tmp_path / "b", False)
    for k in without:
        torch.testing.assert_close(with_carry[k], without[k], rtol=0, atol=1e-6)
    assert any(not torch.equal(with_carry[k], initial_weights()[k]) for k in without)


def test_a_rejected_delta_is_not_carried_once_a_global_covers_it(tmp_path):
    """w0's first delta is stale (max_staleness 0) and quarantined in the round that applies
    w1's: the published mark covers it, so w0's next base carries nothing of it."""
    _, master, (w0, w1), (t0, t1) = _cluster(tmp_path, 2, max_staleness=0)
    try:
        _steps(w1, t1, H, 1)
        assert w1.flush(30)
        assert master.run_once().applied == 1  # v1 from w1: w0's base v0 is now stale
        w1.poll_now()
        w1.install_now(t1)  # w1's next round is based on v1
        _steps(w0, t0, H, 0)
        _steps(w1, t1, H, 1)
        assert w0.flush(30) and w1.flush(30)
        stats = master.run_once()
        assert stats.rejected == 1 and stats.applied == 1
        assert master.pointer.holds("w0", w0.session) == 0  # covered, though not applied
        w0.poll_now()
        _steps(w0, t0, H, 0)
        assert [d.seq for d in w0._carry] == [1]  # only the new round's delta
        g, d1 = master.weights, w0._carry.find(1).tensors
        c = master.pointer.carry
        for k, p in _params(t0).items():
            torch.testing.assert_close(p, g[k] - c * d1[k])
    finally:
        w0.close()
        w1.close()


def test_beyond_max_unapplied_the_oldest_stops_being_carried(tmp_path):
    """A master that never runs: memory stays at max_unapplied deltas (uploads succeed, so
    there is nothing to merge), each dropped one counted."""
    _, _, (w,), (t,) = _cluster(tmp_path, 1, max_unapplied=2, unapplied_wait=0.0)
    try:
        for _ in range(5):
            _steps(w, t, H, 0)
            assert w.flush(30)
        assert len(w._carry) == 2 and w.m["carry_dropped"] == 3
        assert [d.seq for d in w._carry] == [3, 4]
    finally:
        w.close()


def test_push_pull_installs_a_global_that_holds_the_delta(tmp_path):
    """With push_pull_timeout the boundary waits (polling) for the master, here a real master
    thread listing every 20 ms, and installs with nothing carried."""
    _, master, (w,), (t,) = _cluster(tmp_path, 1, push_pull_timeout=30.0,
                                       master_poll_interval=0.02)
    stop = threading.Event()
    thread = threading.Thread(target=master.run, args=(stop,), daemon=True)
    thread.start()
    try:
        _steps(w, t, H, 0)
        assert w.m["lag"] == 0 and len(w._carry) == 0
        assert w.version >= 1 and w._global[0].holds("w0", w.session) == 0
        for k, p in _params(t).items():
            torch.testing.assert_close(p, w._global[1][k])
    finally:
        stop.set()
        thread.join(10)
        w.close()


def test_pointers_check_the_marks_and_the_weight_and_old_ones_still_read():
    base = dict(version=3, path="global/v.safetensors", sha256="a", weights_digest="b",
                outer_step=3, master_epoch=1, state_path="master/s", state_sha256="c")
    old = codec.Pointer(**base)
    data = old.to_bytes().replace(b'"carry": 0.0,', b"").replace(b'"hwm": {},', b"")
    assert b"hwm" not in data
    legacy = codec.Pointer.from_bytes(data)  # a pointer from before the carry: c = 0
    assert legacy.carry == 0.0 and legacy.holds("w0", "s") == -1
    good = codec.Pointer(**base, hwm={"w0/s": 4}, carry=0.33)
    assert codec.Pointer.from_bytes(good.to_bytes()).holds("w0", "s") == 4
    for bad in ({"hwm": {"w0/s": "4"}}, {"hwm": ["w0"]}, {"carry": float("nan")},
                {"carry": -1.0}, {"hwm": {"w0/s": True}}):
        with pytest.raises(codec.FormatError, match="pointer"):
            codec.Pointer.from_bytes(codec.Pointer(**{**base, **bad}).to_bytes())


def test_adaptive_inner_steps_scale_a_slow_workers_round_by_the_fastest_pace(tmp_path):
    """The master measures each session's seconds per step (gap between its deltas / their
    inner steps) on its clock and publishes the fastest; a worker twice as slow as the fastest
    shortens its H accordingly, the fastest keeps H."""
    clock = [0.0]
    _, master, (fast, slow), (tf, ts) = _cluster(tmp_path, 2, adaptive_inner_steps=True)
    master._clock = lambda: clock[0]
    for w in (fast, slow):
        w._clock = lambda: clock[0]
    try:
        for tick in range(1, 10 * H):  # one time unit per tick: fast steps each, slow each 2nd
            clock[0] = float(tick)
            for w, t, shard, every in ((fast, tf, 0, 1), (slow, ts, 1, 2)):
                if tick % every == 0:
                    _steps(w, t, 1, shard)
                    assert w.flush(30)
            master.run_once()
            fast.poll_now()
            slow.poll_now()
        assert master.pointer.fastest_step_s == pytest.approx(1.0)
        assert fast.round_steps == H
        assert slow.round_steps == round(H / 2) and slow.m["round_steps"] == slow.round_steps
    finally:
        fast.close()
        slow.close()


def test_deltas_are_weighted_by_tokens_per_step_not_by_round_length(tmp_path):
    _, master, workers, _ = _cluster(tmp_path, 1)
    workers[0].close()

    def header(tokens: int, steps: int) -> codec.DeltaHeader:
        return codec.DeltaHeader(node="n", session="s", seq=0, base_version=0,
                                 inner_steps=steps, tokens=tokens, codec="none")

    assert master._token_weight("a/1", header(512 * 20, 20)) == 1.0
    assert master._token_weight("b/1", header(512 * 20, 20)) == 1.0  # equal batches: 1
    # twice the batch counts twice the mean of the others; a shorter round is not discounted
    assert master._token_weight("c/1", header(1024 * 5, 5)) == pytest.approx(1024 / (2048 / 3))
    assert master._token_weight("d/1", header(0, 20)) == 1.0  # no token count in the header


def test_carry_lookahead_scales_c_by_the_other_workers_in_flight(tmp_path):
    _, master, (w0, w1), (t0, _) = _cluster(tmp_path, 2, carry_lookahead=0.5)
    try:
        g0 = {k: v.clone() for k, v in master.weights.items()}
        _steps(w0, t0, H, 0)
        pointer = w0._global[0]
        assert pointer.workers == 2.0
        c = pointer.carry * (1 + 0.5 * (2 - 1))
        d0 = w0._carry.find(0).tensors
        for k, p in _params(t0).items():
            torch.testing.assert_close(p, g0[k] - c * d0[k])
    finally:
        w0.close()
        w1.close()


def test_slow_polls_and_a_lagging_master_are_each_warned_about_once(tmp_path, caplog):
    """Rounds of H one-second steps: a 100 s worker poll and a 10 s master listing are each
    more than a quarter of a round; and once the master stops, the lag grows past 1.5."""
    clock = [0.0]
    _, master, (w,), (t,) = _cluster(tmp_path, 1, poll_interval=100.0, unapplied_wait=0.0,
                                     master_poll_interval=10.0)
    w._clock = master._clock = lambda: clock[0]
    try:
        with caplog.at_level("WARNING", logger="speedtronic.diloco"):
            for rnd in range(9):
                for _ in range(H):
                    clock[0] += 1.0
                    _steps(w, t, 1, 0)
                assert w.flush(30)
                if rnd < 3:
                    master.run_once()  # then the master stalls
        text = caplog.text
        assert text.count("poll_interval 100s is more than 25% of a round") == 1
        assert text.count("lists deltas every 10s") == 1
        assert text.count("the globals it installed lacked") == 1 and w.m["lag_mean"] > 1.5
    finally:
        w.close()


def test_a_grace_window_puts_near_simultaneous_arrivals_into_one_update(tmp_path):
    """w0's delta is listed; during the grace wait w1's lands; the one update holds both."""
    _, master, (w0, w1), (t0, t1) = _cluster(tmp_path, 2, grace_window=0.5)

    class Stop:
        waits: list[float] = []

        def is_set(self) -> bool:
            return master.pointer.version >= 1

        def wait(self, seconds: float) -> bool:
            self.waits.append(seconds)
            if len(self.waits) == 1:  # the grace wait: the second worker's delta arrives
                _steps(w1, t1, H, 1)
                assert w1.flush(30)
            return self.is_set()

    try:
        _steps(w0, t0, H, 0)
        assert w0.flush(30)
        master.run(Stop())
        assert Stop.waits[0] == 0.5 and master.pointer.version == 1
        assert master.totals["applied"] == 2  # both deltas in v1
    finally:
        w0.close()
        w1.close()




@pytest.mark.parametrize("rebase", [True, False])
def test_a_global_staged_mid_round_moves_the_weights_and_the_delta_keeps_the_rounds_work(
        tmp_path, rebase):
    """rebase_within_round: w0 stages a global mid-round (it holds w0's previous delta and
    w1's); the very next step's callback moves the weights by new base - old base, and the
    round's delta is still exactly minus the optimizer steps' own progress. Off: nothing
    moves until the boundary."""
    _, master, (w0, w1), (t0, t1) = _cluster(tmp_path, 2, rebase_within_round=rebase)
    try:
        _steps(w0, t0, H, 0)
        _steps(w1, t1, H, 1)
        assert w0.flush(30) and w1.flush(30)
        assert master.run_once().applied == 2      # G1 holds d0 (w0's) and w1's delta
        old_base = {k: v.clone() for k, v in w0._refs[w0.gen].items()}
        v_before = w0.version
        progress = {k: torch.zeros_like(v) for k, v in old_base.items()}
        for i in range(H):                         # w0's second round, G1 staged after step 1
            if i == 1:
                w0.poll_now()
            before = _params(t0)
            x, y = batch(t0.step, 0)
            t0.optimizer.zero_grad()
            torch.nn.functional.mse_loss(t0.model(x), y).backward()
            t0.optimizer.step()
            stepped = _params(t0)
            for k in progress:
                progress[k] += stepped[k] - before[k]
            t0.step += 1
            w0.after_optimizer_step(t0, t0.step)
            if i == 1:                              # G1 holds d0: the new base is G1 itself
                g1 = master.weights
                for k, p in _params(t0).items():
                    want = stepped[k] + (g1[k] - old_base[k]) if rebase else stepped[k]
                    torch.testing.assert_close(p, want, rtol=0, atol=1e-6)
                assert w0.version == (master.pointer.version if rebase else v_before)
        d1 = w0._carry.find(1).tensors               # this round's delta: base - weights
        for k in progress:
            torch.testing.assert_close(d1[k], -progress[k], rtol=0, atol=1e-6)
        assert w0.m["rebases"] == int(rebase)
        assert w0.m["installs"] == 2  # the first global and G1, by rebase or at the boundary
    finally:
        w0.close()
        w1.close()
