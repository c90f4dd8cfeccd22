"""The DiLoCo worker's globals: poll, download, verify, stage, install.

The poll thread (:meth:`GlobalInstall._poll_loop`) reads ``global/latest.json`` every
``poll_interval`` seconds and, for a newer version, downloads the global, checks it against the
pointer and this node's model, and stages it (:meth:`GlobalInstall._stage`). The training
thread installs a staged global only at a round boundary (:meth:`GlobalInstall._install`), so
no local work is lost. At the end of a run, :meth:`GlobalInstall.final_sync` waits for the
global that holds this session's last delta (or the receipt that rejected it), and a
consistent-base worker that skips it ends on the newest published global instead.

:class:`GlobalInstall` is mixed into :class:`~speedtronic.diloco.node.Worker`, which owns the
lock, the queues, the threads and the store.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch

from . import codec
from .codec import POINTER_KEY, FormatError, Pointer
from .store import ObjectNotFound, StoreError

logger = logging.getLogger("speedtronic.diloco.node")


class ModelMismatch(FormatError):
    """A published global whose tensors do not fit this node's model (a different model.*):
    no later global will fit either, so a node that has none yet stops instead of waiting."""


class GlobalInstall:
    """Fetch, verify, stage and install published globals."""

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

    def _poll_once(self) -> None:
        try:
            pointer = Pointer.from_bytes(self.store.get(POINTER_KEY))
        except ObjectNotFound:
            return
        staged = self._candidate  # read once: a boundary's install sets it to None meanwhile
        current = staged[0].version if staged is not None else self.version
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
            # The poll thread and the end of a run both stage: a slower download of an older
            # pointer finishing last made a worker end on the global before the newest.
            newest = self._candidate[0].version if self._candidate is not None else self.version
            if pointer.version >= newest:
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

    # ------------------------------------------------------------------ end of the run
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
