"""DiLoCo workers (diloco/node.py) and a master as threads over file://, and the distributed config
rules.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import (  # noqa: E402
    FakeTrainer,
    TinyModel,
    applied_keys,
    assert_consistent,
    batch,
    eval_loss,
    initial_weights,
    make_cfg,
    train,
)

from speedtronic.config import ConfigError, load_config  # noqa: E402
from speedtronic.diloco import codec  # noqa: E402
from speedtronic.diloco.node import Worker  # noqa: E402
from speedtronic.diloco.store import (  # noqa: E402
    open_store,
)


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
    with pytest.raises(ConfigError, match="lease_ttl"):  # the master renews once per listing
        load_config({"distributed": {"master_poll_interval": 10, "lease_ttl": 15}})
    with pytest.raises(ConfigError, match="lease_ttl"):  # null: poll_interval, capped at 1 s
        load_config({"distributed": {"poll_interval": 0.5, "lease_ttl": 0.9}})
    load_config({"distributed": {"poll_interval": 10, "lease_ttl": 15}})
    for key, bad in (("max_unapplied", 0), ("push_pull_timeout", -1), ("grace_window", -1),
                     ("master_poll_interval", 0), ("unapplied_wait", -1)):
        with pytest.raises(ConfigError, match=f"distributed.{key}"):
            load_config({"distributed": {key: bad}})
    with pytest.raises(ConfigError, match="shard"):
        load_config({"distributed": {"shard": 2, "num_shards": 2}})
    with pytest.raises(ConfigError, match="outer_optimizer"):
        load_config({"distributed": {"outer_optimizer": "adam"}})
    with pytest.raises(ConfigError, match="eager_share"):
        load_config({"distributed": {"eager_share": 1.5}})


def _put_global(store, weights: dict, version: int) -> codec.Pointer:
    """Write ``weights`` as global ``version`` (no master state); return its pointer."""
    data = codec.encode_global(weights, version)
    path = codec.global_key(version, 0, "abc")
    store.put(path, data)
    return codec.Pointer(version=version, path=path, sha256=codec.sha256(data),
                         weights_digest=codec.tensor_digest(weights), outer_step=version,
                         master_epoch=0, state_path="", state_sha256="")


@pytest.mark.parametrize("corrupt", ["broadcastable_shape", "integer_dtype"])
def test_worker_refuses_a_global_whose_tensors_do_not_fit_the_model(tmp_path, corrupt):
    """copy_ would broadcast a (1, n) tensor into an (m, n) parameter; the worker checks every
    tensor's shape and dtype before it stages a global, and installs nothing."""
    from speedtronic.diloco.node import sync_parameters

    url = f"file://{tmp_path}/store"
    store = open_store(url)
    worker = Worker(make_cfg(url), node_id="w0")
    worker._params = sync_parameters(TinyModel(0))
    weights = initial_weights()
    name = next(k for k, v in weights.items() if v.dim() == 2 and v.shape[0] > 1)
    if corrupt == "broadcastable_shape":
        weights[name] = weights[name][:1].clone()
    else:
        weights[name] = weights[name].to(torch.int32)
    pointer = _put_global(store, weights, version=1)
    with pytest.raises(codec.FormatError, match=f"{name!r} is .* not installed"):
        worker._stage(pointer)
    assert worker._candidate is None


