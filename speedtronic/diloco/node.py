"""The DiLoCo worker: a trainer callback with a background upload thread and a poll thread.

Training thread, per optimizer step (the only DiLoCo work it does, measured and reported as
``diloco/train_thread_frac``):

* every ``inner_steps`` (H) steps: copy the synchronized parameters into a CPU fp32 snapshot
  buffer (one device->host copy; pinned + non_blocking on CUDA) and hand it to the upload thread,
  then install a newer global if the poll thread has one ready (an inner-step boundary, so no
  local work is lost: it is in the snapshot just taken);
* once an upload is confirmed: reset the inner optimizer state (``optimizer.reset_state()``).

Upload thread: turns the oldest snapshot into a pseudo-gradient ``delta = reference - snapshot``
(in place, in the snapshot buffer), compresses and uploads it create-only under
``nodes/<node>/<session>/d<seq>-b<base>.safetensors``, and only after the store confirms it
moves the reference by the delta *as decoded* (so compression error is sent next round). While
an upload cannot complete, newer snapshots of the same base replace the queued one (coalescing:
the next delta is computed against the same reference, so it contains all the work) and the
stuck upload is retried with the same key and bytes - never a second delta for the same work.

Poll thread: every ``poll_interval`` seconds reads ``global/latest.json``; for a newer version
downloads the global, checks sha256 and tensor digest against the pointer, and stages it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ConfigError, DistributedConfig
from ..errors import NonFiniteError
from . import codec
from .carry import Carry, ConsistentBase
from .codec import POINTER_KEY, FormatError, Pointer
from .faults import crash_point
from .store import (
    ObjectExists,
    ObjectNotFound,
    Store,
    StoreError,
    StoreUnavailable,
    TransientStoreError,
    open_configured_store,
)

logger = logging.getLogger("speedtronic.diloco.node")


class ModelMismatch(FormatError):
    """A published global whose tensors do not fit this node's model (a different model.*):
    no later global will fit either, so a node that has none yet stops instead of waiting."""


def default_node_id() -> str:
    host = "".join(c if c.isalnum() or c in "_.-" else "-" for c in socket.gethostname())
    return f"{host[:40] or 'node'}-{os.getpid()}"


def sync_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The tensors DiLoCo synchronizes: every parameter once (tied weights are deduplicated by
    ``named_parameters``, so a tied embedding/head is sent once). Buffers are not synchronized.

    Deltas and globals are real fp32 tensors, so a complex parameter is refused here: copied
    into them it lost its imaginary part (torch only warned)."""
    params = dict(model.named_parameters())
    for name, p in params.items():
        if p.is_complex():
            raise ConfigError(f"diloco: parameter {name!r} is {p.dtype}; DiLoCo synchronizes "
                              "real parameters only (store a complex one as two real ones, "
                              "e.g. torch.view_as_real)")
    return params


def run_stopped_by(trainer: Any) -> BaseException | None:
    """The exception that ended the run early: the Trainer records it (``stopped_by``); for
    other drivers, the exception being handled while they call ``on_train_end`` from a
    ``finally``."""
    if hasattr(trainer, "stopped_by"):
        return trainer.stopped_by
    return sys.exc_info()[1]


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


