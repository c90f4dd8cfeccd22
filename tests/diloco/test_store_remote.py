"""The same store contract over file://, s3:// (a real moto server on loopback) and hf:// (an
in-memory HfApi double with injected 429/5xx), plus a short DiLoCo run over each."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from fakes import FakeHfApi, MotoServer, set_aws_env  # noqa: E402
from harness import (  # noqa: E402
    FakeTrainer,
    TinyModel,
    applied_keys,
    assert_consistent,
    initial_weights,
    make_cfg,
    train,
)

from speedtronic.diloco import codec  # noqa: E402
from speedtronic.diloco.node import Worker  # noqa: E402
from speedtronic.diloco.service import MasterThread  # noqa: E402
from speedtronic.diloco.store import (  # noqa: E402
    AccessDenied,
    ObjectExists,
    ObjectNotFound,
    PreconditionFailed,
    RetryingStore,
    RetryPolicy,
    StoreError,
    open_configured_store,
    open_store,
)
from speedtronic.diloco.store_remote import HfStore, S3Store  # noqa: E402

pytest.importorskip("s3fs")
pytest.importorskip("moto")


@pytest.fixture(scope="module")
def moto():
    set_aws_env()
    with MotoServer() as server:
        yield server


@pytest.fixture(params=["file", "s3", "hf"])
def store(request, tmp_path):
    if request.param == "file":
        return open_store(f"file://{tmp_path}/s")
    if request.param == "s3":
        server = request.getfixturevalue("moto")
        url = f"s3://{server.bucket}/{tmp_path.name}"
        return RetryingStore(S3Store(url, endpoint_url=server.endpoint))
    return RetryingStore(HfStore("hf://me/run", api=FakeHfApi()), sleep=lambda _: None)


def test_contract_on_every_backend(store):
    store.put("global/v1.bin", b"weights")
    assert store.get("global/v1.bin") == b"weights"
    with pytest.raises(ObjectExists):
        store.put("global/v1.bin", b"other", if_absent=True)
    store.put("nodes/a/s/d1.bin", b"d", if_absent=True)
    assert store.list("nodes/") == ["nodes/a/s/d1.bin"]
    assert store.list("global/v") == ["global/v1.bin"]
    assert store.list("nothing/") == []
    assert store.stat("global/v1.bin").size == 7 and store.stat("nope") is None
    with pytest.raises(ObjectNotFound):
        store.get("nope")
    e1 = store.swap("global/latest.json", b"p1", None)
    with pytest.raises(PreconditionFailed):
        store.swap("global/latest.json", b"px", None)
    data, etag = store.get_with_etag("global/latest.json")
    assert data == b"p1" and etag == e1
    e2 = store.swap("global/latest.json", b"p2", e1)
    with pytest.raises(PreconditionFailed):
        store.swap("global/latest.json", b"p3", e1)
    assert store.get_with_etag("global/latest.json") == (b"p2", e2)
    store.commit({"global/v2.bin": b"w2"}, ("global/latest.json", b"p4", e2))
    assert store.get("global/latest.json") == b"p4" and store.get("global/v2.bin") == b"w2"
    store.delete_many(["nodes/a/s/d1.bin", "global/v1.bin"])
    store.delete("nodes/a/s/d1.bin")
    assert store.list("nodes/") == [] and store.list("global/v") == ["global/v2.bin"]


def test_hf_retries_429_and_5xx_but_not_401():
    api = FakeHfApi(fail=[("create_commit", 429, 3.0), ("create_commit", 503, None),
                          ("hf_hub_download", 502, None)])
    sleeps: list[float] = []
    s = RetryingStore(HfStore("hf://me/run", api=api), RetryPolicy(attempts=5, base_delay=0.01),
                      sleep=sleeps.append, seed=1)
    s.put("a.bin", b"x")
    assert s.get("a.bin") == b"x"
    assert len(sleeps) == 3 and sleeps[0] >= 3.0  # Retry-After honoured
    api.fail = [("hf_hub_download", 401, None)]
    sleeps.clear()
    with pytest.raises(AccessDenied):
        s.get("a.bin")
    assert sleeps == []
    for status in (400, 405, 413, 422):  # the same request fails again: no retry
        api.fail = [("hf_hub_download", status, None)]
        with pytest.raises(StoreError, match=f"HTTP {status}, refused by the server"):
            s.get("a.bin")
        assert sleeps == []
    api.fail = [("hf_hub_download", 408, None)]  # a request timeout is worth another try
    assert s.get("a.bin") == b"x" and len(sleeps) == 1


@pytest.mark.parametrize("private", [True, False])
def test_hf_warns_once_when_the_repo_is_public(private, caplog):
    """A new repo is created private; an existing public one keeps its visibility (it was
    written to without a word)."""
    import logging

    store = HfStore("hf://me/run", api=FakeHfApi(private=private))
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        store.put("a.bin", b"x")
        store.put("b.bin", b"y")
    warnings = [r for r in caplog.records if "Hub repo is public" in r.getMessage()]
    assert len(warnings) == (0 if private else 1)


def test_hf_publication_is_one_commit():
    api = FakeHfApi()
    store = RetryingStore(HfStore("hf://me/run", api=api), sleep=lambda _: None)
    cfg = make_cfg("hf://me/run")
    from speedtronic.diloco.master import Master
    m = Master(store, cfg, "m0", lambda: initial_weights())
    assert m.acquire_lease(threading.Event(), timeout=5)
    before = api.calls.get("create_commit", 0)
    m.load_or_bootstrap()
    assert api.calls["create_commit"] == before + 1  # weights + state + pointer together
    assert {"global/latest.json", m.pointer.path, m.pointer.state_path} <= set(api.files)


def test_hf_gets_of_one_key_on_two_threads_do_not_delete_each_others_file():
    """The poll thread and the end of a run may fetch the pointer at once: hf_hub_download
    writes <local_dir>/<key>, and one get deleted the other's file before it was read (a
    FileNotFoundError past every except that expects a StoreError)."""
    first_written, second_done = threading.Event(), threading.Event()

    class HeldBack(FakeHfApi):
        def downloaded(self, path: Path) -> None:
            if threading.current_thread().name == "first":
                first_written.set()
                assert second_done.wait(30)  # the other get runs whole in between

    api = HeldBack()
    api.files["global/latest.json"] = b'{"version": 7}'
    store = HfStore("hf://me/run", api=api)
    got: dict[str, object] = {}

    def first() -> None:
        try:
            got["first"] = store.get("global/latest.json")
        except BaseException as exc:  # noqa: BLE001 - reported below
            got["first"] = exc

    thread = threading.Thread(target=first, name="first")
    thread.start()
    assert first_written.wait(30)
    assert store.get("global/latest.json") == b'{"version": 7}'
    second_done.set()
    thread.join(30)
    assert got["first"] == b'{"version": 7}', got["first"]
    assert not any(p.is_file() for p in store._tmp.rglob("*"))  # nothing left behind


def test_hf_publication_whose_reply_is_lost_is_not_a_lost_lease():
    """The commit lands, its reply is lost, the retry finds the pointer already moved: the master
    must recognise its own publication (as on file:// and s3://), not step down."""
    from speedtronic.diloco import codec
    from speedtronic.diloco.master import Master

    api = FakeHfApi()
    store = RetryingStore(HfStore("hf://me/run", api=api), sleep=lambda _: None)
    m = Master(store, make_cfg("hf://me/run"), "m0", lambda: initial_weights())
    assert m.acquire_lease(threading.Event(), timeout=5)
    m.load_or_bootstrap()
    w = initial_weights()
    h = codec.DeltaHeader(node="w0", session="s0", seq=0, base_version=0, inner_steps=5,
                          tokens=0)
    data, _ = codec.encode_delta({k: 1e-3 * torch.ones_like(v) for k, v in w.items()}, h)
    store.put(h.key, data, if_absent=True)
    api.lose_reply = ["publish global/latest.json"]  # the publication, not the lease renewal
    stats = m.run_once()
    assert not api.lose_reply  # the fault did fire
    assert stats.published and m.pointer.version == 1
    assert codec.Pointer.from_bytes(store.get("global/latest.json")).version == 1


def _run(url: str, store, cfg_overrides: dict | None = None, **kw) -> None:
    cfg = make_cfg(url, inner_steps=5, final_sync_timeout=30, poll_interval=0.02,
                   **(cfg_overrides or {}))
    mt = MasterThread(cfg, "master", lambda: initial_weights(), **kw)
    if "api" in kw:
        pass
    mt.until = lambda m: m.all_done({"w0", "w1"})
    mt.start()
    results, errors = [], []

    def run(i):
        try:
            w = Worker(cfg, node_id=f"w{i}", store=store if store is not None else None)
            t = FakeTrainer(TinyModel(0))
            train(w, t, 20, shard=i)
            results.append((w, t))
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert mt.join(120) and not errors and mt.error is None
    check = store if store is not None else open_configured_store(cfg)
    keys = applied_keys(check)
    assert len(keys) == len(set(keys)) == sum(w.m["deltas_sent"] for w, _ in results)
    assert_consistent(check, [{"version": w.version, "digest": w.digest, "final_synced": True,
                               "weights_digest": codec.tensor_digest(
                                   dict(t.model.named_parameters()))} for w, t in results])


def test_diloco_over_s3(moto, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.endpoint)
    _run(f"s3://{moto.bucket}/run-{tmp_path.name}", None)


def test_diloco_over_s3_at_the_configured_endpoint(moto, tmp_path, monkeypatch):
    """distributed.endpoint_url reaches the S3 client of the master and of every worker (it
    was read by nothing: only AWS_ENDPOINT_URL worked)."""
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    _run(f"s3://{moto.bucket}/ep-{tmp_path.name}", None, {"endpoint_url": moto.endpoint})


def test_an_s3fs_error_raised_from_a_botocore_4xx_is_not_retried():
    """s3fs re-raises botocore's ClientError as a plain OSError "from" it: the status is found
    on the cause (a 400 / 413 was retried 6 times through s3://)."""
    from speedtronic.diloco.store_contract import TransientStoreError
    from speedtronic.diloco.store_remote import translate_http_error

    class ClientError(Exception):
        def __init__(self, status: int) -> None:
            super().__init__(f"HTTP {status}")
            self.response = {"ResponseMetadata": {"HTTPStatusCode": status}}

    def from_s3fs(status: int) -> OSError:
        try:
            try:
                raise ClientError(status)
            except ClientError as inner:
                raise OSError(22, "refused") from inner
        except OSError as exc:
            return exc

    for status in (400, 413):
        err = translate_http_error(from_s3fs(status), "put k")
        assert isinstance(err, StoreError) and not isinstance(err, TransientStoreError)
        assert f"HTTP {status}, refused by the server" in str(err)
    assert isinstance(translate_http_error(from_s3fs(503), "put k"), TransientStoreError)
    assert isinstance(translate_http_error(from_s3fs(403), "put k"), AccessDenied)


def test_a_missing_bucket_and_missing_credentials_are_named_and_not_retried():
    from speedtronic.diloco.store_contract import TransientStoreError
    from speedtronic.diloco.store_remote import translate_http_error

    missing = FileNotFoundError(2, "The specified bucket does not exist")
    err = translate_http_error(missing, "get global/latest.json")
    assert "the bucket does not exist" in str(err) and not isinstance(err, TransientStoreError)
    assert not isinstance(err, ObjectNotFound)  # not "no pointer yet": waiting cannot help

    class NoCredentialsError(Exception):
        pass

    err = translate_http_error(NoCredentialsError("Unable to locate credentials"), "put k")
    assert isinstance(err, AccessDenied) and "AWS_ACCESS_KEY_ID" in str(err)