@pytest.mark.parametrize("master_model", ["wider", "one more layer"])
def test_a_worker_whose_model_cannot_take_the_global_stops_at_once(tmp_path, master_model):
    """A global that does not fit the model never will: the worker raises a config error at
    start instead of waiting start_timeout and then blaming the master. A global with tensors
    the worker lacks (a deeper master model) was installed as a subset, and every delta of the
    run was then refused."""
    from speedtronic.config import ConfigError

    url = f"file://{tmp_path}/store"
    store = open_store(url)
    weights = initial_weights()
    if master_model == "wider":
        weights["fc1.weight"] = torch.zeros(32, 8)
        expected = r"'fc1.weight'.*same model\.\* settings"
    else:
        weights["fc3.weight"] = torch.zeros(4, 4)
        expected = r"has tensors this model lacks: \['fc3.weight'\].*same model\.\* settings"
    store.put(codec.POINTER_KEY, _put_global(store, weights, version=0).to_bytes())
    worker = Worker(make_cfg(url, start_timeout=600.0), node_id="w0")
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=expected):
        worker.on_train_start(FakeTrainer(TinyModel(0)))
    assert time.monotonic() - t0 < 30
    worker.close()


def test_a_damaged_global_is_named_once_and_in_the_start_error(tmp_path, caplog):
    """A flipped byte in the published global: the worker warned once per poll (51 times in
    10 s) and then said "no global published (is the master up?)", though one was."""
    import logging

    from speedtronic.diloco.store import StoreError

    url = f"file://{tmp_path}/store"
    store = open_store(url)
    pointer = _put_global(store, initial_weights(), version=0)
    store.put(codec.POINTER_KEY, pointer.to_bytes())
    blob = bytearray(store.get(pointer.path))
    blob[-1] ^= 0xFF
    store.put(pointer.path, bytes(blob))
    worker = Worker(make_cfg(url, start_timeout=1.0, poll_interval=0.05), node_id="w0")
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        with pytest.raises(StoreError, match=r"no usable global .*the published one cannot "
                                             r"be used: .*sha256"):
            worker.on_train_start(FakeTrainer(TinyModel(0)))
    worker.close()
    said = [r for r in caplog.records if "waiting for the first global" in r.getMessage()]
    assert len(said) == 1


def test_a_worker_without_a_master_says_once_what_it_waits_for(tmp_path, caplog):
    """A bundled diloco_worker config started alone waited start_timeout (600 s) without a
    word after its first line."""
    import logging

    from speedtronic.diloco.store import StoreError

    worker = Worker(make_cfg(f"file://{tmp_path}/store", start_timeout=0.3, poll_interval=0.05),
                    node_id="w0")
    with caplog.at_level(logging.INFO, logger="speedtronic.diloco"):
        with pytest.raises(StoreError, match=r"is the master up\?"):
            worker.on_train_start(FakeTrainer(TinyModel(0)))
    worker.close()
    said = [r.getMessage() for r in caplog.records if "waiting up to" in r.getMessage()]
    assert said == [f"diloco worker w0: waiting up to 0.3s (distributed.start_timeout) for the "
                    f"master's first global at file://{tmp_path}/store"]


def test_a_dead_master_thread_fails_the_run_with_one_line(tmp_path, monkeypatch):
    """role: master trains as a worker and aggregates in a thread; when that thread dies the
    run must stop with the cause, not train on and exit 0."""
    from speedtronic.diloco.master import Master
    from speedtronic.diloco.service import MasterNode
    from speedtronic.errors import SpeedtronicError

    def broken_run(self, stop, until=None, idle_timeout=0.0):
        raise RuntimeError("disk quota exceeded while publishing")

    monkeypatch.setattr(Master, "run", broken_run)
    cfg = make_cfg(f"file://{tmp_path}/store", inner_steps=2, final_sync_timeout=1)
    node = MasterNode(cfg)
    trainer = FakeTrainer(TinyModel(0))
    node.on_train_start(trainer)  # returns once the thread bootstrapped v0, then it dies
    assert node.thread.join(10)
    with pytest.raises(SpeedtronicError, match="diloco master thread died: RuntimeError: disk "
                                               "quota exceeded while publishing"):
        node.after_optimizer_step(trainer, 1)
    node.on_train_end(trainer)  # reported once: the end of the run does not raise again


