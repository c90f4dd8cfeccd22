"""The DiLoCo master (diloco/master.py) in one process: quarantine, rejection receipts, data-
parallel equivalence, restart, lease.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import (  # noqa: E402
    FakeTrainer,
    TinyModel,
    applied_keys,
    batch,
    initial_weights,
    make_cfg,
    read_pointer,
    train,
)

from speedtronic.diloco import codec  # noqa: E402
from speedtronic.diloco.master import LeaseLost, Master  # noqa: E402
from speedtronic.diloco.node import Worker  # noqa: E402
from speedtronic.diloco.store import (  # noqa: E402
    open_store,
)


# ----------------------------------------------------------------------------- master
def _master(tmp_path, **kw):
    store = open_store(f"file://{tmp_path}/store")
    m = Master(store, make_cfg(f"file://{tmp_path}/store", **kw), "m0", lambda: initial_weights())
    assert m.acquire_lease(threading.Event(), timeout=5)
    m.load_or_bootstrap()
    return store, m


def _put_delta(store, delta, seq, base=0, node="w1", session="s1", inner_steps=500, **hkw):
    h = codec.DeltaHeader(node=node, session=session, seq=seq, base_version=base,
                          inner_steps=inner_steps, tokens=0, **hkw)
    data, _ = codec.encode_delta(delta, h)
    store.put(h.key, data, if_absent=True)
    return h.key, data


def test_master_quarantines_bad_deltas_and_never_refetches_them(tmp_path):
    store, m = _master(tmp_path, max_staleness=2, max_delta_norm=1e3)
    w = initial_weights()
    good = {k: 0.01 * torch.ones_like(v) for k, v in w.items()}
    nan = {**good, "fc1.weight": torch.full_like(w["fc1.weight"], float("nan"))}
    shape = {**good, "fc1.bias": torch.zeros(3)}
    huge = {k: 1e6 * torch.ones_like(v) for k, v in w.items()}
    k_nan, _ = _put_delta(store, nan, 0)
    k_shape, _ = _put_delta(store, shape, 1)
    k_keys, _ = _put_delta(store, {"fc1.weight": good["fc1.weight"]}, 2)
    k_huge, _ = _put_delta(store, huge, 3)
    _, data = _put_delta(store, good, 4)
    store.put("nodes/w1/s1/d00000005-b00000000.safetensors", data[: len(data) // 2])  # truncated
    flipped = bytearray(data)
    flipped[-3] ^= 1
    store.put("nodes/w1/s1/d00000006-b00000000.safetensors", bytes(flipped))  # corrupt
    store.put("nodes/w1/s1/d00000007-b00000000.safetensors", data)  # duplicate under a new name
    stats = m.run_once()
    assert stats.found == 8 and stats.applied == 1 and stats.rejected == 7
    reasons = dict(m.quarantined)
    assert "non-finite" in reasons[k_nan] and "shape" in reasons[k_shape]
    assert "keys differ" in reasons[k_keys] and "norm" in reasons[k_huge]
    assert "truncated" in reasons["nodes/w1/s1/d00000005-b00000000.safetensors"]
    assert "sha256" in reasons["nodes/w1/s1/d00000006-b00000000.safetensors"]
    assert "does not match its name" in reasons["nodes/w1/s1/d00000007-b00000000.safetensors"]
    again = m.run_once()
    assert again.found == 0 and again.bytes_down == 0  # nothing is downloaded twice
    # stale: base 0 while the global moved on
    for seq in range(2):
        _put_delta(store, good, seq, base=m.pointer.version, node="w2")
        m.run_once()
    k_stale, _ = _put_delta(store, good, 0, base=0, node="w3")
    assert m.pointer.version == 3
    stats = m.run_once()
    assert stats.stale_dropped == 1 and "stale" in dict(m.quarantined)[k_stale]
    assert len(applied_keys(store)) == len(set(applied_keys(store))) == 3


def _inner_round(worker, trainer, poison: bool = False) -> None:
    """One round of H inner steps; ``poison`` makes the delta non-finite."""
    for _ in range(worker.cfg.inner_steps):
        x, y = batch(trainer.step, 0)
        loss = torch.nn.functional.mse_loss(trainer.model(x), y)
        trainer.optimizer.zero_grad()
        loss.backward()
        trainer.optimizer.step()
        trainer.step += 1
        if poison and trainer.step % worker.cfg.inner_steps == 0:
            with torch.no_grad():
                trainer.model.fc1.bias.fill_(float("nan"))
        worker.after_optimizer_step(trainer, trainer.step)


@pytest.mark.parametrize("case", ["stale", "non_finite"])
def test_worker_whose_last_delta_is_rejected_ends_on_the_published_global(tmp_path, case):
    # No version is published for a batch that is entirely rejected, so the worker cannot wait
    # for a global "including" its last delta: the master's rejection receipt ends the wait.
    store, m = _master(tmp_path, max_staleness=1, final_sync_timeout=20, poll_interval=0.5)
    w = Worker(m.cfg, store=store, node_id="w0")
    t = FakeTrainer(TinyModel(0))
    w.on_train_start(t)
    assert w.version == 0
    if case == "stale":  # the global moves on twice while w0 trains on v0
        good = {k: 0.01 * torch.ones_like(v) for k, v in initial_weights().items()}
        for seq in range(2):
            _put_delta(store, good, seq, base=m.pointer.version, node="w9")
            m.run_once()
    _inner_round(w, t, poison=case == "non_finite")
    assert w.flush(10)
    stats = m.run_once()
    assert stats.rejected == 1 and stats.applied == 0 and not stats.published
    w.on_train_end(t)
    pointer = read_pointer(store)
    assert w.final_synced and w.version == pointer.version == (2 if case == "stale" else 0)
    assert codec.tensor_digest(dict(t.model.named_parameters())) == pointer.weights_digest


def test_m_workers_averaging_every_step_equals_data_parallel_with_m_times_the_batch(tmp_path):
    # With inner SGD, H=1 and outer SGD lr 1 (plain averaging), the mean of M workers' one-step
    # deltas is one SGD step on the mean gradient of all M batches: DP with an M x batch. This
    # pins the whole path (snapshot, delta sign, upload, master mean, publish, install) at M > 1.
    M, steps, lr = 3, 6, 0.1
    store, m = _master(tmp_path, inner_steps=1, outer_optimizer="sgd", outer_lr=1.0,
                       outer_momentum=0.0, expected_workers=M, poll_interval=600.0,
                       lease_ttl=3600.0, reset_inner_optimizer=False)
    workers = [Worker(m.cfg, store=store, node_id=f"w{i}") for i in range(M)]
    trainers = [FakeTrainer(TinyModel(0)) for _ in range(M)]
    for w, t in zip(workers, trainers, strict=True):
        t.optimizer = torch.optim.SGD(t.model.parameters(), lr=lr)
        w.on_train_start(t)
    dp = TinyModel(0)
    dp_opt = torch.optim.SGD(dp.parameters(), lr=lr)
    for step in range(steps):
        for i, (w, t) in enumerate(zip(workers, trainers, strict=True)):
            x, y = batch(step, i)
            t.optimizer.zero_grad()
            torch.nn.functional.mse_loss(t.model(x), y).backward()
            t.optimizer.step()
            w.after_optimizer_step(t, step + 1)
            assert w.flush(10)
        assert m.run_once().applied == M
        for w, t in zip(workers, trainers, strict=True):
            w.poll_now()
            w.install_now(t)
        xs, ys = zip(*(batch(step, i) for i in range(M)), strict=True)
        dp_opt.zero_grad()
        torch.nn.functional.mse_loss(dp(torch.cat(xs)), torch.cat(ys)).backward()
        dp_opt.step()
    for w in workers:
        w.close()
    assert m.pointer.version == steps
    for k, p in dp.named_parameters():
        torch.testing.assert_close(m.weights[k], p.detach(), rtol=1e-5, atol=1e-6)
        for t in trainers:
            assert torch.equal(dict(t.model.named_parameters())[k].detach(), m.weights[k])


def test_master_restart_resumes_bit_exactly_from_the_store(tmp_path):
    store, m = _master(tmp_path, outer_optimizer="nesterov")
    w = initial_weights()
    for seq in range(3):
        _put_delta(store, {k: 0.1 * torch.randn_like(v) for k, v in w.items()}, seq,
                   base=m.pointer.version)
        m.run_once()
    m2 = Master(store, m.cfg, "m0", None)  # same node id: takes the lease at once
    assert m2.acquire_lease(threading.Event(), timeout=5)
    m2.load_or_bootstrap()
    assert m2.hwm == m.hwm and m2.pointer.version == 3
    assert all(torch.equal(m2.outer.buf[k], m.outer.buf[k]) for k in m.outer.buf)
    assert codec.tensor_digest(m2.weights) == read_pointer(store).weights_digest
    with pytest.raises(LeaseLost):
        m.run_once()  # the old process, if it were alive, can no longer publish


@pytest.mark.parametrize("method", ["delayed_nesterov", "eager_nesterov"])
def test_master_restart_mid_round_continues_the_round_bit_exactly(tmp_path, method):
    """A round-based outer step restarted between arrivals (2 of M=3 in) finishes that round as
    if it had never stopped: the arrival count and the accumulator come back from the store."""
    torch.manual_seed(3)
    w = initial_weights()
    deltas = [{k: 0.1 * torch.randn_like(v) for k, v in w.items()} for _ in range(5)]
    results = []
    for restart in (False, True):
        root = tmp_path / f"restart{int(restart)}"
        store, m = _master(root, outer_optimizer=method, expected_workers=3)
        for seq, d in enumerate(deltas):
            if restart and seq == 2:
                m = Master(store, m.cfg, "m0", None)
                assert m.acquire_lease(threading.Event(), timeout=5)
                m.load_or_bootstrap()
                assert m.outer.arrived == 2
            _put_delta(store, d, seq, base=m.pointer.version)
            assert m.run_once().applied == 1
        results.append(m.weights)
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k]), k


def test_second_master_waits_for_the_lease(tmp_path):
    store, m = _master(tmp_path)
    other = Master(store, m.cfg, "m1", lambda: initial_weights())
    assert not other.acquire_lease(threading.Event(), timeout=0.5)  # held and being renewed
    m.run_once()
    assert read_pointer(store).master_epoch == m.epoch
    # m stops renewing; after lease_ttl of silence the standby takes over with a higher epoch
    assert other.acquire_lease(threading.Event(), timeout=m.cfg.lease_ttl * 3)
    assert other.epoch > m.epoch
    other.load_or_bootstrap()
    with pytest.raises(LeaseLost):
        m.run_once()


def _take_over(store, m):
    other = Master(store, m.cfg, "m1", lambda: initial_weights())
    assert other.acquire_lease(threading.Event(), timeout=m.cfg.lease_ttl * 3)
    other.load_or_bootstrap()
    return other


def test_a_takeover_fences_a_master_that_lost_its_lease_mid_round(tmp_path, monkeypatch):
    """The lease is checked when a round starts; a master deposed after that must still be
    unable to publish, reject or delete: the new master stamps the pointer with its epoch."""
    store, m = _master(tmp_path, delete_processed=True)
    other = _take_over(store, m)
    assert read_pointer(store).master_epoch == other.epoch > m.epoch
    monkeypatch.setattr(m, "renew_lease", lambda: None)  # m started its round before losing it
    w = initial_weights()
    good, _ = _put_delta(store, {k: 0.01 * torch.randn_like(v) for k, v in w.items()}, 0,
                         base=m.pointer.version)
    with pytest.raises(LeaseLost):
        m.run_once()
    assert read_pointer(store).master_epoch == other.epoch  # m published nothing
    assert store.stat(good) is not None  # and deleted nothing: the new master applies it
    other.run_once()
    assert read_pointer(store).version == 1 and good in applied_keys(store)


def test_a_fenced_master_never_quarantines_deltas_from_the_new_masters_version(tmp_path,
                                                                               monkeypatch):
    store, m = _master(tmp_path, delete_processed=True)
    other = _take_over(store, m)
    w = initial_weights()
    _put_delta(store, {k: 0.01 * torch.randn_like(v) for k, v in w.items()}, 0, node="w1",
               session="s1", base=other.pointer.version)
    other.run_once()  # v1 by the new master
    ahead, _ = _put_delta(store, {k: 0.01 * torch.randn_like(v) for k, v in w.items()}, 1,
                          node="w1", session="s1", base=1)
    monkeypatch.setattr(m, "renew_lease", lambda: None)
    with pytest.raises(LeaseLost, match="fenced"):
        m.run_once()  # m still thinks the version is 0: the delta is "ahead" of it
    assert store.stat(ahead) is not None and not store.list("rejected/")


# ----------------------------------------------------------------------------- QA regressions
def test_a_bad_object_with_a_huge_seq_does_not_hide_the_sessions_real_deltas(tmp_path):
    store, m = _master(tmp_path)
    w = initial_weights()
    good = {k: 0.01 * torch.ones_like(v) for k, v in w.items()}
    _put_delta(store, good, 0)
    store.put("nodes/w1/s1/d00000900-b00000000.safetensors", b"\x00junk" * 1000)
    m.run_once()
    assert "nodes/w1/s1/d00000900-b00000000.safetensors" in dict(m.quarantined)
    assert m.hwm["w1/s1"] == 0  # the quarantined name did not move the high-water mark
    for seq in (1, 2):
        _put_delta(store, good, seq, base=m.pointer.version)
    assert m.run_once().applied == 2
    assert m.hwm["w1/s1"] == 2
    # a restarted master skips the quarantined name without downloading it again
    store2 = open_store(f"file://{tmp_path}/store")
    m.store.delete("master/lease.json")
    m2 = Master(store2, m.cfg, "m1")
    assert m2.acquire_lease(threading.Event(), timeout=5)
    m2.load_or_bootstrap()
    assert m2.run_once().found == 0


def test_a_node_with_only_bad_objects_is_not_waited_for(tmp_path):
    store, m = _master(tmp_path)
    w = initial_weights()
    good = {k: 0.01 * torch.ones_like(v) for k, v in w.items()}
    _put_delta(store, good, 0)
    store.put("nodes/w1/s1/done.json", b'{"last_seq": 0}')
    store.put("nodes/evil/x/d00000000-b00000000.safetensors", b"truncated")
    m.run_once()
    assert m.all_done()  # "evil" never had a delta accepted: not a node to wait for


def test_a_backlog_is_drained_fairly_and_its_wait_is_not_staleness(tmp_path):
    # 3 workers x 8 deltas queued at base 0 (a master outage); 4 per version: the drain
    # publishes 6 versions, more than max_staleness=2, yet nothing is dropped as stale.
    store, m = _master(tmp_path, max_staleness=2, max_deltas_per_round=4)
    w = initial_weights()
    good = {k: 0.01 * torch.ones_like(v) for k, v in w.items()}
    for seq in range(8):
        for node in ("w1", "w2", "w3"):
            _put_delta(store, good, seq, node=node)
    per_round = []
    while True:
        before = dict(m.hwm)
        stats = m.run_once()
        if stats.found == 0:
            break
        assert stats.stale_dropped == 0 and stats.rejected == 0
        per_round.append({n: m.hwm.get(f"{n}/s1", -1) - before.get(f"{n}/s1", -1)
                          for n in ("w1", "w2", "w3")})
    assert sum(sum(r.values()) for r in per_round) == 24
    # round-robin: no node is two deltas ahead of another after any round
    done = {"w1": 0, "w2": 0, "w3": 0}
    for r in per_round:
        for n, k in r.items():
            done[n] += k
        assert max(done.values()) - min(done.values()) <= 1


class _Clock:
    """The master's clock, moved by hand: one round = ``round_s`` seconds."""

    def __init__(self, round_s: float) -> None:
        self.t, self.round_s = 0.0, round_s

    def __call__(self) -> float:
        return self.t

    def rounds(self, m, n: int = 1) -> None:
        for _ in range(n):
            self.t += self.round_s
            m.run_once()


