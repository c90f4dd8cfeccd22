"""Remote back ends of the store contract: ``s3://`` through s3fs and ``hf://`` through
huggingface_hub. Both translate their native errors into the store's classes (store.py) so one
retry layer governs them; their own internal retries are turned down to one attempt.

S3 (AWS, MinIO, R2, Ceph, Hugging Face buckets' S3 gateway): PUT is atomic (a multipart object
appears only on completion); create-only uses ``If-None-Match: *`` and the pointer swap
``If-Match: <etag>`` (HTTP 412 on conflict). Where a gateway ignores conditional headers, the
lease and the pointer epoch still fence a second master only as well as the store allows.

Hugging Face repos: every write is a commit. The master writes weights + state + pointer in ONE
commit (``single_commit``), conditional on the parent commit, so readers never pair new weights
with an old pointer. The Hub rate-limits commits (a free repo answered 429 after 128 commits per
hour), so with N workers keep ``N / (H * step_time) + 1 / poll`` well under 2 per minute, or use a
bucket through ``s3://`` instead.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..config.scaling import check_store_url
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

logger = logging.getLogger("speedtronic.diloco.store")


def _retry_after(headers: Any) -> float | None:
    try:
        value = headers.get("Retry-After") if headers is not None else None
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _http_status(exc: BaseException | None) -> tuple[int | None, Any]:
    """``(status, response)`` of an httpx/requests/botocore-style exception, else (None, None)."""
    resp = getattr(exc, "response", None)
    status = getattr(resp, "status_code", None)
    if status is None and isinstance(resp, dict):  # botocore ClientError
        status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status, resp


def translate_http_error(exc: BaseException, what: str) -> Exception:
    """Map an exception carrying ``.response.status_code`` (httpx/requests/botocore styles) or a
    plain network error onto the store's error classes."""
    if isinstance(exc, StoreError):
        return exc
    status, resp = _http_status(exc)
    if status is None:  # s3fs re-raises botocore's ClientError as an OSError "from" it
        status, resp = _http_status(exc.__cause__)
    headers = getattr(resp, "headers", None)
    text = f"{exc} {exc.__cause__ or ''}"
    if "NoSuchBucket" in text or "bucket does not exist" in text:
        # permanent, and no master creates buckets: a worker must not wait start_timeout on it
        return StoreError(f"{what}: the bucket does not exist (check distributed.store)")
    if type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
        return AccessDenied(f"{what}: no credentials found: set AWS_ACCESS_KEY_ID and "
                            "AWS_SECRET_ACCESS_KEY in the environment")
    # What s3fs already interpreted (a 412 on a create-only put is FileExistsError) comes first.
    if isinstance(exc, FileExistsError):
        return ObjectExists(f"{what}: already exists")
    if isinstance(exc, PermissionError):
        return AccessDenied(f"{what}: {exc}")
    if status in (401, 403):
        return AccessDenied(f"{what}: HTTP {status} (check the token/keys in the environment)")
    if status == 404 or isinstance(exc, FileNotFoundError):
        return ObjectNotFound(f"{what}: not found")
    if status in (409, 412):
        return PreconditionFailed(f"{what}: HTTP {status} conflict")
    if isinstance(status, int) and 400 <= status < 500 and status not in (408, 425, 429):
        # 400 bad request, 405, 413 too large, 422, ...: the same request fails again, so a
        # retry only delays the error (6 tries, up to 15.5 s of backoff, were measured).
        return StoreError(f"{what}: HTTP {status}, refused by the server (not retried): "
                          f"{str(exc)[:200]}")
    if isinstance(exc, (TypeError, AttributeError, KeyError, NameError)):
        return StoreError(f"{what}: {type(exc).__name__}: {exc}")  # a bug, not an outage
    if "PreconditionFailed" in text or "pre-conditions you specified did not hold" in text:
        return PreconditionFailed(f"{what}: precondition failed")
    # 408, 425, 429, 5xx, timeouts, refused/reset connections and anything unknown: worth a
    # bounded retry.
    return TransientStoreError(f"{what}: {type(exc).__name__}: {exc}", _retry_after(headers))