def test_a_round_bound_below_min_deltas_is_refused():
    with pytest.raises(ConfigError, match="max_deltas_per_round: must be >= 1 and >= "
                                          "min_deltas=20"):
        load_config({"distributed": {"enabled": True, "store": "file:///tmp/x", "min_deltas": 20,
                                     "max_deltas_per_round": 16}})


def test_the_done_marker_during_an_outage_holds_the_training_thread_only_shutdown_timeout(
        tmp_path, monkeypatch, caplog):
    """The end-of-run put of done.json retries with backoff (it held the training thread 8.3 s
    past a 1 s shutdown_timeout); what is still retrying at the deadline is abandoned."""
    import logging

    from speedtronic.diloco.service import MasterThread

    flag = tmp_path / "outage"
    monkeypatch.setenv("SPEEDTRONIC_DILOCO_OUTAGE_FILE", str(flag))
    url = f"file://{tmp_path}/store"
    cfg = make_cfg(url, inner_steps=2, shutdown_timeout=1.0, final_sync_timeout=30.0,
                   start_timeout=3.0)
    mt = MasterThread(cfg, "master", lambda: initial_weights())
    mt.start()
    try:
        assert mt.ready.wait(30) and mt.error is None, mt.error
        w, t = Worker(cfg, node_id="w0"), FakeTrainer(TinyModel(0))
        start = [0.0]

        def outage_after_step_1(step: int) -> None:
            if step == 1:
                flag.touch()  # the store goes away; step 2 ends a round, then the run ends
                start[0] = time.monotonic()

        with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
            train(w, t, 2, on_step=outage_after_step_1)  # ends with on_train_end
        elapsed = time.monotonic() - start[0]
    finally:
        flag.unlink(missing_ok=True)
        mt.stop.set()
        mt.join(10)
    assert "done marker not written within shutdown_timeout=1s" in caplog.text
    assert elapsed < 1.0 + 5.0  # the flush's 1 s, then at most the join after the stop
    assert not any(k.endswith("done.json") for k in open_store(url).list("nodes/"))


def test_every_confirmed_upload_resets_the_inner_optimizer(tmp_path):
    """Also the upload of a round that ended by installing a newer global (it did not)."""
    import threading as _threading

    from speedtronic.diloco.master import Master

    url = f"file://{tmp_path}/store"
    cfg = make_cfg(url, inner_steps=2, poll_interval=1e6, lease_ttl=1e7,
                   reset_inner_optimizer=True)
    master = Master(open_store(url), cfg, "m", lambda: initial_weights())
    assert master.acquire_lease(_threading.Event(), timeout=5)
    master.load_or_bootstrap()
    w, t = Worker(cfg, node_id="w0"), FakeTrainer(TinyModel(0))
    w.on_train_start(t)
    try:
        def step() -> None:
            x, y = torch.randn(4, 8), torch.randn(4, 4)
            t.optimizer.zero_grad()
            torch.nn.functional.mse_loss(t.model(x), y).backward()
            t.optimizer.step()
            t.step += 1
            w.after_optimizer_step(t, t.step)

        step(), step()  # a round: snapshot, upload
        assert w.flush(30)
        master.run_once()  # v1 holds it
        w.poll_now()  # v1 staged: the next round ends by installing it
        step()  # the first upload's reset
        assert w.m["resets"] == 1 and not t.optimizer.state
        step()  # a round: snapshot, then install v1
        assert w.m["installs"] == 2 and w.flush(30)
        step()
        assert w.m["deltas_sent"] == 2 and w.m["resets"] == 2 and not t.optimizer.state
    finally:
        w.close()


def test_a_complex_parameter_is_refused_before_anything_is_sent(tmp_path):
    """Deltas and globals are real fp32: a complex parameter lost its imaginary part."""
    model = TinyModel(0)
    model.phase = torch.nn.Parameter(torch.tensor([1 + 2j, 3 - 1j]))
    w = Worker(make_cfg(f"file://{tmp_path}/store"), node_id="w0")
    with pytest.raises(ConfigError, match="'phase' is torch.complex64; DiLoCo synchronizes real"):
        w.on_train_start(FakeTrainer(model))
    assert model.phase.imag.tolist() == [2.0, -1.0]
    assert open_store(f"file://{tmp_path}/store").list("") == []