def _clocked_master(tmp_path):
    """A master on a hand-moved clock (5 s per round) and a small valid delta."""
    store, m = _master(tmp_path)
    m._clock = clock = _Clock(5.0)
    good = {k: 0.01 * torch.ones_like(v) for k, v in initial_weights().items()}
    return store, m, clock, good


def test_two_live_workers_under_one_node_id_are_both_waited_for(tmp_path, caplog):
    # Workers upload every 10 s; the master polls every 5 s (two rounds per upload).
    store, m, clock, good = _clocked_master(tmp_path)
    with caplog.at_level("WARNING", logger="speedtronic.diloco.master"):
        for seq in range(3):
            _put_delta(store, good, seq, base=m.pointer.version, session="a")
            _put_delta(store, good, seq, base=m.pointer.version, session="b")
            clock.rounds(m, 2)
    assert "share distributed.node_id" in caplog.text
    store.put("nodes/w1/a/done.json", b'{"last_seq": 2}')
    clock.rounds(m)
    assert not m.all_done()  # b is between uploads (15 s quiet, its pace is 10 s)
    _put_delta(store, good, 3, base=m.pointer.version, session="b")
    clock.rounds(m, 2)
    assert not m.all_done()
    store.put("nodes/w1/b/done.json", b'{"last_seq": 3}')
    clock.rounds(m)
    assert m.all_done() and m.hwm["w1/b"] == 3


