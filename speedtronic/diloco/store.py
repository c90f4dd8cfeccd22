"""Opening a DiLoCo store from a URL, and the retry and outage layers around every back end.

The contract itself (errors, keys, the :class:`Store` API, documented there) lives in
:mod:`.store_contract` and is re-exported here; every DiLoCo component talks to storage only
through it. :func:`open_store` picks the back end from the URL (``file://`` ->
:class:`DirectoryStore`, ``s3://`` -> :class:`S3Store`, ``hf://`` -> :class:`HfStore`).

Back ends raise :class:`TransientStoreError` for what may succeed later (timeouts, 408, 425,
429, 5xx); :class:`RetryingStore` retries exactly those with exponential backoff and full jitter,
honouring ``Retry-After``, and never retries another 4xx answer or a precondition failure.
Retries sleep, so they must not run on the training thread while it trains: the worker and
master call the store from their own threads (see node.py / master.py).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlparse

from .._renamed import renamed
from ..config import DistributedConfig
from ..config.scaling import check_store_url
from .store_contract import (
    AccessDenied,
    ObjectExists,
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    Store,
    StoreError,
    StoreUnavailable,
    TransientStoreError,
    check_key,
)
from .store_file import DirectoryStore
from .store_remote import HfStore, S3Store

logger = logging.getLogger("speedtronic.diloco.store")

T = TypeVar("T")

@dataclass
class RetryPolicy:
    """Exponential backoff with full jitter: attempt i sleeps U(0, min(max_delay, base * 2**i)),
    or at least the server's ``Retry-After`` (capped at ``max_retry_after``)."""

    attempts: int = 6
    base_delay: float = 0.5
    max_delay: float = 30.0
    max_retry_after: float = 300.0

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random) -> float:
        """Seconds to sleep after failed attempt ``attempt`` (0-based): the jittered backoff
        drawn from ``rng``, or the server's ``retry_after`` (capped) when that is longer."""
        backoff = rng.uniform(0.0, min(self.max_delay, self.base_delay * (2 ** attempt)))
        if retry_after is not None:
            return max(backoff, min(retry_after, self.max_retry_after))
        return backoff


_NETWORK_ERRORS = (ConnectionError, TimeoutError)


class RetryingStore(Store):
    """Wraps a back end; retries transient failures. ``stop`` (an Event) aborts waits early."""

    def __init__(self, inner: Store, policy: RetryPolicy | None = None, *,
                 stop: threading.Event | None = None,
                 sleep: Callable[[float], None] | None = None, seed: int | None = None) -> None:
        self.inner = inner
        self.policy = policy or RetryPolicy()
        self.stop = stop or threading.Event()
        self._sleep = sleep
        self._rng = random.Random(seed)
        self.url = inner.url
        self.supports_cas = inner.supports_cas
        self.single_commit = getattr(inner, "single_commit", False)
        self.retries = 0  # total retried calls, for metrics

    def _wait(self, seconds: float) -> None:
        if self._sleep is not None:
            self._sleep(seconds)
        elif self.stop.wait(seconds):
            raise StoreUnavailable("store call abandoned: shutting down")

    def _call(self, op: str, fn: Callable[[], T]) -> T:
        last: Exception | None = None
        for attempt in range(self.policy.attempts):
            if attempt and self.stop.is_set():
                break
            try:
                return fn()
            except TransientStoreError as exc:
                last, retry_after = exc, exc.retry_after
            except _NETWORK_ERRORS as exc:
                last, retry_after = exc, None
            if attempt + 1 < self.policy.attempts:
                delay = self.policy.delay(attempt, retry_after, self._rng)
                self.retries += 1
                logger.debug("store %s failed (%s); retry %d in %.2fs", op, last, attempt + 1,
                             delay)
                self._wait(delay)
        raise StoreUnavailable(f"{op} on {self.url} failed after {self.policy.attempts} "
                               f"attempts: {last}") from last

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        first = [True]

        def attempt() -> None:
            try:
                self.inner.put(key, data, if_absent=if_absent)
            except ObjectExists:
                # A retried create-only put whose first try landed (the reply was lost) finds its
                # own bytes: that is success, not a conflict.
                if not first[0] and self.inner.get(key) == data:
                    return
                raise
            finally:
                first[0] = False

        self._call(f"put {key}", attempt)

    def get(self, key: str) -> bytes:
        return self._call(f"get {key}", lambda: self.inner.get(key))

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        return self._call(f"get {key}", lambda: self.inner.get_with_etag(key))

    def stat(self, key: str) -> ObjectInfo | None:
        return self._call(f"stat {key}", lambda: self.inner.stat(key))

    def list(self, prefix: str = "") -> list[str]:
        return self._call(f"list {prefix}", lambda: self.inner.list(prefix))

    def delete(self, key: str) -> None:
        self._call(f"delete {key}", lambda: self.inner.delete(key))

    def delete_many(self, keys: list[str]) -> None:
        if keys:
            self._call(f"delete {len(keys)} keys", lambda: self.inner.delete_many(keys))

    def swap(self, key: str, data: bytes, expected_etag: str | None) -> str:
        return self._call(f"swap {key}", lambda: self.inner.swap(key, data, expected_etag))

    def commit(self, objects: dict[str, bytes], pointer: tuple[str, bytes, str | None]) -> str:
        if type(self.inner).commit is Store.commit:
            # Per-object retries: a retry must not redo objects that already landed.
            for key, data in objects.items():
                self.put(key, data, if_absent=True)
            return self.swap(*pointer)
        return self._call(f"commit {pointer[0]}", lambda: self.inner.commit(objects, pointer))


