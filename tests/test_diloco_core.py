"""DiLoCo building blocks in one process: store contract and retries, codec, outer optimizer,
master validation/quarantine/lease, and workers + master as threads over file://."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "diloco"))
from harness import (  # noqa: E402
    FakeTrainer,
    TinyModel,
    applied_keys,
    assert_consistent,
    batch,
    eval_loss,
    initial_weights,
    make_cfg,
    read_pointer,
    train,
)

from speedtronic.config import ConfigError, load_config  # noqa: E402
from speedtronic.diloco import codec  # noqa: E402
from speedtronic.diloco.master import LeaseLost, Master  # noqa: E402
from speedtronic.diloco.node import Worker  # noqa: E402
from speedtronic.diloco.outer import OuterOptimizer  # noqa: E402
from speedtronic.diloco.store import (  # noqa: E402
    AccessDenied,
    FileStore,
    ObjectExists,
    ObjectNotFound,
    PreconditionFailed,
    RetryingStore,
    RetryPolicy,
    Store,
    StoreUnavailable,
    TransientStoreError,
    open_store,
)


# ----------------------------------------------------------------------------- store contract
def test_file_store_contract(tmp_path):
    s = FileStore(tmp_path / "root")
    s.put("a/b.bin", b"one")
    assert s.get("a/b.bin") == b"one"
    s.put("a/b.bin", b"two")  # plain put replaces atomically
    assert s.get("a/b.bin") == b"two"
    with pytest.raises(ObjectExists):
        s.put("a/b.bin", b"three", if_absent=True)
    s.put("a/c.bin", b"x", if_absent=True)
    (tmp_path / "root" / "a" / ".tmp-left-by-a-crash").write_bytes(b"junk")
    assert s.list("a/") == ["a/b.bin", "a/c.bin"]  # temp files are never listed
    assert s.stat("a/b.bin").size == 3 and s.stat("missing") is None
    with pytest.raises(ObjectNotFound):
        s.get("missing")
    s.delete("a/c.bin")
    s.delete("a/c.bin")  # deleting a missing key is fine
    assert s.list("a/") == ["a/b.bin"]
    for bad in ("../x", "/abs", "a//b", "a/./b", "sp ace"):
        with pytest.raises(ValueError):
            s.put(bad, b"")


def test_file_store_swap_is_compare_and_swap(tmp_path):
    s = FileStore(tmp_path)
    e1 = s.swap("p.json", b"v1", None)
    with pytest.raises(PreconditionFailed):
        s.swap("p.json", b"v1b", None)  # must not exist any more
    e2 = s.swap("p.json", b"v2", e1)
    with pytest.raises(PreconditionFailed):
        s.swap("p.json", b"v3", e1)  # stale etag
    assert s.get_with_etag("p.json") == (b"v2", e2)


class Flaky(Store):
    """Fails the first ``n`` calls with ``exc``, then delegates."""

    def __init__(self, inner: Store, n: int, exc: Exception, land_first: bool = False):
        self.inner, self.n, self.exc, self.calls, self.land = inner, n, exc, 0, land_first
        self.url = "flaky://"

    def put(self, key, data, *, if_absent=False):
        self.calls += 1
        if self.calls <= self.n:
            if self.land:  # the write lands but the reply is lost
                self.inner.put(key, data, if_absent=if_absent)
            raise self.exc
        self.inner.put(key, data, if_absent=if_absent)

    def get(self, key):
        self.calls += 1
        if self.calls <= self.n:
            raise self.exc
        return self.inner.get(key)


def test_retry_backoff_honours_retry_after_and_skips_permanent_errors(tmp_path):
    sleeps: list[float] = []
    policy = RetryPolicy(attempts=4, base_delay=0.1, max_delay=1.0)
    s = RetryingStore(Flaky(FileStore(tmp_path), 2, TransientStoreError("429", retry_after=7.0)),
                      policy, sleep=sleeps.append, seed=0)
    s.put("k", b"v")
    assert s.get("k") == b"v" and sleeps == [7.0, 7.0]  # Retry-After wins over the backoff
    sleeps.clear()
    s = RetryingStore(Flaky(FileStore(tmp_path), 10, TimeoutError("slow")), policy,
                      sleep=sleeps.append, seed=0)
    with pytest.raises(StoreUnavailable):
        s.get("k")
    assert len(sleeps) == 3 and all(0 <= d <= min(1.0, 0.1 * 2 ** i) for i, d in
                                    enumerate(sleeps))  # full jitter under the cap
    for permanent in (ObjectNotFound("404"), AccessDenied("403")):
        sleeps.clear()
        flaky = Flaky(FileStore(tmp_path), 10, permanent)
        with pytest.raises(type(permanent)):
            RetryingStore(flaky, policy, sleep=sleeps.append).get("k")
        assert flaky.calls == 1 and sleeps == []


def test_retried_create_only_put_that_landed_is_success(tmp_path):
    inner = FileStore(tmp_path)
    s = RetryingStore(Flaky(inner, 1, TransientStoreError("reset"), land_first=True),
                      RetryPolicy(attempts=3), sleep=lambda _: None)
    s.put("d", b"payload", if_absent=True)
    assert inner.get("d") == b"payload"


def test_store_url_parsing(tmp_path):
    assert open_store(f"file://{tmp_path}").url == f"file://{tmp_path}"
    with pytest.raises(ValueError, match="credentials"):
        open_store("s3://AKIA:secret@bucket/x")
    with pytest.raises(ValueError, match="unsupported"):
        open_store("ftp://x/y")


# ----------------------------------------------------------------------------------- codec
def _delta(seed=0, rows=33):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(rows, 70, generator=g), "b": torch.randn(5, generator=g)}


def test_delta_roundtrip_and_integrity():
    d = _delta()
    h = codec.DeltaHeader(node="n1", session="s1", seq=3, base_version=2, inner_steps=5, tokens=9)
    data, decoded = codec.encode_delta(d, h)
    out, header = codec.decode_delta(data)
    assert header.key == "nodes/n1/s1/d00000003-b00000002.safetensors"
    assert all(torch.equal(out[k], d[k]) for k in d) and all(torch.equal(decoded[k], d[k])
                                                              for k in d)
    flipped = bytearray(data)
    flipped[-7] ^= 0x10  # one payload bit: safetensors alone would load this silently
    with pytest.raises(codec.FormatError, match="sha256"):
        codec.decode_delta(bytes(flipped))
    edited = data.replace(b'\\"base_version\\": 2', b'\\"base_version\\": 9')
    assert edited != data
    with pytest.raises(codec.FormatError):
        codec.decode_delta(edited)
    for damaged in (data[: len(data) // 2], b"", data[:5]):
        with pytest.raises(codec.FormatError):
            codec.decode_delta(damaged)


@pytest.mark.parametrize("name,bound,ratio", [("bf16", 5e-3, 2), ("int8", 1.5e-2, 4)])
def test_compression_error_and_size(name, bound, ratio):
    d = _delta(1, rows=600)
    h = codec.DeltaHeader(node="n", session="s", seq=0, base_version=0, inner_steps=1,
                          tokens=0, codec=name)
    raw, _ = codec.encode_delta(d, codec.DeltaHeader(node="n", session="s", seq=0,
                                                     base_version=0, inner_steps=1, tokens=0))
    data, decoded = codec.encode_delta(d, h)
    out, _ = codec.decode_delta(data)
    err = codec.relative_error(d, out)
    assert 0 < err < bound
    assert len(data) < len(raw) / ratio * 1.1
    assert all(torch.equal(out[k], decoded[k]) for k in d)  # sender knows what master sees


# ----------------------------------------------------------------------------- outer step
def test_nesterov_matches_torch_sgd():
    torch.manual_seed(0)
    theta = {"w": torch.randn(4, 3)}
    ref = torch.nn.Parameter(theta["w"].clone())
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    opt = OuterOptimizer("nesterov", 0.7, 0.9)
    for i in range(5):
        d = {"w": torch.randn(4, 3)}
        opt.step(theta, [(d, 1.0)])
        ref.grad = d["w"].clone()
        sgd.step()
        torch.testing.assert_close(theta["w"], ref.detach(), rtol=0, atol=1e-6, msg=f"step {i}")


def test_delayed_nesterov_equals_nesterov_when_a_round_arrives_together():
    torch.manual_seed(1)
    a = {"w": torch.randn(6)}
    b = {"w": a["w"].clone()}
    dn, nest = OuterOptimizer("delayed_nesterov", 0.7, 0.9), OuterOptimizer("nesterov", 0.7, 0.9)
    for _ in range(4):
        ds = [({"w": torch.randn(6)}, 1.0) for _ in range(3)]
        dn.step(a, ds, workers=3)
        nest.step(b, ds)
        torch.testing.assert_close(a["w"], b["w"])


def test_outer_step_moves_downhill():
    """Guards against the pseudo-gradient sign bug (delta = old - new, subtracted)."""
    model = TinyModel(0)
    tr = FakeTrainer(model, lr=1e-2)
    start = {k: p.detach().clone() for k, p in model.named_parameters()}
    before = eval_loss(model)
    from harness import batch
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


# ----------------------------------------------------------------------------- master
def _master(tmp_path, **kw):
    store = open_store(f"file://{tmp_path}/store")
    m = Master(store, make_cfg(f"file://{tmp_path}/store", **kw), "m0", lambda: initial_weights())
    assert m.acquire_lease(threading.Event(), timeout=5)
    m.load_or_bootstrap()
    return store, m


def _put_delta(store, delta, seq, base=0, node="w1", session="s1", **hkw):
    h = codec.DeltaHeader(node=node, session=session, seq=seq, base_version=base,
                          inner_steps=5, tokens=0, **hkw)
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


# ----------------------------------------------------------------------- workers + master
@pytest.mark.parametrize("codec_name", ["none", "int8"])
def test_workers_and_master_threads_over_file_store(tmp_path, codec_name):
    url = f"file://{tmp_path}/store"
    cfg = make_cfg(url, inner_steps=5, compression=codec_name, final_sync_timeout=30,
                   poll_interval=0.01)
    store = open_store(url)
    from speedtronic.diloco.service import MasterThread
    mt = MasterThread(cfg, "master", lambda: initial_weights())
    mt.until = lambda m: m.all_done({"w0", "w1"})
    mt.start()
    workers, trainers, errors = [], [], []

    def run(i):
        try:
            w = Worker(cfg, node_id=f"w{i}")
            t = FakeTrainer(TinyModel(0))
            workers.append(w)
            trainers.append(t)
            # ~2 ms of "compute" per step so rounds overlap with polling as in real runs
            train(w, t, 40, shard=i, on_step=lambda _: time.sleep(0.002))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert mt.join(60) and not errors and mt.error is None
    keys = applied_keys(store)
    assert len(keys) == len(set(keys)) == sum(w.m["deltas_sent"] for w in workers)
    reports = [{"version": w.version, "digest": w.digest, "final_synced": True,
                "weights_digest": codec.tensor_digest(dict(t.model.named_parameters()))}
               for w, t in zip(workers, trainers, strict=True)]
    assert_consistent(store, reports)
    assert eval_loss(trainers[0].model) < 0.6 * eval_loss(TinyModel(0))
    for w, t in zip(workers, trainers, strict=True):
        assert w.m["resets"] >= 1 and w.m["bytes_up"] > 0
        assert any("diloco/train_thread_s" in m for m in t.metrics)
        if codec_name == "int8":
            assert 0 < w.m["codec_rel_err"] < 0.02


def test_distributed_config_validation():
    with pytest.raises(ConfigError, match="distributed.store"):
        load_config({"distributed": {"enabled": True}})
    with pytest.raises(ConfigError, match="node_id"):
        load_config({"distributed": {"node_id": "../evil"}})
    with pytest.raises(ConfigError, match="lease_ttl"):
        load_config({"distributed": {"poll_interval": 10, "lease_ttl": 15}})
    with pytest.raises(ConfigError, match="shard"):
        load_config({"distributed": {"shard": 2, "num_shards": 2}})
    with pytest.raises(ConfigError, match="outer_optimizer"):
        load_config({"distributed": {"outer_optimizer": "adam"}})