class Worker(ConsistentBase):
    """DiLoCo worker callback (``name = "diloco"``). Works with any object exposing ``model``,
    ``optimizer`` and optionally ``log_metrics`` and ``config`` (the Trainer does)."""

    name = "diloco"
    _snapshot_record = _Snapshot  # what ConsistentBase queues for the upload thread

    def __init__(self, cfg: DistributedConfig, *, store: Store | None = None,
                 node_id: str | None = None, tokens_per_step: int = 0) -> None:
        self.cfg = cfg
        self.node_id = codec.check_id(node_id or cfg.node_id or default_node_id())
        self.session = uuid.uuid4().hex[:10]  # a restarted process never reuses a delta name
        self._stop = threading.Event()
        self.store = store or open_configured_store(cfg, stop=self._stop)
        self.tokens_per_step = tokens_per_step
        self._lock = threading.Condition()
        self._params: dict[str, torch.nn.Parameter] = {}
        self._refs: dict[int, dict[str, torch.Tensor]] = {}  # generation -> reference weights
        self.gen = -1
        self.final_synced = False  # on_train_end installed a global holding the last delta
        self.version = -1  # installed global version
        self.digest = ""   # tensor digest of the installed global
        self._pending: dict[int, _Snapshot] = {}  # newest un-sent snapshot per generation
        self._inflight: _Upload | None = None
        self._pool: list[dict[str, torch.Tensor]] = []
        self._candidate: tuple[Pointer, dict[str, torch.Tensor]] | None = None
        self._run_model: dict[str, Any] = {}  # model.* in the newest global's header
        self._reset_due = False
        self._seq = 0
        self.last_seq = -1
        self._steps_in_round = 0
        self._threads: list[threading.Thread] = []
        self.m = {"deltas_sent": 0, "upload_failures": 0, "coalesced": 0, "installs": 0,
                  "bytes_up": 0, "bytes_down": 0, "staleness": 0, "codec_rel_err": 0.0,
                  "resets": 0}
        self._train_s = 0.0
        self._wall_start: float | None = None
        # Consistent base (carry.py): own deltas the newest global lacks, and that global.
        self._carry_mode = bool(cfg.consistent_base)
        self._carry = Carry()
        self._global: tuple[Pointer, dict[str, torch.Tensor]] | None = None
        self._residual: dict[str, torch.Tensor] | None = None  # codec error, sent next delta
        self._poll_soon = threading.Event()  # wakes the poll thread early (boundary waits)
        self._round_start: float | None = None
        self._round_s = 0.0   # EMA of the wall-clock seconds of a round
        self._lag_sum, self._installs_counted = 0, 0
        self._warned: set[str] = set()
        self.round_steps = cfg.inner_steps  # H; adaptive_inner_steps scales it by speed
        self._clock = time.perf_counter  # what step times are measured with
        self._step_end: float | None = None
        self._step_s = 0.0  # EMA of this worker's seconds per inner step
        self.m.update({"round_steps": cfg.inner_steps, "lag": 0, "lag_mean": 0.0,
                       "version_age_s": 0.0, "carry_dropped": 0, "boundary_wait_s": 0.0,
                       "rebases": 0})

    # ------------------------------------------------------------------ callback API
    def on_train_start(self, trainer: Any) -> None:
        self._params = sync_parameters(trainer.model)
        cfg = self.cfg
        if not self.tokens_per_step and getattr(trainer, "config", None) is not None:
            c = trainer.config
            self.tokens_per_step = (c.data.target_batch_size or c.data.micro_batch_size) * (
                c.data.block_size or c.model.max_seq_len)
        logger.info("diloco worker %s (session %s): store %s, H=%d, codec %s, poll %.1fs",
                    self.node_id, self.session, self.store.url, cfg.inner_steps,
                    cfg.compression, cfg.poll_interval)
        self._warn_about_checkpoint_cadence(trainer)
        deadline = time.monotonic() + cfg.start_timeout
        last = ""  # the last reason no global could be installed, said once until it changes
        while self._candidate is None:  # every node starts from the published global
            try:
                self._poll_once()
            except ModelMismatch as exc:  # permanent: waiting start_timeout would not help
                raise ConfigError(f"diloco: {exc}. Every node must build the master's model: "
                                  "use the same model.* settings (and vocab) on every "
                                  "node") from None
            except (StoreUnavailable, TransientStoreError, FormatError) as exc:
                if str(exc) != last:  # a damaged global was said once per poll: 51 in 10 s
                    logger.warning("diloco worker %s: waiting for the first global: %s",
                                   self.node_id, exc)
                last = str(exc)
            except StoreError as exc:  # denied, a missing bucket, ...: waiting cannot help
                raise StoreError(f"diloco worker {self.node_id}: cannot read the store: "
                                 f"{exc}") from None
            if self._candidate is None:
                if time.monotonic() >= deadline:
                    why = (f"the published one cannot be used: {last}" if last else
                           "is the master up?")
                    raise StoreError(f"diloco: no usable global at {self.store.url} within "
                                     f"start_timeout={cfg.start_timeout}s ({why})")
                self._stop.wait(min(cfg.poll_interval, 1.0))
        self._check_model(trainer)
        self._install(trainer)
        self._threads = [threading.Thread(target=self._upload_loop, daemon=True,
                                          name=f"diloco-upload-{self.node_id}"),
                         threading.Thread(target=self._poll_loop, daemon=True,
                                          name=f"diloco-poll-{self.node_id}")]
        for t in self._threads:
            t.start()
        self._wall_start = time.perf_counter()

    def _check_model(self, trainer: Any) -> None:
        """Refuse to join a run whose published ``model.*`` differs in architecture from this
        node's: equal tensor shapes (checked when staging) do not make the same model.
        ``hf_config`` is left out when it is a path: the same folder sits at another path on
        another machine (the tensors' names and shapes still have to match)."""
        config = getattr(trainer, "config", None)
        if not self._run_model or config is None:
            return
        from ..models.builtin import architecture_changes

        mine, run = config.to_dict(redact=True)["model"], dict(self._run_model)
        if isinstance(mine.get("hf_config"), str) or isinstance(run.get("hf_config"), str):
            mine.pop("hf_config", None)
            run.pop("hf_config", None)
        changes = architecture_changes(run, mine, "the store")
        if changes:
            self.close()
            raise ConfigError(f"diloco: this node's model differs from the run's "
                              f"({changes}). "
                              "Every node must build the master's model: use the same model.* "
                              "settings on every node")

    def _warn_about_checkpoint_cadence(self, trainer: Any) -> None:
        """A worker killed between checkpoints resumes from the last one and trains the rounds
        since then again; their deltas were already applied, so those samples count twice.
        Checkpoints at every round boundary bound it to the round in flight."""
        ckpt = getattr(getattr(trainer, "config", None), "checkpoint", None)
        H = self.cfg.inner_steps
        if ckpt is None or not ckpt.enabled or ckpt.every_steps <= H:
            return
        logger.warning("diloco worker %s: checkpoint.every_steps=%d > distributed.inner_steps="
                       "%d: after a crash this worker resumes up to %d rounds back and trains "
                       "their samples again (their deltas were applied already); set "
                       "checkpoint.every_steps to %d", self.node_id, ckpt.every_steps, H,
                       math.ceil(ckpt.every_steps / H) - 1, H)

    def after_optimizer_step(self, trainer: Any, step: int) -> None:
        t0 = time.perf_counter()
        self._time_step()
        if self._reset_due:
            self._reset_due = False
            self._reset_optimizer(trainer)
        self._steps_in_round += 1
        if self._steps_in_round >= self.round_steps:
            self._time_round()
            self._snapshot()
            if self._carry_mode:
                self._await_master()
                self._install(trainer)
            elif self._candidate is not None:
                self._install(trainer)
            self._adapt_round_steps()
            self._train_s += time.perf_counter() - t0
            self._log(trainer)
        else:
            if self._carry_mode and self.cfg.rebase_within_round and self._candidate is not None:
                self._rebase_within_round(trainer)
            self._train_s += time.perf_counter() - t0
        self._step_end = self._clock()

    def on_train_end(self, trainer: Any) -> None:
        if not self._threads:
            return
        if self._steps_in_round and not isinstance(run_stopped_by(trainer), NonFiniteError):
            self._snapshot()  # the partial last round is sent too: no work is dropped
        deadline = time.monotonic() + self.cfg.shutdown_timeout
        flushed = self.flush(self.cfg.shutdown_timeout)
        if not flushed:
            logger.warning("diloco worker %s: uploads still pending after shutdown_timeout=%.0fs;"
                           " that work is lost", self.node_id, self.cfg.shutdown_timeout)
        # An interrupted run (Ctrl-C, an error) is not done: a done marker would let the master
        # stop before a --resume comes back, and the final sync would wait for it.
        stopped_by = run_stopped_by(trainer)
        if stopped_by is not None:
            logger.info("diloco worker %s: run stopped early (%s): no done marker, no final "
                        "sync", self.node_id, type(stopped_by).__name__)
            self.close()
            self._log(trainer)
            return
        marked = self._write_done_marker(max(0.0, deadline - time.monotonic()))
        if flushed and marked and self.cfg.final_sync_timeout > 0:
            self.final_synced = self.final_sync(trainer, self.cfg.final_sync_timeout)
        if self._carry_mode and not self.final_synced and flushed:
            # (not flushed: the local weights hold work no global will, so they are kept)
            self._end_on_published_global(trainer)
        self.close()
        self._log(trainer)

    def _end_on_published_global(self, trainer: Any) -> None:
        """Without a final sync, a consistent-base worker ends on the newest published global.

        Its local weights stand on an install shifted back by the carry (G - c * the sum of
        its own deltas the master had not applied yet), a base that only makes sense together
        with the master's later application of those deltas: a worker once saved that as its
        final model (1.6x the norm of its unapplied work away from G in an audit run). Its
        last deltas are uploaded, so the master's globals get them."""
        try:
            pointer = Pointer.from_bytes(self.store.get(POINTER_KEY))
            with self._lock:
                self._release(self._carry.clear())
            self._stage(pointer)
            self._install(trainer, force=True)
        except (StoreError, FormatError, ValueError) as exc:
            logger.warning("diloco worker %s: cannot read the newest global (%s); its model "
                           "ends on the consistent-base install plus its local steps, not on "
                           "a published global", self.node_id, exc)
            return
        logger.info("diloco worker %s: ends on global v%d (its last deltas may not be in it "
                    "yet: distributed.final_sync_timeout > 0 waits for them)", self.node_id,
                    self.version)

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

    def state_dict(self) -> dict:
        # Resume re-installs the newest global (at most one inner round of local work is lost).
        return {"node_id": self.node_id, "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        pass

    # ------------------------------------------------------------------ training-thread parts
    def _reset_optimizer(self, trainer: Any) -> None:
        if not self.cfg.reset_inner_optimizer:
            return
        opt = trainer.optimizer
        if hasattr(opt, "reset_state"):
            opt.reset_state()
        else:
            opt.state.clear()
        self.m["resets"] += 1

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

    @torch.no_grad()
    def _install(self, trainer: Any, force: bool = False) -> None:
        """Copy the staged global into the model; ``force`` re-installs the same version (the
        local weights moved on from it and the work since was rejected)."""
        if self._carry_mode:
            self._install_consistent(trainer)
            return
        with self._lock:
            if self._candidate is None:
                return
            # At most two generations alive: the current one and one still uploading.
            if any(g < self.gen for g in self._pending) or (
                    self._inflight is not None and self._inflight.gen < self.gen):
                return
            pointer, tensors = self._candidate
            self._candidate = None
            if pointer.version <= self.version and not force:
                return
            for k, p in self._params.items():
                p.copy_(tensors[k])
            self.gen += 1
            self._refs[self.gen] = tensors  # the global becomes this generation's reference
            self.version, self.digest = pointer.version, pointer.weights_digest
            self._drop_unused_refs()
            # The lag this mode leaves: own deltas made (numbered or still queued) that the
            # installed global does not hold - the work the next round's base is missing.
            made = self._seq + len(self._pending)
            lag = max(0, made - 1 - pointer.holds(self.node_id, self.session))
        self.m["installs"] += 1
        self._record_lag(lag, pointer)
        logger.info("diloco worker %s: installed global v%d", self.node_id, pointer.version)
        replaced = getattr(trainer, "weights_replaced", None)
        if callable(replaced):
            replaced(f"DiLoCo global v{pointer.version}")

    def _drop_unused_refs(self) -> None:
        if self._carry_mode:  # deltas are made at the boundary: only this round's base lives
            for g in [g for g in self._refs if g != self.gen]:
                del self._refs[g]
            return
        live = {self.gen, *self._pending}
        if self._inflight is not None:
            live.add(self._inflight.gen)
        for g in [g for g in self._refs if g not in live]:
            del self._refs[g]

    def _log(self, trainer: Any) -> None:
        log = getattr(trainer, "log_metrics", None)
        if log is None:
            return
        wall = time.perf_counter() - self._wall_start if self._wall_start else 0.0
        log({f"diloco/{k}": v for k, v in self.metrics(wall).items()})

    def metrics(self, wall: float | None = None) -> dict[str, float]:
        out: dict[str, float] = {"version": self.version, **self.m,
                                 "store_retries": getattr(self.store, "retries", 0),
                                 "train_thread_s": self._train_s}
        if wall:
            out["train_thread_frac"] = self._train_s / wall
        return out

    # ------------------------------------------------------------------ background threads
    def _upload_loop(self) -> None:
        backoff = 0.5
        while True:
            with self._lock:
                while self._inflight is None and not self._pending and not self._stop.is_set():
                    self._lock.wait()
                if self._inflight is None and not self._pending:
                    return
                if self._inflight is None:
                    self._inflight = self._prepare(self._pending.pop(min(self._pending)))
                job = self._inflight
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
                self._residual = {k: snap.tensors[k] - decoded[k] for k in decoded}
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

    def _poll_once(self) -> None:
        try:
            pointer = Pointer.from_bytes(self.store.get(POINTER_KEY))
        except ObjectNotFound:
            return
        current = self._candidate[0].version if self._candidate else self.version
        if pointer.version <= current:
            return
        self._stage(pointer)

    def _stage(self, pointer: Pointer) -> None:
        """Download, verify and stage the global ``pointer`` names (installed at a boundary)."""
        if self._params:
            limit = (int(self.cfg.max_object_mb * 2**20) if self.cfg.max_object_mb is not None
                     else int(1.25 * sum(4 * p.numel() for p in self._params.values())) + 2**20)
            info = self.store.stat(pointer.path)
            if info is not None and info.size > limit:
                raise FormatError(f"global v{pointer.version} is {info.size} bytes, above the "
                                  f"{limit}-byte limit (distributed.max_object_mb); not read")
        data = self.store.get(pointer.path)
        self.m["bytes_down"] += len(data)
        tensors, model = codec.decode_global_with_model(data, pointer)  # sha256 + digest
        self._run_model = model or self._run_model
        missing = set(self._params) - set(tensors) if self._params else set()
        if missing:
            raise ModelMismatch(f"global v{pointer.version} lacks {sorted(missing)[:3]}")
        extra = set(tensors) - set(self._params) if self._params else set()
        if extra:  # a smaller model took the global's subset and had every delta refused
            raise ModelMismatch(f"global v{pointer.version} has tensors this model lacks: "
                                f"{sorted(extra)[:3]}")
        for k, param in self._params.items():
            # copy_ would broadcast a (1, n) tensor into an (m, n) parameter without a word.
            got = tensors[k]
            if tuple(got.shape) != tuple(param.shape) or not got.is_floating_point():
                raise ModelMismatch(f"global v{pointer.version}: {k!r} is {got.dtype} "
                                  f"{tuple(got.shape)}, the model has {param.dtype} "
                                  f"{tuple(param.shape)}; not installed")
        tensors = {k: v.float() for k, v in tensors.items()}
        with self._lock:
            self._candidate = (pointer, tensors)
            self._lock.notify_all()  # a boundary may be waiting for this global

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            self._poll_soon.wait(self.cfg.poll_interval)
            self._poll_soon.clear()
            if self._stop.is_set():
                return
            try:
                self._poll_once()
            except (StoreError, FormatError) as exc:
                # e.g. the pointer moved and the old global was collected mid-download
                logger.warning("diloco worker %s: poll failed (%s); retrying next poll",
                               self.node_id, exc)
            except Exception:  # noqa: BLE001 - a dead poll thread never installs a global again
                logger.exception("diloco worker %s: poll failed unexpectedly; retrying next poll",
                                 self.node_id)

    # ------------------------------------------------------------------ driven use
    def poll_now(self) -> None:
        """Fetch and stage a newer global now (what the poll thread does every interval)."""
        self._poll_once()

    def install_now(self, trainer: Any) -> None:
        """Install a staged global now; call only between optimizer steps."""
        self._install(trainer)

    # ------------------------------------------------------------------ shutdown
    def flush(self, timeout: float) -> bool:
        """Wait until every snapshot has been uploaded (or ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending or self._inflight is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 0.2))
        return True

    def final_sync(self, trainer: Any, timeout: float) -> bool:
        """Wait until the master has processed this session's last delta, then install the
        global: the one that includes it or, when the master rejected it (stale, non-finite,
        ...), the current one. Either way the node ends holding published weights."""
        deadline = time.monotonic() + timeout
        key = f"{self.node_id}/{self.session}"
        receipt = codec.rejection_key(self.node_id, self.session, self.last_seq)
        while time.monotonic() < deadline:
            try:
                pointer = Pointer.from_bytes(self.store.get(POINTER_KEY))
                _, meta = codec.decode(self.store.get(pointer.state_path))
                if meta.get("hwm", {}).get(key, -1) >= self.last_seq:
                    if pointer.version > self.version:
                        self._poll_once()
                        self._install(trainer)
                    if self.version >= pointer.version:  # installed, not only staged
                        return True
                elif self.store.stat(receipt) is not None:
                    reason = json.loads(self.store.get(receipt)).get("reason", "?")
                    logger.warning("diloco worker %s: the master rejected its last delta (%s); "
                                   "ending on global v%d", self.node_id, reason, pointer.version)
                    with self._lock:
                        self._release(self._carry.clear())  # rejected work is not carried
                    self._stage(pointer)
                    self._install(trainer, force=True)
                    return self.version == pointer.version
            except (StoreError, FormatError, ValueError) as exc:
                logger.debug("final sync: %s", exc)
            time.sleep(min(self.cfg.poll_interval, 0.5))
        logger.warning("diloco worker %s: the master processed neither its last delta nor a "
                       "rejection of it within %.0fs", self.node_id, timeout)
        return False

    def close(self) -> None:
        self._stop.set()
        self._poll_soon.set()
        with self._lock:
            self._lock.notify_all()
        for t in self._threads:
            t.join(timeout=10)
        self._threads = []
