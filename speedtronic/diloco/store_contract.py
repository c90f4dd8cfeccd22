"""The one narrow object-store contract for DiLoCo: its errors, keys and the :class:`Store` API.

Back ends (``store_file``, ``store_remote``) import this module; :mod:`.store` puts the retry
layer around them and opens them from a URL.

Every DiLoCo component talks to storage only through :class:`Store`:

* ``put(key, data, if_absent=False)`` - atomic (readers see all or nothing); ``if_absent`` makes
  it create-only and raises :class:`ObjectExists` when the key is taken;
* ``get(key)``, ``stat(key)`` (``None`` when missing), ``list(prefix)``, ``delete(key)``;
* ``swap(key, data, expected_etag)`` - compare-and-swap of a small pointer object
  (``expected_etag=None`` means "must not exist"); raises :class:`PreconditionFailed`;
* ``commit(objects, pointer)`` - write immutable objects, then swap the pointer (the Hub back end
  does all of it in one commit).

Back ends raise :class:`TransientStoreError` for what may succeed later (timeouts, 429, 5xx);
:class:`RetryingStore` retries exactly those with exponential backoff and full jitter, honouring
``Retry-After``, and never retries 401/403/404 or precondition failures. Retries sleep, so
they must never run on the training thread: the worker and master call the store from their
own threads (see node.py / master.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import SpeedtronicError

__all__ = ["AccessDenied", "ObjectExists", "ObjectInfo", "ObjectNotFound", "PreconditionFailed",
           "Store", "StoreError", "StoreUnavailable", "TransientStoreError", "check_key"]

_KEY_RE = re.compile(r"[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*")


class StoreError(SpeedtronicError):
    """Base class of store failures."""


class TransientStoreError(StoreError):
    """A failure that may go away (timeout, connection reset, HTTP 429/5xx)."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class StoreUnavailable(StoreError):
    """Retries were exhausted (or the caller asked to stop) for a transient failure."""


class ObjectNotFound(StoreError, FileNotFoundError):
    """The key does not exist (HTTP 404). Never retried."""


class AccessDenied(StoreError, PermissionError):
    """Credentials are missing or lack permission (HTTP 401/403). Never retried."""


class ObjectExists(StoreError, FileExistsError):
    """A create-only put found the key already taken."""


class PreconditionFailed(StoreError):
    """A conditional pointer swap lost the race (the etag changed)."""


@dataclass(frozen=True)
class ObjectInfo:
    """What ``stat`` returns: the key, its size in bytes and an opaque version tag."""

    key: str
    size: int
    etag: str


def check_key(key: str) -> str:
    """Reject keys that could escape the store root or be misread by a back end."""
    if not _KEY_RE.fullmatch(key) or any(part in (".", "..") for part in key.split("/")):
        raise ValueError(f"invalid store key {key!r}: use [A-Za-z0-9_.-] segments joined by '/'")
    return key


class Store:
    """The contract every back end implements (see the module docstring)."""

    supports_cas: bool = True
    """Whether ``swap`` is a real compare-and-swap on this back end."""

    url: str = ""

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        """Store ``data`` under ``key`` atomically: readers see the old object or the whole new one,
        never a part. ``if_absent``: create-only, raising :class:`ObjectExists` when the key is
        taken (immutable globals and deltas rely on it); otherwise overwrite."""
        raise NotImplementedError

    def get(self, key: str) -> bytes:
        """The whole object's bytes; raises :class:`ObjectNotFound` when the key is missing (never
        retried: it is an answer, not a failure)."""
        raise NotImplementedError

    def stat(self, key: str) -> ObjectInfo | None:
        """The key's size and an opaque version tag, or None when it is missing (not an error). The
        tag need not be the etag :meth:`swap` takes: :meth:`get_with_etag` gives that one."""
        raise NotImplementedError

    def list(self, prefix: str = "") -> list[str]:
        """The keys of all objects whose key starts with ``prefix`` (a string prefix, not only a
        folder), sorted; no temporary or lock files, and ``[]`` when nothing matches."""
        raise NotImplementedError

    def delete(self, key: str) -> None:
        """Remove ``key``; a key that is already gone is not an error, so a retried delete (whose
        first try landed) succeeds."""
        raise NotImplementedError

    def delete_many(self, keys: list[str]) -> None:
        """Delete several keys (one commit on the Hub back end)."""
        for key in keys:
            self.delete(key)

    def swap(self, key: str, data: bytes, expected_etag: str | None) -> str:
        """Replace ``key`` only if its etag is ``expected_etag`` (None: only if absent).

        Returns the new etag.
        """
        raise NotImplementedError

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        """Read a small object together with the etag a later ``swap`` must name."""
        raise NotImplementedError

    def commit(self, objects: dict[str, bytes], pointer: tuple[str, bytes, str | None]) -> str:
        """Write immutable ``objects`` (create-only), then swap the pointer; returns its etag."""
        for key, data in objects.items():
            self.put(key, data, if_absent=True)
        key, data, expected = pointer
        return self.swap(key, data, expected)