def test_a_restarted_worker_counts_as_finished_when_its_new_session_is(tmp_path):
    store, m, clock, good = _clocked_master(tmp_path)
    for seq in range(2):
        _put_delta(store, good, seq, base=m.pointer.version, session="old")
        clock.rounds(m, 2)
    # the process died (no done marker); its restart uploads and finishes
    for seq in range(2):
        _put_delta(store, good, seq, base=m.pointer.version, session="new")
        clock.rounds(m, 2)
    store.put("nodes/w1/new/done.json", b'{"last_seq": 1}')
    clock.rounds(m)
    assert not m.all_done()  # "old" quiet for 30 s: not yet over 3 x its 10 s pace
    clock.rounds(m)
    assert m.all_done()  # 35 s


def test_a_backlog_listed_in_one_round_does_not_shrink_a_sessions_pace(tmp_path):
    # b uploads every 10 s; twice its two newest deltas are listed in the same round (a slow
    # master). The pace stays 10 s, so a sibling's done marker does not end the wait early.
    store, m, clock, good = _clocked_master(tmp_path)
    for seq in range(2):
        _put_delta(store, good, seq, base=m.pointer.version, session="a")
        _put_delta(store, good, seq, base=m.pointer.version, session="b")
        clock.rounds(m, 2)
    _put_delta(store, good, 2, base=m.pointer.version, session="b")
    _put_delta(store, good, 3, base=m.pointer.version, session="b")
    store.put("nodes/w1/a/done.json", b'{"last_seq": 1}')
    clock.rounds(m, 2)
    assert not m.all_done()  # b quiet for 5 s, its pace is 10 s