def test_the_upload_thread_survives_an_unexpected_error(tmp_path, monkeypatch, caplog):
    """Anything but a StoreError once ended the upload thread: every later round stayed queued
    and was lost at the end, with upload_failures 0."""
    import logging
    import threading as _threading

    from speedtronic.diloco.master import Master

    url = f"file://{tmp_path}/store"
    cfg = make_cfg(url, inner_steps=2, poll_interval=1e6, lease_ttl=1e7)
    master = Master(open_store(url), cfg, "m", lambda: initial_weights())
    assert master.acquire_lease(_threading.Event(), timeout=5)
    master.load_or_bootstrap()
    w, t = Worker(cfg, node_id="w0"), FakeTrainer(TinyModel(0))
    real_put, calls = Worker._put, []

    def flaky_put(self, job):
        calls.append(job.key)
        if len(calls) == 1:
            raise OSError("a raw OS error from some back end")
        real_put(self, job)

    monkeypatch.setattr(Worker, "_put", flaky_put)
    with caplog.at_level(logging.ERROR, logger="speedtronic.diloco"):
        train(w, t, 4)  # two rounds; on_train_end flushes
    assert w.m["upload_failures"] == 1 and w.m["deltas_sent"] >= 1
    assert "failed unexpectedly" in caplog.text
    assert any(k.endswith("done.json") for k in open_store(url).list("nodes/"))


def _master(url: str, cfg):
    from speedtronic.diloco.master import Master

    master = Master(open_store(url), cfg, "m", lambda: initial_weights())
    assert master.acquire_lease(threading.Event(), timeout=5)
    master.load_or_bootstrap()
    return master


def _steps(w: Worker, t: FakeTrainer, n: int) -> None:
    for _ in range(n):
        x, y = batch(t.step, 0)
        t.optimizer.zero_grad()
        torch.nn.functional.mse_loss(t.model(x), y).backward()
        t.optimizer.step()
        t.step += 1
        w.after_optimizer_step(t, t.step)


def test_the_codec_error_of_queued_deltas_is_all_sent(tmp_path):
    """Consistent base + int8: each upload's rounding error goes out with the next delta. With
    two deltas queued (an upload slower than a round) the upload thread prepared both before
    the next boundary, and the first one's error was overwritten: never sent."""
    url, H = f"file://{tmp_path}/store", 3
    cfg = make_cfg(url, inner_steps=H, poll_interval=1e6, lease_ttl=1e7, compression="int8",
                   max_unapplied=100, push_pull_timeout=0.0, reset_inner_optimizer=False)
    _master(url, cfg)
    entered, release = threading.Event(), threading.Event()

    class SlowFirstPut:  # the first delta's upload stalls (a slow link, a short outage)
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def put(self, key, data, **kw):
            if "/d00000000-" in key:
                entered.set()
                assert release.wait(30)
            return self.inner.put(key, data, **kw)

    w = Worker(cfg, store=SlowFirstPut(open_store(url)), node_id="w0")
    t = FakeTrainer(TinyModel(0))
    w.on_train_start(t)
    work, sent = [], []
    snapshot, confirm = w._snapshot_delta, w._confirm_delta

    def measure_work():
        work.append({k: w._refs[w.gen][k] - p.detach() for k, p in w._params.items()})
        snapshot()

    def record_sent(job):
        sent.append(job.decoded)
        confirm(job)

    w._snapshot_delta, w._confirm_delta = measure_work, record_sent
    try:
        _steps(w, t, H)          # delta 0 is prepared; its upload stalls
        assert entered.wait(30)
        _steps(w, t, 2 * H)      # deltas 1 and 2 queue behind it
        release.set()
        assert w.flush(30)       # 1 and 2 are prepared back to back
        _steps(w, t, H)          # delta 3 carries what error is left
        assert w.flush(30)
    finally:
        release.set()
        w.close()
    assert len(sent) == 4
    left = w._residual or {k: torch.zeros_like(v) for k, v in work[0].items()}
    for k in left:  # all the work = what was sent + the error still to send
        gap = (sum(d[k] for d in work) - sum(d[k] for d in sent) - left[k]).abs().max()
        assert gap < 1e-6, (k, float(gap))


