"""Test doubles for remote stores: an in-memory object with HfApi's methods (commits, parent
commit checks, injected HTTP failures) and a moto S3 server on loopback."""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any


class FakeHTTPError(Exception):
    """Shaped like huggingface_hub's HfHubHTTPError: ``.response.status_code`` and headers."""

    def __init__(self, status: int, retry_after: float | None = None) -> None:
        super().__init__(f"HTTP {status}")
        headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
        self.response = SimpleNamespace(status_code=status, headers=headers)


@dataclass
class FakeHfApi:
    """In-memory Hub repo with the HfApi methods HfStore uses. ``fail`` is a list of
    (method name, status, retry_after) consumed in order by matching calls."""

    files: dict[str, bytes] = field(default_factory=dict)
    commits: list[str] = field(default_factory=lambda: ["0" * 40])
    fail: list[tuple[str, int, float | None]] = field(default_factory=list)
    lose_reply: list[str] = field(default_factory=list)
    """Commit-message fragments: the next commit whose message holds one takes effect and then
    fails with a 503, as when the reply to a request that landed is lost on the way back."""
    calls: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    private: bool | None = True
    """What ``repo_info`` says of the repo's visibility (None: the field is absent)."""

    def _enter(self, name: str) -> None:
        with self.lock:
            self.calls[name] = self.calls.get(name, 0) + 1
            for i, (method, status, ra) in enumerate(self.fail):
                if method == name:
                    del self.fail[i]
                    raise FakeHTTPError(status, ra)

    def create_repo(self, repo_id: str, **kw: Any) -> str:
        self._enter("create_repo")
        return f"https://hf.co/{repo_id}"

    def repo_info(self, repo_id: str, **kw: Any) -> Any:
        self._enter("repo_info")
        return SimpleNamespace(sha=self.commits[-1], private=self.private)

    def create_commit(self, repo_id: str, operations: list, *, commit_message: str,
                      parent_commit: str | None = None, **kw: Any) -> Any:
        self._enter("create_commit")
        with self.lock:
            if parent_commit is not None and parent_commit != self.commits[-1]:
                raise FakeHTTPError(412)
            for op in operations:
                if type(op).__name__ == "CommitOperationDelete":
                    if op.path_in_repo not in self.files:
                        raise FakeHTTPError(404)
                    del self.files[op.path_in_repo]
                else:
                    src = op.path_or_fileobj
                    data = src.getvalue() if hasattr(src, "getvalue") else Path(src).read_bytes()
                    self.files[op.path_in_repo] = data
            self.commits.append(hashlib.sha1(f"{len(self.commits)}{commit_message}".encode())
                                .hexdigest())
            lost = next((f for f in self.lose_reply if f in commit_message), None)
            if lost is not None:
                self.lose_reply.remove(lost)
                raise FakeHTTPError(503)
        return SimpleNamespace(oid=self.commits[-1])

    def hf_hub_download(self, repo_id: str, filename: str, *, local_dir: str, **kw: Any) -> str:
        self._enter("hf_hub_download")
        with self.lock:
            if filename not in self.files:
                raise FakeHTTPError(404)
            data = self.files[filename]
        path = Path(local_dir) / filename  # the real layout: one path per key and folder
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        self.downloaded(path)
        return str(path)

    def downloaded(self, path: Path) -> None:
        """Called once each download is written (a test may hold one back here)."""

    def get_paths_info(self, repo_id: str, paths: list[str], **kw: Any) -> list:
        self._enter("get_paths_info")
        with self.lock:
            return [SimpleNamespace(path=p, size=len(self.files[p]),
                                    blob_id=hashlib.sha1(self.files[p]).hexdigest())
                    for p in paths if p in self.files]

    def list_repo_tree(self, repo_id: str, path_in_repo: str | None = None,
                       recursive: bool = False, **kw: Any) -> list:
        self._enter("list_repo_tree")
        with self.lock:
            prefix = f"{path_in_repo}/" if path_in_repo else ""
            out = [SimpleNamespace(path=p, size=len(d)) for p, d in self.files.items()
                   if p.startswith(prefix)]
        if path_in_repo and not out:
            raise FakeHTTPError(404)
        return out


class MotoServer:
    """``moto[server]`` on 127.0.0.1 with an OS-chosen port; a bucket is created on start."""

    def __init__(self, bucket: str = "diloco") -> None:
        from moto.server import ThreadedMotoServer

        self.bucket = bucket
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)

    def __enter__(self) -> MotoServer:
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, **aws_env_kwargs()).create_bucket(
            Bucket=self.bucket)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.stop()


AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}


def aws_env_kwargs() -> dict:
    return {"aws_access_key_id": "testing", "aws_secret_access_key": "testing",
            "region_name": "us-east-1"}


def set_aws_env() -> None:
    os.environ.update(AWS_ENV)


class TcpProxy:
    """A loopback TCP forwarder that can be paused: while paused it shuts down existing and
    refuses new connections, which is what a network outage looks like to an S3 client."""

    def __init__(self, target_host: str, target_port: int) -> None:
        import socket

        self.target = (target_host, target_port)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.paused = threading.Event()
        self.closed = threading.Event()
        self.conns: list[Any] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while not self.closed.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            if self.paused.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: Any, dst: Any) -> None:
        try:
            while not self.paused.is_set():
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def pause(self) -> None:
        import socket

        self.paused.set()
        with self.lock:
            for c in self.conns:
                # shutdown() first: close() from this thread neither wakes the pump blocked in
                # recv() nor tells the peer, so a request in flight used to hang until the
                # client's read timeout (the master sat 60 s on one, and the s3 outage test
                # failed its final sync); shutdown sends FIN and ends the pump at once.
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                try:
                    c.close()
                except OSError:
                    pass
            self.conns.clear()

    def resume(self) -> None:
        self.paused.clear()

    def close(self) -> None:
        self.closed.set()
        self.pause()
        self.sock.close()