def test_a_node_whose_only_delta_was_rejected_is_not_waited_for_after_a_restart(tmp_path):
    store, m = _master(tmp_path)
    w = initial_weights()
    good = {k: 0.01 * torch.ones_like(v) for k, v in w.items()}
    nan = {**good, "fc1.weight": torch.full_like(w["fc1.weight"], float("nan"))}
    _put_delta(store, nan, 0, node="bad")
    _put_delta(store, good, 0)
    m.run_once()
    assert m.hwm.get("bad/s1") == 0  # the next seq: the mark moved (the round published)
    store.put("nodes/w1/s1/done.json", b'{"last_seq": 0}')
    m.store.delete("master/lease.json")
    m2 = Master(open_store(f"file://{tmp_path}/store"), m.cfg, "m1")
    assert m2.acquire_lease(threading.Event(), timeout=5)
    m2.load_or_bootstrap()
    m2.run_once()
    assert m2.all_done()  # "bad" never had a delta applied


def test_a_master_on_a_finished_run_says_so_when_it_ends_at_once(tmp_path, caplog):
    """A restarted master on a finished store ends at once (a restart after the end), and
    says so: pointed at an old store for a new run, it once ended silently at v(last) and the
    new workers' deltas were never applied."""
    import logging

    store, m = _master(tmp_path)
    w = initial_weights()
    _put_delta(store, {k: 0.01 * torch.ones_like(v) for k, v in w.items()}, 0)
    m.run_once()
    store.put("nodes/w1/s1/done.json", b'{"last_seq": 0}')
    m.run_once()
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        assert m.all_done()  # it did the work itself: no warning
        assert "finished before this master started" not in caplog.text
        m.store.delete("master/lease.json")
        m2 = Master(open_store(f"file://{tmp_path}/store"), m.cfg, "m1")
        assert m2.acquire_lease(threading.Event(), timeout=5)
        m2.load_or_bootstrap()
        m2.run_once()
        assert m2.all_done() and m2.all_done()
    said = [r for r in caplog.records if "finished before this master started" in r.getMessage()]
    assert len(said) == 1 and "use an empty distributed.store" in said[0].getMessage()