def _worker_whose_second_encode_fails(tmp_path, monkeypatch, H: int, message: str,
                                      **cfg_changes) -> Worker:
    """A worker (and its master) whose second delta raises MemoryError(message) when encoded."""
    from speedtronic.diloco import node_upload

    url = f"file://{tmp_path}/store"
    cfg = make_cfg(url, inner_steps=H, poll_interval=1e6, lease_ttl=1e7, shutdown_timeout=30.0,
                   push_pull_timeout=0.0, unapplied_wait=0.0, **cfg_changes)
    _master(url, cfg)
    real, calls = node_upload.codec.encode_delta, []

    def encode_fails_second(delta, header):
        calls.append(header.seq)
        if len(calls) == 2:
            raise MemoryError(message)
        return real(delta, header)

    monkeypatch.setattr(node_upload.codec, "encode_delta", encode_fails_second)
    return Worker(cfg, node_id="w0")


def test_a_failed_delta_preparation_stops_the_run_instead_of_training_on_unsent(tmp_path,
                                                                                 monkeypatch):
    """One exception while encoding (a host MemoryError) ended the upload thread unseen: the
    worker trained on for the rest of the run and sent nothing."""
    from speedtronic.errors import SpeedtronicError

    H = 3
    w = _worker_whose_second_encode_fails(tmp_path, monkeypatch, H,
                                          "one failed allocation while encoding")
    t = FakeTrainer(TinyModel(0))
    w.on_train_start(t)
    try:
        _steps(w, t, 2 * H)  # two rounds: the second delta's preparation fails
        w._threads[0].join(30)  # the upload thread has ended, having recorded why
        assert isinstance(w.upload_error, MemoryError)
        start = time.monotonic()
        assert not w.flush(30) and time.monotonic() - start < 5  # not a 30 s wait
        with pytest.raises(SpeedtronicError, match="upload thread failed .MemoryError: one "
                                                   "failed allocation"):
            _steps(w, t, 1)
    finally:
        w.close()


@pytest.mark.parametrize("consistent_base", [True, False])
def test_a_failed_preparation_of_the_last_round_fails_the_run_end(tmp_path, monkeypatch,
                                                                  consistent_base):
    """The last round's delta failing to encode: the run ended as a success, wrote its done
    marker and said "still pending after shutdown_timeout" about work that was lost."""
    from speedtronic.errors import SpeedtronicError

    H = 3
    w = _worker_whose_second_encode_fails(tmp_path, monkeypatch, H, "boom",
                                          consistent_base=consistent_base)
    t = FakeTrainer(TinyModel(0))
    start = time.monotonic()
    with pytest.raises(SpeedtronicError, match="upload thread failed .MemoryError: boom"):
        train(w, t, 2 * H)  # the second and last round fails
    assert time.monotonic() - start < 20  # not shutdown_timeout's 30 s
    assert not any(k.endswith("done.json") for k in open_store(f"file://{tmp_path}/store").list("nodes/"))


