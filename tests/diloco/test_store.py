"""The store contract on the file:// back end (diloco/store_file.py), the retry layer and URL
parsing (diloco/store.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from harness import initial_weights, make_cfg  # noqa: E402

from speedtronic.diloco.store import (  # noqa: E402
    AccessDenied,
    DirectoryStore,
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
    s = DirectoryStore(tmp_path / "root")
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
    s = DirectoryStore(tmp_path)
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
    flaky = Flaky(DirectoryStore(tmp_path), 2, TransientStoreError("429", retry_after=7.0))
    s = RetryingStore(flaky, policy, sleep=sleeps.append, seed=0)
    s.put("k", b"v")
    assert s.get("k") == b"v" and sleeps == [7.0, 7.0]  # Retry-After wins over the backoff
    sleeps.clear()
    s = RetryingStore(Flaky(DirectoryStore(tmp_path), 10, TimeoutError("slow")), policy,
                      sleep=sleeps.append, seed=0)
    with pytest.raises(StoreUnavailable):
        s.get("k")
    assert len(sleeps) == 3 and all(0 <= d <= min(1.0, 0.1 * 2 ** i) for i, d in
                                    enumerate(sleeps))  # full jitter under the cap
    for permanent in (ObjectNotFound("404"), AccessDenied("403")):
        sleeps.clear()
        flaky = Flaky(DirectoryStore(tmp_path), 10, permanent)
        with pytest.raises(type(permanent)):
            RetryingStore(flaky, policy, sleep=sleeps.append).get("k")
        assert flaky.calls == 1 and sleeps == []


def test_retried_create_only_put_that_landed_is_success(tmp_path):
    inner = DirectoryStore(tmp_path)
    s = RetryingStore(Flaky(inner, 1, TransientStoreError("reset"), land_first=True),
                      RetryPolicy(attempts=3), sleep=lambda _: None)
    s.put("d", b"payload", if_absent=True)
    assert inner.get("d") == b"payload"


def test_store_url_parsing(tmp_path):
    assert open_store(f"file://{tmp_path}").url == f"file://{tmp_path}"
    with pytest.raises(ValueError, match="credentials"):
        open_store("s3://AKIA:secret@bucket/x")
    with pytest.raises(ValueError, match="must be file:///path, s3://bucket/prefix or hf://user/repo"):
        open_store("ftp://x/y")


def test_file_store_refuses_symbolic_links_below_its_root(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(b"not yours")
    root = tmp_path / "root"
    s = DirectoryStore(root)
    (root / "global").mkdir()
    (root / "global" / "v1.safetensors").symlink_to(outside / "secret.txt")
    (root / "deltas").symlink_to(outside, target_is_directory=True)
    with pytest.raises(AccessDenied, match="symbolic link"):
        s.get("global/v1.safetensors")
    with pytest.raises(AccessDenied, match="symbolic link"):
        s.put("deltas/secret.txt", b"overwritten")
    with pytest.raises(AccessDenied, match="symbolic link"):
        s.delete("deltas/secret.txt")
    assert (outside / "secret.txt").read_bytes() == b"not yours"
    assert s.list() == []  # links are not objects of the store


@pytest.mark.parametrize("url", ["s3://AKIAEXAMPLE:abc/def+ghi@bucket/prefix",
                                 "s3://AKIAEXAMPLE:plain@bucket/prefix",
                                 "hf://user:hf_token@user/repo"])
def test_credentials_inside_a_store_url_are_refused_without_echoing_them(url):
    with pytest.raises(ValueError, match="must not carry credentials") as info:
        open_store(url)
    assert "abc" not in str(info.value) and "plain" not in str(info.value)
    assert "hf_token@" not in str(info.value)


@pytest.mark.parametrize("url", ["file://", "file:", "file://relative/dir",
                                 "file:///tmp/store?x=1", "file:///tmp/store#part"])
def test_a_file_url_without_an_absolute_path_alone_is_refused(url, tmp_path, monkeypatch):
    """"file://" once stored into the current directory, and "?..." / "#..." were dropped."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="file URLs need an absolute path"):
        open_store(url)
    assert list(tmp_path.iterdir()) == []


class _IgnoresConditions(DirectoryStore):
    """A store whose client drops If-None-Match / If-Match, as old s3fs/botocore do."""

    def __init__(self, root, ignore: str) -> None:
        super().__init__(root)
        self.ignore = ignore

    def put(self, key, data, *, if_absent=False):
        super().put(key, data, if_absent=if_absent and self.ignore != "create")

    def swap(self, key, data, expected_etag):
        if self.ignore == "match":
            self.put(key, data)
            return "etag"
        return super().swap(key, data, expected_etag)