@pytest.mark.parametrize("outer, rounds, warned", [
    ({"outer_momentum": 0.9}, 10, True),
    ({"outer_momentum": 0.5}, 10, False),
    ({"outer_momentum": 0.9}, 500, False),  # the paper's regime
    ({"outer_momentum": 0.9, "outer_optimizer": "sgd"}, 10, False),
])
def test_a_high_outer_momentum_with_short_rounds_is_warned_about_once(tmp_path, caplog, outer,
                                                                       rounds, warned):
    """The round length is the workers' (their delta headers), not the master's own setting."""
    import logging

    store, m = _master(tmp_path, inner_steps=500, **outer)
    delta = {k: 0.01 * torch.ones_like(v) for k, v in initial_weights().items()}
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        for seq in range(2):
            _put_delta(store, delta, seq, base=m.pointer.version, inner_steps=rounds)
            m.run_once()
    assert caplog.text.count("short rounds with a high outer momentum overshoot") == int(warned)


def test_a_restarted_master_rebuilds_an_unreadable_pointer_from_the_newest_pair(tmp_path):
    """A truncated global/latest.json stopped every restart although every global and state
    was intact; the master now adopts the newest complete global + state pair and rewrites the
    pointer, so workers can read it again."""
    store, m = _master(tmp_path)
    delta = {k: 0.01 * torch.ones_like(v) for k, v in initial_weights().items()}
    _put_delta(store, delta, 0)
    m.run_once()
    assert m.pointer.version == 1
    good = read_pointer(store)
    store.put(codec.POINTER_KEY, codec.POINTER_KEY.encode()[:7])  # truncated by hand
    restarted = Master(store, m.cfg, "m0", lambda: initial_weights())
    assert restarted.acquire_lease(threading.Event(), timeout=5)
    restarted.load_or_bootstrap()
    assert restarted.pointer.version == 1 and restarted.hwm == {"w1/s1": 0}
    rebuilt = read_pointer(store)  # readable again, naming the same objects and digests
    assert (rebuilt.path, rebuilt.sha256, rebuilt.weights_digest, rebuilt.state_path) == (
        good.path, good.sha256, good.weights_digest, good.state_path)
    _put_delta(store, delta, 1)
    assert restarted.run_once().published and read_pointer(store).version == 2