class S3Store(Store):
    """``s3://bucket/prefix``; keys live under ``prefix/``. Credentials: the AWS environment."""

    def __init__(self, url: str, endpoint_url: str | None = None, fs: Any = None) -> None:
        check_store_url(url)  # a bucket, nothing after the path
        parsed = urlparse(url)
        self.root = f"{parsed.netloc}/{parsed.path.strip('/')}".rstrip("/")
        self.url = url
        if fs is None:
            try:
                import s3fs
            except ImportError as exc:
                raise StoreError("s3:// stores need s3fs: pip install 'speedtronic[s3]'") from exc
            endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
            fs = s3fs.S3FileSystem(
                endpoint_url=endpoint, skip_instance_cache=True, use_listings_cache=False,
                # one attempt inside botocore: RetryingStore owns backoff and jitter
                config_kwargs={"connect_timeout": 10, "read_timeout": 120,
                               "retries": {"max_attempts": 1}})
        self.fs = fs

    def _p(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # every s3fs/botocore/aiohttp error is classified here
            raise translate_http_error(exc, what) from exc

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self._call(f"put {key}", self.fs.pipe_file, self._p(key), data,
                   mode="create" if if_absent else "overwrite")

    def get(self, key: str) -> bytes:
        return self._call(f"get {key}", self.fs.cat_file, self._p(key))

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            info = self._call(f"stat {key}", self.fs.info, self._p(key))
        except ObjectNotFound:
            return None
        if info.get("type") != "file":
            return None
        return ObjectInfo(key, int(info["size"]), str(info.get("ETag", "")).strip('"'))

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        for _ in range(5):  # stat, read, stat: the etag belongs to the bytes if both agree
            before = self.stat(key)
            if before is None:
                raise ObjectNotFound(f"get {key}: not found")
            data = self.get(key)
            after = self.stat(key)
            if after is not None and after.etag == before.etag:
                return data, before.etag
        raise TransientStoreError(f"get {key}: object kept changing while being read")

    def list(self, prefix: str = "") -> list[str]:
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        path = f"{self.root}/{base}".rstrip("/")
        self.fs.invalidate_cache()
        try:
            found = self._call(f"list {prefix}", self.fs.find, path)
        except ObjectNotFound:
            return []
        n = len(self.root) + 1
        return sorted(k[n:] for k in found if k[n:].startswith(prefix))

    def delete(self, key: str) -> None:
        try:
            self._call(f"delete {key}", self.fs.rm_file, self._p(key))
        except ObjectNotFound:
            pass

    def swap(self, key: str, data: bytes, expected_etag: str | None) -> str:
        if expected_etag is None:
            try:
                out = self._call(f"swap {key}", self.fs.pipe_file, self._p(key), data,
                                 mode="create")
            except ObjectExists as exc:
                raise PreconditionFailed(f"swap {key}: already exists") from exc
        else:
            out = self._call(f"swap {key}", self.fs.pipe_file, self._p(key), data,
                             IfMatch=f'"{expected_etag}"')
        etag = (out or {}).get("ETag") if isinstance(out, dict) else None
        if etag:
            return str(etag).strip('"')
        info = self.stat(key)
        return info.etag if info else ""


class HfStore(Store):
    """``hf://user/repo`` (a model repo). Token: ``HF_TOKEN`` in the environment (read by
    huggingface_hub itself; never passed through config)."""

    single_commit = True

    def __init__(self, url: str, api: Any = None, repo_type: str = "model") -> None:
        check_store_url(url)  # user/repo, nothing after it
        parsed = urlparse(url)
        repo_id = f"{parsed.netloc}{parsed.path}".strip("/")
        self.repo_id, self.repo_type, self.url = repo_id, repo_type, url
        if api is None:
            try:
                from huggingface_hub import HfApi
            except ImportError as exc:
                raise StoreError("hf:// stores need huggingface_hub: "
                                 "pip install 'speedtronic[hf]'") from exc
            api = HfApi()
        self.api = api
        self._created = False
        self._tmp = Path(tempfile.mkdtemp(prefix="speedtronic-hf-"))

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise translate_http_error(exc, what) from exc

    def _ops(self):
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete
        return CommitOperationAdd, CommitOperationDelete

    def _ensure_repo(self) -> None:
        if not self._created:
            self._call("create_repo", self.api.create_repo, self.repo_id,
                       repo_type=self.repo_type, private=True, exist_ok=True)
            self._created = True
            # A new repo is created private; an existing one keeps its visibility, and every
            # delta and global written to a public one is readable by anyone.
            info = self._call("repo_info", self.api.repo_info, self.repo_id,
                              repo_type=self.repo_type)
            if getattr(info, "private", None) is False:
                logger.warning("diloco store %s: the Hub repo is public, so every delta and "
                               "global written to it can be downloaded by anyone; make it "
                               "private in its settings unless that is intended", self.url)

    def _head(self) -> str:
        return self._call("repo_info", self.api.repo_info, self.repo_id,
                          repo_type=self.repo_type).sha

    def _commit(self, ops: list, message: str, parent: str | None) -> None:
        self._ensure_repo()
        self._call(message, self.api.create_commit, self.repo_id, operations=ops,
                   commit_message=message, repo_type=self.repo_type, parent_commit=parent)

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        add, _ = self._ops()
        check_key(key)
        self._ensure_repo()
        parent = self._head() if if_absent else None
        if if_absent and self.stat(key) is not None:
            raise ObjectExists(f"{key!r} already exists")
        try:
            self._commit([add(path_in_repo=key, path_or_fileobj=io.BytesIO(data))],
                         f"speedtronic: {key}", parent)
        except PreconditionFailed as exc:
            # The head moved (e.g. another node's commit): a transient conflict unless our key
            # appeared meanwhile.
            if if_absent and self.stat(key) is not None:
                raise ObjectExists(f"{key!r} already exists") from exc
            raise TransientStoreError(f"put {key}: concurrent commit, retrying") from exc

    def get(self, key: str) -> bytes:
        # A folder per call: hf_hub_download writes <local_dir>/<key>, and the poll thread and
        # the end of a run may fetch the pointer at once; one deleted the other's file before
        # it was read (FileNotFoundError, past every except that expects a StoreError).
        try:
            self._tmp.mkdir(parents=True, exist_ok=True)
            folder = tempfile.mkdtemp(dir=self._tmp)
        except OSError as exc:  # a full /tmp: a store error the callers expect, not a raw one
            raise TransientStoreError(f"get {key}: no local folder to download into ({exc})") \
                from exc
        try:
            path = self._call(f"get {key}", self.api.hf_hub_download, self.repo_id,
                              check_key(key), repo_type=self.repo_type, local_dir=folder,
                              force_download=True)
            return Path(path).read_bytes()
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            infos = self._call(f"stat {key}", self.api.get_paths_info, self.repo_id,
                               [check_key(key)], repo_type=self.repo_type)
        except ObjectNotFound:
            return None
        for info in infos:
            if info.path == key and hasattr(info, "size"):
                return ObjectInfo(key, int(info.size), str(getattr(info, "blob_id", "")))
        return None

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        data = self.get(key)
        return data, hashlib.sha256(data).hexdigest()

    def list(self, prefix: str = "") -> list[str]:
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else None
        try:
            entries = self._call(f"list {prefix}", lambda: list(self.api.list_repo_tree(
                self.repo_id, path_in_repo=base, recursive=True, repo_type=self.repo_type)))
        except ObjectNotFound:
            return []
        return sorted(e.path for e in entries if hasattr(e, "size") and e.path.startswith(prefix))

    def delete(self, key: str) -> None:
        self.delete_many([key])

    def delete_many(self, keys: list[str]) -> None:
        _, delete = self._ops()
        present = [k for k in keys if self.stat(k) is not None]
        if present:
            self._commit([delete(path_in_repo=k) for k in present],
                         f"speedtronic: delete {len(present)} objects", None)

    def _check_pointer(self, key: str, expected: str | None) -> str:
        parent = self._head()
        try:
            current = hashlib.sha256(self.get(key)).hexdigest()
        except ObjectNotFound:
            current = None
        if current != expected:
            raise PreconditionFailed(f"{key}: etag is {current}, expected {expected}")
        return parent

    def swap(self, key: str, data: bytes, expected_etag: str | None) -> str:
        return self.commit({}, (key, data, expected_etag))

    def commit(self, objects: dict[str, bytes], pointer: tuple[str, bytes, str | None]) -> str:
        add, _ = self._ops()
        key, data, expected = pointer
        self._ensure_repo()
        parent = self._check_pointer(key, expected)
        ops = [add(path_in_repo=check_key(k), path_or_fileobj=io.BytesIO(v))
               for k, v in objects.items()]
        ops.append(add(path_in_repo=check_key(key), path_or_fileobj=io.BytesIO(data)))
        try:
            self._commit(ops, f"speedtronic: publish {key}", parent)
        except PreconditionFailed as exc:
            # Another commit landed first; retry (RetryingStore) re-checks the pointer itself.
            raise TransientStoreError(f"commit {key}: concurrent commit, retrying") from exc
        return hashlib.sha256(data).hexdigest()