class OutageStore(Store):
    """Chaos wrapper: every call fails with a transient error while ``flag_path`` exists.

    Enabled only through ``SPEEDTRONIC_DILOCO_OUTAGE_FILE`` (used by the fault tests to take the
    store away for a while without touching the data).
    """

    def __init__(self, inner: Store, flag_path: str) -> None:
        self.inner, self.flag = inner, flag_path
        self.url, self.supports_cas = inner.url, inner.supports_cas
        self.single_commit = getattr(inner, "single_commit", False)

    def _check(self) -> None:
        if os.path.exists(self.flag):
            raise TransientStoreError("store unavailable (simulated outage)")

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self._check()
        self.inner.put(key, data, if_absent=if_absent)

    def get(self, key: str) -> bytes:
        self._check()
        return self.inner.get(key)

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        self._check()
        return self.inner.get_with_etag(key)

    def stat(self, key: str) -> ObjectInfo | None:
        self._check()
        return self.inner.stat(key)

    def list(self, prefix: str = "") -> list[str]:
        self._check()
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self._check()
        self.inner.delete(key)

    def swap(self, key: str, data: bytes, expected_etag: str | None) -> str:
        self._check()
        return self.inner.swap(key, data, expected_etag)

    def delete_many(self, keys: list[str]) -> None:
        self._check()
        self.inner.delete_many(keys)

    def commit(self, objects: dict[str, bytes], pointer: tuple[str, bytes, str | None]) -> str:
        self._check()
        return self.inner.commit(objects, pointer)


def open_store(url: str, *, retry: RetryPolicy | None = None,
               stop: threading.Event | None = None, **backend_kwargs: Any) -> RetryingStore:
    """Open ``file:///path``, ``s3://bucket/prefix`` or ``hf://user/repo`` behind the retry layer.

    Credentials are read by the back ends from the environment only (AWS_* / HF_TOKEN).
    ``backend_kwargs`` go to the back end (``endpoint_url`` for ``s3://``).
    """
    check_store_url(url, credentials=True)  # the config's rule, credentials refused here
    parsed = urlparse(url)
    if parsed.scheme == "file":
        inner: Store = DirectoryStore(parsed.path)
    elif parsed.scheme == "s3":
        inner = S3Store(url, **backend_kwargs)
    elif parsed.scheme == "hf":
        inner = HfStore(url, **backend_kwargs)
    else:
        raise ValueError(f"distributed.store: unsupported URL {url!r}; use file:///path, "
                         "s3://bucket/prefix or hf://user/repo")
    outage = os.environ.get("SPEEDTRONIC_DILOCO_OUTAGE_FILE")
    if outage:
        inner = OutageStore(inner, outage)
    return RetryingStore(inner, retry, stop=stop)


def probe_conditional_writes(store: Store, node_id: str) -> None:
    """Check that the store really refuses a second create-only put and a swap with a stale
    etag. Old client libraries drop those conditions silently (create-only and compare-and-swap
    become plain overwrites), which would let two masters overwrite each other's work; a master
    must not run on such a store. Raises StoreError saying which check failed."""
    key = check_key(f"probe/{node_id}-{os.getpid()}-{random.getrandbits(32):08x}")
    try:
        store.put(key, b"first", if_absent=True)
        try:
            store.put(key, b"second", if_absent=True)
        except ObjectExists:
            pass
        else:
            raise StoreError(f"{store.url}: a second create-only put of {key!r} succeeded: the "
                             "store (or its client library) ignores If-None-Match; upgrade "
                             "s3fs/botocore (pip install 'speedtronic[s3]') before running a "
                             "master on it")
        data, etag = store.get_with_etag(key)
        store.swap(key, b"third", etag)
        try:
            store.swap(key, b"fourth", etag)  # the etag is stale now
        except PreconditionFailed:
            pass
        else:
            raise StoreError(f"{store.url}: a swap with a stale etag succeeded: the store (or "
                             "its client library) ignores If-Match; upgrade it before running a "
                             "master on it")
    finally:
        try:
            store.delete(key)
        except StoreError:
            pass


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until true or ``timeout`` seconds pass (monotonic clock)."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def open_configured_store(cfg: DistributedConfig,
                          stop: threading.Event | None = None) -> RetryingStore:
    """The store a ``distributed`` config section names, with its ``endpoint_url`` (s3://)."""
    if cfg.store is None:
        raise ValueError("distributed.store is not set (file:///path, s3://bucket/prefix or "
                         "hf://user/repo)")
    kwargs = {"endpoint_url": cfg.endpoint_url} if cfg.endpoint_url else {}
    return open_store(cfg.store, stop=stop, **kwargs)


__all__ = ["AccessDenied", "DirectoryStore", "HfStore", "ObjectExists", "ObjectInfo",
           "ObjectNotFound", "PreconditionFailed", "RetryPolicy", "RetryingStore", "S3Store",
           "Store", "StoreError", "StoreUnavailable", "TransientStoreError", "check_key",
           "open_configured_store", "open_store", "probe_conditional_writes", "wait_for"]


# Renamed in 2.1: ``FileStore`` was also the name of a data class (now TextFileStore).
__getattr__ = renamed(__name__, "FileStore", "DirectoryStore", DirectoryStore)