def test_cleanup_never_deletes_a_newer_masters_objects(tmp_path):
    """A newer master writes its global and state before it swaps the pointer; the older
    master's cleanup in between once took them for its own failed publish (a version at or
    above its own, not the pointer's) and deleted them, leaving the new pointer dangling."""
    store, m = _master(tmp_path, delete_processed=True)
    w = initial_weights()
    _put_delta(store, {k: 0.01 * torch.randn_like(v) for k, v in w.items()}, 0)
    m.run_once()
    assert m.pointer.version == 1
    newer = [codec.global_key(2, m.epoch + 1, "ab12"), codec.state_key(2, m.epoch + 1, "ab12")]
    own_orphans = [codec.global_key(2, m.epoch, "cd34"), codec.state_key(2, m.epoch, "cd34")]
    for key in newer + own_orphans:
        store.put(key, b"x")
    m._collect_garbage([])
    assert all(store.stat(k) is not None for k in newer)
    assert all(store.stat(k) is None for k in own_orphans)  # its own failed publish still goes
    assert store.stat(m.pointer.path) is not None


def test_a_live_master_under_the_same_node_id_is_not_deposed(tmp_path):
    """A standby started from the same config (same node id) once took the lease at once and
    stopped the running master; only a restart (the holder's process gone) may do that."""
    import json
    import os
    import signal
    import socket
    import subprocess

    store, m = _master(tmp_path)
    lease = json.loads(store.get("master/lease.json"))
    assert lease["host"] == socket.gethostname() and lease["pid"] == os.getpid()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        store.put("master/lease.json", json.dumps({**lease, "pid": holder.pid}).encode())
        again = Master(store, m.cfg, "m0", None)
        assert not again.acquire_lease(threading.Event(), timeout=m.cfg.lease_ttl / 4)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        assert again.acquire_lease(threading.Event(), timeout=m.cfg.lease_ttl / 4)  # a restart
        assert again.epoch > m.epoch
    finally:
        holder.kill()
        holder.wait(timeout=10)
    # a lease of this node id that cannot be placed here (another host, or another pid
    # namespace on this host: a container where the holder may be a live pid 1): the ttl
    # applies, even when its pid is this process's own
    for elsewhere in ({"host": "elsewhere"}, {"pidns": lease["pidns"] + 1},
                      {"boot": "another-boot"}):
        store.put("master/lease.json",
                  json.dumps({**lease, **elsewhere, "pid": os.getpid()}).encode())
        third = Master(store, m.cfg, "m0", None)
        assert not third.acquire_lease(threading.Event(), timeout=m.cfg.lease_ttl / 4)


