"""``file:///path``: the DiLoCo store on a local or shared directory (NFS, Lustre, FUSE mounts).

The contract it implements is in store.py; this file holds only how a POSIX filesystem gives
atomic, create-only and compare-and-swap writes.
"""

from __future__ import annotations

import errno
import hashlib
import os
import uuid
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: this store is refused when made, the package still imports
    fcntl = None  # type: ignore[assignment]

from .faults import crash_point
from .store_contract import (
    AccessDenied,
    ObjectExists,
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    Store,
    StoreError,
    TransientStoreError,
    check_key,
)

# Errnos that a shared filesystem (NFS, Lustre, FUSE mounts) returns for conditions that clear.
_TRANSIENT_ERRNOS = {errno.EIO, errno.ETIMEDOUT, errno.ESTALE, errno.EAGAIN, errno.EBUSY,
                     errno.ENOSPC, errno.EDQUOT, errno.ECONNRESET, errno.EHOSTUNREACH}


class DirectoryStore(Store):
    """``file:///path``: a local or shared directory (NFS, Lustre, FUSE-mounted buckets).

    Atomic put = write ``.tmp-*`` in the target directory, fsync, then ``rename`` (replace) or
    ``link`` (create-only: link fails with EEXIST, which NFS also guarantees); the directory is
    fsynced so the name survives a crash. Swap holds a POSIX ``lockf`` lock (NFS lockd) around
    read-compare-write. The etag is the sha256 of the content (pointer objects are tiny).
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if fcntl is None:
            raise StoreError("distributed.store: a file:// store needs POSIX file locks "
                             "(fcntl), which this platform lacks; run this node on Linux or "
                             "macOS, or use an s3:// store")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"distributed.store: cannot create the store folder {self.root} "
                             f"({exc.strerror or exc}); give a folder this process can "
                             "write") from None
        self.url = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        """The file of ``key``, refusing symbolic links anywhere below the root: a link planted
        in a shared directory would otherwise read or overwrite a file outside the store."""
        cur = self.root
        for part in check_key(key).split("/"):
            cur = cur / part
            try:
                is_link = cur.is_symlink()
            except OSError as exc:  # EACCES / EIO / ESTALE: a store error, never a raw one
                raise self._translate(exc, key) from exc
            if is_link:
                raise AccessDenied(f"{key!r}: {cur} is a symbolic link; the file store refuses "
                                   f"links below its root {self.root}")
        return cur

    @staticmethod
    def _translate(exc: OSError, key: str) -> Exception:
        if isinstance(exc, FileNotFoundError):
            return ObjectNotFound(f"no object {key!r}")
        if isinstance(exc, PermissionError):
            return AccessDenied(f"permission denied for {key!r}: {exc}")
        if exc.errno in _TRANSIENT_ERRNOS:
            return TransientStoreError(f"{key!r}: {exc}")
        return StoreError(f"{key!r}: {exc}")

    def _write_tmp(self, path: Path, data: bytes) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".tmp-{path.name}-{uuid.uuid4().hex[:12]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            # A full disk (retried as transient) left each attempt's partial file behind: the
            # space never came back, and nothing removes .tmp-* files later.
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        return tmp

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        path = self._path(key)
        tmp = None
        try:
            tmp = self._write_tmp(path, data)
            crash_point("store_tmp_written")  # a crash here leaves only an unlisted .tmp- file
            if if_absent:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise ObjectExists(f"{key!r} already exists") from None
            else:
                os.replace(tmp, path)
                tmp = None
            self._fsync_dir(path.parent)
        except StoreError:
            raise
        except OSError as exc:
            raise self._translate(exc, key) from exc
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except OSError as exc:
            raise self._translate(exc, key) from exc

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        data = self.get(key)
        return data, hashlib.sha256(data).hexdigest()

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            st = self._path(key).stat()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._translate(exc, key) from exc
        return ObjectInfo(key, st.st_size, f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}")

    def list(self, prefix: str = "") -> list[str]:
        out: list[str] = []
        # Walk only below the prefix's folder ("nodes/" never reads global/ or master/).
        folders = prefix.split("/")[:-1]
        safe = all(part not in ("", ".", "..") for part in folders)
        start = self.root.joinpath(*folders) if safe else self.root
        try:
            for dirpath, _dirs, files in os.walk(start):  # never descends into dir links
                rel = Path(dirpath).relative_to(self.root).as_posix()
                for name in files:
                    if name.startswith(".tmp-") or name.startswith(".lock"):
                        continue
                    if os.path.islink(os.path.join(dirpath, name)):
                        continue  # not an object of this store (see _path)
                    key = name if rel == "." else f"{rel}/{name}"
                    if key.startswith(prefix):
                        out.append(key)
        except OSError as exc:
            raise self._translate(exc, prefix) from exc
        return sorted(out)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
            # the lock file of a key once swapped (the master's probe key left one per start)
            (path.parent / f".lock-{path.name}").unlink(missing_ok=True)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self._translate(exc, key) from exc

    def swap(self, key: str, data: bytes, expected_etag: str | None) -> str:
        path = self._path(key)
        lock_path = path.parent / f".lock-{path.name}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise self._translate(exc, key) from exc
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            try:
                current = hashlib.sha256(path.read_bytes()).hexdigest()
            except FileNotFoundError:
                current = None
            if current != expected_etag:
                raise PreconditionFailed(f"{key!r}: etag is {current}, expected {expected_etag}")
            self.put(key, data)
            return hashlib.sha256(data).hexdigest()
        except StoreError:
            raise
        except OSError as exc:
            raise self._translate(exc, key) from exc
        finally:
            os.close(fd)  # releases the lock