def test_conditional_write_probe_passes_on_a_real_store_and_leaves_nothing(tmp_path):
    from speedtronic.diloco.store import probe_conditional_writes

    s = DirectoryStore(tmp_path)
    probe_conditional_writes(s, "m0")
    assert s.list() == []


@pytest.mark.parametrize("ignore, what", [("create", "If-None-Match"), ("match", "If-Match")])
def test_a_master_refuses_a_store_that_ignores_conditional_writes(tmp_path, ignore, what):
    from speedtronic.diloco.service import MasterThread
    from speedtronic.diloco.store import StoreError, probe_conditional_writes

    lying = _IgnoresConditions(tmp_path / "s", ignore)
    with pytest.raises(StoreError, match=what):
        probe_conditional_writes(lying, "m0")
    assert lying.list() == []
    thread = MasterThread(make_cfg(f"file://{tmp_path}/s"), "m0", lambda: initial_weights())
    thread.store = lying  # what open_store would have returned for such a client
    thread.start()
    assert thread.join(10)
    assert isinstance(thread.error, StoreError) and what in str(thread.error)
    assert lying.stat("global/latest.json") is None  # it never published anything


def test_a_store_folder_that_cannot_be_created_is_one_user_error(tmp_path):
    from speedtronic.diloco.store import StoreError

    a_file = tmp_path / "plain"
    a_file.write_text("x")
    with pytest.raises(StoreError, match=r"distributed.store: cannot create the store folder"):
        open_store(f"file://{a_file}/store")
    from speedtronic.diloco.__main__ import main

    cfg = tmp_path / "m.yaml"
    cfg.write_text(f"distributed: {{enabled: true, role: master, store: 'file://{a_file}/s'}}\n")
    assert main(["master", "--config", str(cfg)]) == 2


def test_file_store_lists_below_the_prefix_folder_and_delete_leaves_no_lock(tmp_path):
    import os

    from speedtronic.diloco.store import open_store, probe_conditional_writes

    store = open_store(f"file://{tmp_path}")
    for key in ("nodes/a/s/d1", "global/v1", "top", "nodesx/q"):
        store.put(key, b"x")
    assert store.list("nodes/") == ["nodes/a/s/d1"]
    assert store.list("nodes") == ["nodes/a/s/d1", "nodesx/q"]
    assert store.list("global/v") == ["global/v1"] and store.list("no/such/") == []
    assert store.list("../") == []  # not a way out of the store's folder
    probe_conditional_writes(store, "m")  # a create-only put, a swap (with its lock), a delete
    left = sorted(f for _, _, files in os.walk(tmp_path) for f in files)
    assert left == ["d1", "q", "top", "v1"]  # the probe's object and its .lock- file are gone


def test_file_store_turns_an_os_error_on_the_key_path_into_a_store_error(tmp_path, monkeypatch):
    """A permission or NFS error while checking the key's path for links escaped put and swap
    as a raw OSError, which the worker's upload thread and the master did not survive."""
    import errno
    from pathlib import Path

    from speedtronic.diloco.store import AccessDenied, StoreError, open_store

    store = open_store(f"file://{tmp_path}")
    real = Path.is_symlink

    def failing(self):
        if self.name == "nodes":
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(self)

    monkeypatch.setattr(Path, "is_symlink", failing)
    with pytest.raises(AccessDenied):
        store.put("nodes/w0/s/d1", b"x")
    with pytest.raises(StoreError):
        store.swap("nodes/w0/pointer", b"x", None)


def test_without_fcntl_the_package_imports_and_a_file_store_is_one_user_error(tmp_path):
    """Windows has no fcntl: ``import speedtronic.diloco`` failed with ModuleNotFoundError
    (store_file imported it at the top), for every user of the package, DiLoCo or not."""
    import subprocess

    code = ("import sys; sys.modules['fcntl'] = None\n"
            "import speedtronic.diloco\n"
            "from speedtronic.diloco.__main__ import main\n"
            f"open({str(tmp_path / 'm.yaml')!r}, 'w').write(\"distributed: {{enabled: true, "
            f"role: master, store: 'file://{tmp_path}/s'}}\\n\")\n"
            f"sys.exit(main(['master', '--config', {str(tmp_path / 'm.yaml')!r}]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "file:// store needs POSIX file locks (fcntl)" in done.stderr
    assert "Traceback" not in done.stderr
