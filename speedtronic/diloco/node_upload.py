"""The DiLoCo worker's upload side: snapshots, deltas, create-only puts, the done marker.

At a round boundary the training thread copies the synchronized parameters into a snapshot
(:meth:`DeltaUploads._snapshot`; a queued one that never left is overwritten: coalescing). The
upload thread turns the oldest into ``delta = reference - snapshot``, encodes it, puts it
create-only and retries the same key and bytes until the store confirms it; only then does
:meth:`DeltaUploads._confirm` move the reference by the delta as decoded and schedule the inner
optimizer's reset. At the end, :meth:`DeltaUploads.flush` waits for the queue to drain and
:meth:`DeltaUploads._write_done_marker` tells the master this session is finished.

:class:`DeltaUploads` is mixed into :class:`~speedtronic.diloco.node.Worker`, which owns the
lock, the queues, the threads and the store.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import SpeedtronicError, first_line
from . import codec
from .faults import crash_point
from .store import ObjectExists, StoreError

logger = logging.getLogger("speedtronic.diloco.node")


@dataclass
class _Snapshot:
    gen: int
    base_version: int
    tensors: dict[str, torch.Tensor]  # CPU fp32, becomes the delta in place
    steps: int
    tokens: int
    event: Any = None  # CUDA event when the copy was non_blocking
    seq: int | None = None  # consistent-base mode: already a delta, numbered at the boundary


@dataclass
class _Upload:
    gen: int
    key: str
    data: bytes
    decoded: dict[str, torch.Tensor]
    snapshot: _Snapshot
    seq: int


class DeltaUploads:
    """Snapshot, encode, upload and confirm this session's deltas."""

    # ------------------------------------------------------------------ training thread
    @torch.no_grad()
    def _snapshot(self) -> None:
        if self._carry_mode:
            self._snapshot_delta()
            return
        steps, self._steps_in_round = self._steps_in_round, 0
        with self._lock:
            snap = self._pending.get(self.gen)
            if snap is not None:  # the queued one never left: overwrite it (coalesce)
                self.m["coalesced"] += 1
                snap.steps += steps
                snap.tokens += steps * self.tokens_per_step
            else:
                bufs = self._pool.pop() if self._pool else {
                    k: torch.empty(p.shape, dtype=torch.float32,
                                   pin_memory=p.is_cuda) for k, p in self._params.items()}
                snap = _Snapshot(self.gen, self.version, bufs, steps, steps * self.tokens_per_step)
                self._pending[self.gen] = snap
            cuda = False
            for k, p in self._params.items():
                snap.tensors[k].copy_(p.detach(), non_blocking=p.is_cuda)
                cuda = cuda or p.is_cuda
            if cuda:
                snap.event = torch.cuda.Event()
                snap.event.record()
            self._lock.notify_all()

    # ------------------------------------------------------------------ background threads
    def _upload_loop(self) -> None:
        backoff = 0.5
        while True:
            with self._lock:
                while self._inflight is None and not self._pending and not self._stop.is_set():
                    self._lock.wait()
                if self._inflight is None and not self._pending:
                    return
                failed: tuple[_Snapshot, Exception] | None = None
                if self._inflight is None:
                    snap = self._pending.pop(min(self._pending))
                    try:
                        self._inflight = self._prepare(snap)
                    except Exception as exc:  # noqa: BLE001 - reported on the training thread
                        # The snapshot is half consumed (its delta made in place, its seq
                        # taken): it cannot be queued again, and no later delta could follow
                        # it. This thread used to die here unseen while training went on
                        # without sending anything; the training thread raises it instead.
                        self.upload_error = exc
                        self._lock.notify_all()
                        failed = (snap, exc)
                job = self._inflight
            if failed is not None:  # logged outside the lock the training thread waits on
                snap, exc = failed
                logger.error("diloco worker %s: preparing the delta of round %s for upload "
                             "failed", self.node_id, snap.seq if snap.seq is not None
                             else f"generation {snap.gen}", exc_info=exc)
                return
            try:
                self._put(job)
            except Exception as exc:  # noqa: BLE001 - a dead upload thread loses every round
                self.m["upload_failures"] += 1
                if isinstance(exc, StoreError):
                    logger.warning("diloco worker %s: upload of %s failed (%s); it stays queued "
                                   "and newer work coalesces", self.node_id, job.key, exc)
                else:  # not a store error: a bug or an OS error; say so, keep the thread alive
                    logger.exception("diloco worker %s: upload of %s failed unexpectedly; it "
                                     "stays queued and is retried", self.node_id, job.key)
                if self._stop.wait(backoff):
                    return
                backoff = min(backoff * 2, 30.0)
                continue
            backoff = 0.5
            self._confirm(job)

    def _prepare(self, snap: _Snapshot) -> _Upload:
        """snapshot -> encoded delta (called with the lock held; cheap next to the upload)."""
        if snap.event is not None:
            snap.event.synchronize()
        if snap.seq is None:
            ref = self._refs[snap.gen]
            for k, s in snap.tensors.items():  # delta = reference - snapshot, in its buffer
                torch.sub(ref[k], s, out=s)
            seq, self._seq = self._seq, self._seq + 1
        else:
            seq = snap.seq  # consistent-base mode: a delta already, numbered at the boundary
        header = codec.DeltaHeader(node=self.node_id, session=self.session, seq=seq,
                                   base_version=snap.base_version, inner_steps=snap.steps,
                                   tokens=snap.tokens, codec=self.cfg.compression)
        data, decoded = codec.encode_delta(snap.tensors, header)
        if self.cfg.compression != "none":
            self.m["codec_rel_err"] = codec.relative_error(snap.tensors, decoded)
            if snap.seq is not None:
                # The master applies the decoded values: carry those, and send the rounding
                # error with the next delta (what moving the reference does in the other mode).
                # Added to an error not yet sent: with two deltas queued (an upload slower than
                # a round) the first one's error was overwritten and never reached the global.
                residual = {k: snap.tensors[k] - decoded[k] for k in decoded}
                if self._residual is not None:
                    for k, t in residual.items():
                        t.add_(self._residual[k])
                self._residual = residual
                for k, t in snap.tensors.items():
                    t.copy_(decoded[k])
        return _Upload(snap.gen, header.key, data, decoded, snap, header.seq)

    def _put(self, job: _Upload) -> None:
        crash_point("before_delta_put")
        try:
            self.store.put(job.key, job.data, if_absent=True)
        except ObjectExists:
            # An earlier attempt landed but its reply was lost: same bytes means done.
            if self.store.get(job.key) != job.data:
                raise
        self.m["bytes_up"] += len(job.data)

    def _confirm(self, job: _Upload) -> None:
        if job.snapshot.seq is not None:
            self._confirm_delta(job)
            return
        with self._lock:
            ref = self._refs.get(job.gen)
            if ref is not None:  # a newer snapshot of this generation is measured from here
                for k, d in job.decoded.items():
                    ref[k].sub_(d)  # reference <- weights at the snapshot (+ codec error)
            # Reset inner state only now that the upload is safe, also when a newer global was
            # installed since the snapshot: skipping that case left a worker whose every round
            # ends with an install (a fast master) with 1 reset in 5 uploads.
            self._reset_due = True
            self.last_seq = job.seq
            self.m["deltas_sent"] += 1
            self.m["staleness"] = max(0, self.version - job.snapshot.base_version)
            self._pool.append(job.snapshot.tensors)
            self._pool = self._pool[:2]
            self._inflight = None
            self._drop_unused_refs()
            self._lock.notify_all()

    # ------------------------------------------------------------------ shutdown
    def flush(self, timeout: float) -> bool:
        """Wait until every snapshot has been uploaded (or ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while (self._pending or self._inflight is not None) and self.upload_error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 0.2))
        return self.upload_error is None

    def raise_upload_error(self) -> None:
        """The upload thread's failure, on the training thread: training on would send nothing."""
        err = self.upload_error
        if err is not None:
            first = first_line(err, empty="")
            raise SpeedtronicError(f"diloco worker {self.node_id}: the upload thread failed "
                                   f"({type(err).__name__}: {first}); no later round could be "
                                   "sent, so the run stops (the log above has the details; "
                                   "--resume continues from the last checkpoint)")

    def _write_done_marker(self, timeout: float) -> bool:
        """Write ``done.json`` within ``timeout`` (what is left of ``shutdown_timeout``).

        The put retries with backoff; during an outage it held the training thread 8.3 s past a
        1 s ``shutdown_timeout``. It runs on a helper thread, and what is still retrying when the
        time is up is abandoned (the master then counts this session as gone once it stays
        quiet, as for a crashed node)."""
        error: list[BaseException] = []

        def put() -> None:
            try:
                self.store.put(f"nodes/{self.node_id}/{self.session}/done.json",
                               json.dumps({"last_seq": self.last_seq}).encode())
            except StoreError as exc:
                error.append(exc)

        thread = threading.Thread(target=put, daemon=True, name=f"diloco-done-{self.node_id}")
        thread.start()
        thread.join(timeout if math.isfinite(timeout) else None)  # .inf: no limit
        if thread.is_alive():
            self._stop.set()  # ends the put's retry waits (a request under way may finish)
            thread.join(5.0)
            if thread.is_alive() or error:
                logger.warning("diloco worker %s: done marker not written within "
                               "shutdown_timeout=%.0fs (store unreachable?)", self.node_id,
                               self.cfg.shutdown_timeout)
                return False
        if error:
            logger.warning("diloco worker %s: could not write done marker: %s", self.node_id,
                           error[0])
            return False
        return True