def test_a_slower_download_of_an_older_global_never_replaces_a_newer_staged_one(tmp_path):
    """The poll thread and the end of a run both stage globals: an older pointer's download
    finishing last made a worker end on the global before the newest."""
    from speedtronic.diloco.codec import Pointer

    url = f"file://{tmp_path}/store"
    cfg = make_cfg(url, inner_steps=2, poll_interval=1e6, lease_ttl=1e7)
    master = _master(url, cfg)
    w, t = Worker(cfg, node_id="w0"), FakeTrainer(TinyModel(0))
    w.on_train_start(t)
    try:
        older = Pointer.from_bytes(open_store(url).get("global/latest.json"))
        _steps(w, t, 2)
        assert w.flush(30)
        master.run_once()
        newer = Pointer.from_bytes(open_store(url).get("global/latest.json"))
        assert newer.version > older.version
        w._stage(newer)
        w._stage(older)  # the slow one lands last
        assert w._candidate[0].version == newer.version
    finally:
        w.close()


def test_an_interrupted_run_writes_no_done_marker_and_skips_the_final_sync(tmp_path):
    """Ctrl-C wrote done.json (the master then stopped before a --resume came back) and waited
    up to final_sync_timeout for a master that might be gone."""
    import threading as _threading

    from speedtronic.diloco.master import Master

    url = f"file://{tmp_path}/store"
    cfg = make_cfg(url, inner_steps=2, poll_interval=1e6, lease_ttl=1e7,
                   final_sync_timeout=90.0)
    master = Master(open_store(url), cfg, "m", lambda: initial_weights())
    assert master.acquire_lease(_threading.Event(), timeout=5)
    master.load_or_bootstrap()
    w, t = Worker(cfg, node_id="w0"), FakeTrainer(TinyModel(0))

    def interrupt(step: int) -> None:
        if step == 3:
            raise KeyboardInterrupt

    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        train(w, t, 10, on_step=interrupt)  # ends with on_train_end, inside the finally
    assert time.monotonic() - start < 60  # not the 90 s final sync
    store = open_store(url)
    keys = store.list("nodes/")
    assert not any(k.endswith("done.json") for k in keys)
    # the round and the partial one were sent (one delta or two: a round still queued when the
    # partial one is taken coalesces with it)
    steps = [codec.decode_delta(store.get(k))[1].inner_steps for k in keys
             if k.endswith(".safetensors")]
    assert sum(steps) == 3 and len(steps) in (1, 2)



def test_a_worker_that_cannot_read_the_store_stops_at_once(tmp_path):
    """Denied access or a missing bucket is not an outage: the worker waited start_timeout
    (600 s by default) and then asked whether the master was up."""
    from speedtronic.diloco.store import AccessDenied, StoreError

    class DeniedStore:
        url = "s3://bucket/run"

        def get(self, key):
            raise AccessDenied(f"get {key}: HTTP 403 (check the token/keys in the environment)")

    worker = Worker(make_cfg(f"file://{tmp_path}/s", start_timeout=600.0), node_id="w0",
                    store=DeniedStore())
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="cannot read the store: get global/latest.json: HTTP 403"):
        worker.on_train_start(FakeTrainer(TinyModel(0)))
    assert time.monotonic() - t0 < 30


def test_a_checkpoint_cadence_longer_than_a_round_is_a_warning(tmp_path, caplog):
    """Killed between checkpoints, a worker resumes from the last one and trains the rounds
    since then again (their deltas were applied): with every_steps > H it is warned at start."""
    import logging
    from types import SimpleNamespace

    worker = Worker(make_cfg(f"file://{tmp_path}/s", inner_steps=100), node_id="w0")

    def trainer(every: int, enabled: bool = True) -> SimpleNamespace:
        return SimpleNamespace(config=SimpleNamespace(checkpoint=SimpleNamespace(
            enabled=enabled, every_steps=every)))

    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        for every, enabled in ((100, True), (50, True), (1000, False)):
            worker._warn_about_checkpoint_cadence(trainer(every, enabled))
        assert not caplog.records
        worker._warn_about_checkpoint_cadence(trainer(500))
    (record,) = caplog.records
    assert "checkpoint.every_steps=500 > distributed.inner_steps=100" in record.getMessage()
    assert "up to 4 rounds back" in record.getMessage()
    worker.close()
