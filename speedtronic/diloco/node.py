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

This module holds the :class:`Worker` callback itself: its state, the trainer hooks that drive
a round (start, every optimizer step, end) and its metrics. The upload side (snapshot, delta,
create-only put, confirmation, the done marker) is in node_upload.py; fetching, checking and
installing globals (the poll thread, the final sync) in node_install.py; the consistent-base
mode in carry.py.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any

import torch

from ..config import ConfigError, DistributedConfig
from ..errors import NonFiniteError
from . import codec
from .carry import Carry, ConsistentBase
from .codec import FormatError, Pointer
from .node_install import GlobalInstall, ModelMismatch
from .node_upload import DeltaUploads, _Snapshot, _Upload
from .store import (
    Store,
    StoreError,
    StoreUnavailable,
    TransientStoreError,
    open_configured_store,
)

logger = logging.getLogger("speedtronic.diloco.node")

# Names this module held before the split (other modules and tests import some from here).
__all__ = ["ModelMismatch", "Worker", "_Snapshot", "_Upload", "default_node_id",
           "run_stopped_by", "sync_parameters"]


def default_node_id() -> str:
    """``<host>-<pid>``: the host name with characters an id may not hold replaced by ``-`` (ids
    are store path segments); the pid keeps two processes on one host apart."""
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


class Worker(GlobalInstall, DeltaUploads, ConsistentBase):
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
        self.upload_error: BaseException | None = None  # the upload thread's, raised on ours
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
        """Wait up to ``start_timeout`` for a usable published global, install it into the model,
        then start the upload and poll threads. A model unlike the master's raises ConfigError;
        no global in time, or a store that refuses access, raises StoreError."""
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
        said_waiting = False
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
                if not said_waiting and not last:  # a worker started alone waited 10 min mute
                    logger.info("diloco worker %s: waiting up to %gs (distributed.start_timeout)"
                                " for the master's first global at %s", self.node_id,
                                cfg.start_timeout, self.store.url)
                    said_waiting = True
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
        """Count the step; at the end of an inner round, queue the round's delta for upload and
        install the newest global (with ``consistent_base``: after waiting for the master as
        configured), then adapt the round length."""
        self.raise_upload_error()
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
        """Send the partial last round, flush uploads (up to ``shutdown_timeout``), write the done
        marker and, with ``final_sync_timeout``, end on a global holding this node's last delta.
        A run stopped early writes no done marker and does no final sync."""
        if not self._threads:
            return
        if self._steps_in_round and not isinstance(run_stopped_by(trainer), NonFiniteError):
            self._snapshot()  # the partial last round is sent too: no work is dropped
        deadline = time.monotonic() + self.cfg.shutdown_timeout
        flushed = self.flush(self.cfg.shutdown_timeout)
        if self.upload_error is not None:  # the last rounds were not sent: not done
            self.close()
            self.raise_upload_error()
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

    def state_dict(self) -> dict:
        """Node id and installed global version: all a resume needs, since it installs the newest
        global again."""
        # Resume re-installs the newest global (at most one inner round of local work is lost).
        return {"node_id": self.node_id, "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: :meth:`on_train_start` installs the newest global on resume."""
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

    def _log(self, trainer: Any) -> None:
        log = getattr(trainer, "log_metrics", None)
        if log is None:
            return
        wall = time.perf_counter() - self._wall_start if self._wall_start else 0.0
        log({f"diloco/{k}": v for k, v in self.metrics(wall).items()})

    def metrics(self, wall: float | None = None) -> dict[str, float]:
        """Counters for ``diloco/*`` metrics: installed version, deltas, bytes, store retries and
        seconds spent on the training thread (with ``wall``, also their share of it)."""
        out: dict[str, float] = {"version": self.version, **self.m,
                                 "store_retries": getattr(self.store, "retries", 0),
                                 "train_thread_s": self._train_s}
        if wall:
            out["train_thread_frac"] = self._train_s / wall
        return out

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Stop the poll and upload threads and join them (up to 10 s each); pending uploads are not
        waited for (:meth:`flush` does that). Safe to call twice."""
        self._stop.set()
        self._poll_soon.set()
        with self._lock:
            self._lock.notify_all()
        for t in self._threads:
            t.join(timeout=10)
        self._threads = []