def test_a_worker_without_a_final_sync_ends_on_the_newest_global(tmp_path):
    """final_sync_timeout 0 with a consistent base: the worker once kept its last install
    (the global minus its carried, not yet applied deltas) plus local steps as its final
    model, weights that no published global holds."""
    store, m = _master(tmp_path, final_sync_timeout=0.0, consistent_base=True)
    w = Worker(m.cfg, store=store, node_id="w0")
    t = FakeTrainer(TinyModel(0))
    H = m.cfg.inner_steps

    def master_applies_first_round(step: int) -> None:
        if step == H:
            assert w.flush(10)
            assert m.run_once().published

    train(w, t, 3 * H, on_step=master_applies_first_round)  # rounds 2 and 3 stay unapplied
    pointer = read_pointer(store)
    assert pointer.version == 1 and w.version == 1
    assert codec.tensor_digest(dict(t.model.named_parameters())) == pointer.weights_digest


def test_a_damaged_current_global_stops_the_master_with_one_line(tmp_path, caplog):
    """A flipped byte in the global the pointer names: the master thread logged a full
    traceback (FormatError was not a SpeedtronicError) before the CLI printed its line."""
    import logging

    from speedtronic.diloco.codec import FormatError
    from speedtronic.diloco.service import MasterThread
    from speedtronic.errors import SpeedtronicError

    store, m = _master(tmp_path)
    path = read_pointer(store).path
    blob = bytearray(store.get(path))
    blob[-1] ^= 0xFF
    store.put(path, bytes(blob))
    thread = MasterThread(m.cfg, "m0", lambda: initial_weights())
    with caplog.at_level(logging.ERROR, logger="speedtronic.diloco"):
        thread.start()
        assert thread.join(30)
    assert isinstance(thread.error, FormatError) and isinstance(thread.error, SpeedtronicError)
    stopped = [r for r in caplog.records if "diloco master stopped" in r.getMessage()]
    assert len(stopped) == 1 and "sha256" in stopped[0].getMessage()
    assert not any(r.exc_info for r in caplog.records)


def test_a_worker_building_another_architecture_is_refused_at_start(tmp_path):
    """Tensor names and shapes were all a worker checked: one with another n_head (same
    shapes) installed the global and trained another function on it."""
    from speedtronic.config import ConfigError, load_config

    run_model = load_config({"model": {"d_model": 32, "n_head": 2}}).to_dict()["model"]
    store = open_store(f"file://{tmp_path}/store")
    cfg = make_cfg(f"file://{tmp_path}/store")
    m = Master(store, cfg, "m0", lambda: initial_weights(), model_config=run_model)
    assert m.acquire_lease(threading.Event(), timeout=5)
    m.load_or_bootstrap()
    pointer = read_pointer(store)
    assert codec.decode_global_with_model(store.get(pointer.path), pointer)[1] == run_model
    assert '"model"' not in pointer.to_bytes().decode()  # older readers refuse unknown fields

    def joins(model_section: dict) -> None:
        t = FakeTrainer(TinyModel(0))
        t.config = load_config({"model": model_section})
        w = Worker(cfg, store=store, node_id="w0")
        try:
            w.on_train_start(t)
        finally:
            w.close()

    with pytest.raises(ConfigError, match=r"model\.n_head is 4 here but 2 in the store"):
        joins({"d_model": 32, "n_head": 4})
    joins({"d_model": 32, "n_head": 2, "dropout": 0.1})  # not architecture: joins
    # an HF config folder is named by a path, which differs between machines
    w = Worker(cfg, store=store, node_id="w1")
    t = FakeTrainer(TinyModel(0))
    t.config = load_config({"model": {"name": "hf", "hf_config": "/mnt/shared/tiny"}})
    w._run_model = {**t.config.to_dict()["model"], "hf_config": "/home/alice/tiny"}
    w._check_model(t)
    w._run_model["rope_base"] = 500000.0
    with pytest.raises(ConfigError, match="model.rope_base"):
        w._check_model(t)
    w.close()
    # a restarted master keeps the run's model even when its own config differs
    m2 = Master(store, cfg, "m0", None, model_config={**run_model, "n_head": 4})
    assert m2.acquire_lease(threading.Event(), timeout=5)
    m2.load_or_bootstrap()
    assert m2.model_config == run_model
