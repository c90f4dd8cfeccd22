"""The DiLoCo master: lease, new-delta discovery, validation, outer step, atomic publication.

One round (:meth:`Master.run_once`):

1. renew the lease (a compare-and-swap of ``master/lease.json``, :mod:`.lease`); losing it
   stops this master;
2. list ``nodes/`` (names only) and keep deltas whose ``seq`` is above the per-session
   high-water mark - processed deltas are never downloaded again;
3. download and validate each (checksum, header vs name, keys, shapes, finite values, optional
   norm bound, staleness); failures are quarantined with the reason logged;
4. apply the outer optimizer (outer.py) to a copy of the global;
5. write the new global and the master state (momentum, high-water marks, quarantine, applied
   keys, parent) under fresh immutable names, then swap ``global/latest.json`` conditionally on
   the etag this master last wrote. The pointer is the commit point: the store, not the master's
   disk, holds everything a restarted master needs, so every delta is applied exactly once
   across crashes at any point.

Crash points (faults.py): ``after_apply``, ``after_weights_written``, ``after_pointer_written``.

This module holds the :class:`Master` itself: its state, and the loop that runs rounds until
the run is over. The steps live in mixins: the lease (1) in lease.py, the round (2-4) in
master_round.py, the checks and quarantine (3) in master_quarantine.py, publication (5) and
cleanup in master_publish.py, and what the listings say about each session (pace, all_done)
in master_sessions.py.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from ..config import DistributedConfig
from . import codec
from .codec import FormatError, Pointer
from .lease import LeaseLost, MasterLease
from .master_publish import _QUARANTINE_LOG, MasterPublication, _epoch_of, _version_of
from .master_quarantine import DeltaQuarantine
from .master_round import MasterRound, MasterStats, _WeightedSum
from .master_sessions import SessionWatch
from .outer import OuterOptimizer
from .store import Store, StoreError

logger = logging.getLogger("speedtronic.diloco.master")

# Names this module held before the split (tests and benchmarks import some of them from here).
__all__ = ["LeaseLost", "Master", "MasterStats", "_QUARANTINE_LOG", "_WeightedSum",
           "_epoch_of", "_version_of"]


class Master(MasterRound, DeltaQuarantine, SessionWatch, MasterPublication, MasterLease):
    """Aggregates deltas from the store and publishes globals. Not thread-safe: one thread
    drives it (the master service thread or the standalone loop)."""

    def __init__(self, store: Store, cfg: DistributedConfig, node_id: str,
                 initial_weights: Callable[[], dict[str, torch.Tensor]] | None = None,
                 log_metrics: Callable[[dict], None] | None = None,
                 model_config: dict[str, Any] | None = None) -> None:
        self.store, self.cfg = store, cfg
        #: ``model.*`` of the run, in every global's header (the store's wins on a restart)
        self.model_config: dict[str, Any] = dict(model_config or {})
        self.node_id = codec.check_id(node_id)
        self.session = uuid.uuid4().hex[:10]
        self._initial = initial_weights
        self._log_metrics = log_metrics
        self.outer = OuterOptimizer(cfg.outer_optimizer, cfg.outer_lr, cfg.outer_momentum,
                                    cfg.eager_share)
        self._warned_round_length = False
        self.weights: dict[str, torch.Tensor] = {}
        self.pointer: Pointer | None = None
        self.pointer_etag: str | None = None
        self.epoch = 0
        self.lease_etag: str | None = None
        self.hwm: dict[str, int] = {}  # "node/session" -> highest processed seq
        self.quarantined: list[list[Any]] = []
        self.node_last_version: dict[str, int] = {}
        self.totals = {"applied": 0, "rejected": 0, "versions": 0, "bytes_down": 0, "bytes_up": 0}
        self.done_sessions: set[str] = set()
        self.seen_sessions: set[str] = set()  # sessions with an accepted delta
        self.skip: set[str] = set()
        self.last_new_delta = time.monotonic()
        # In memory only (a restarted master starts them afresh): the version at which each
        # pending delta was first listed, and per session the round it last listed a new delta
        # or its done marker, for all_done().
        self._listed_at: dict[str, int] = {}
        self._round = 0
        self._last_new: dict[str, int] = {}
        self._overlap_rounds: dict[str, int] = {}
        self._clock: Callable[[], float] = time.monotonic
        self._last_new_time: dict[str, float] = {}  # per session: when it last listed a new delta
        self._gap: dict[str, float] = {}  # per session: seconds between its last two new deltas
        self._step_s: dict[str, tuple[float, int]] = {}  # session: (seconds/step, round seen)
        self._tokens_per_step: dict[str, float] = {}  # session: its deltas' tokens / steps
        # A master that finds the run finished before it did any work (a restart after the
        # end, or a new run pointed at an old store: the bundled configs share one) ends at
        # once, as a restart should; it says so, since a new run's workers would then
        # continue the old model and have their deltas left unapplied.
        self._applied_here = 0
        self._done_at_first_listing: set[str] | None = None
        self._warned_finished = False
        self._warned_poll = False

    def has_new_deltas(self) -> bool:
        """Whether a listing shows a delta above its session's high-water mark (names only)."""
        for key in self.store.list("nodes/"):
            parsed = codec.parse_delta_key(key)
            if parsed is not None and key not in self.skip and \
                    parsed[2] > self.hwm.get(f"{parsed[0]}/{parsed[1]}", -1):
                return True
        return False

    # ------------------------------------------------------------------ loop
    def run(self, stop: threading.Event, *, until: Callable[[Master], bool] | None = None,
            idle_timeout: float = 0.0) -> None:
        """Rounds every ``master_poll`` seconds until ``stop``, ``until(self)`` or
        ``idle_timeout`` seconds without a new delta (0 = no idle limit). With a
        ``grace_window``, a listing that finds new deltas waits that long before aggregating,
        so near-simultaneous arrivals share one update."""
        poll = self.cfg.master_poll
        while not stop.is_set():
            try:
                if self.cfg.grace_window > 0 and self.has_new_deltas():
                    stop.wait(self.cfg.grace_window)
                stats = self.run_once()
            except LeaseLost:
                raise
            except (StoreError, FormatError) as exc:  # store outage: keep the state, retry
                logger.warning("diloco master: round failed (%s); retrying in %.1fs", exc, poll)
                stop.wait(poll)
                continue
            if stats.found == 0 and until is not None and until(self):
                break
            if idle_timeout and time.monotonic() - self.last_new_delta > idle_timeout:
                logger.info("diloco master: no new delta for %.0fs, stopping", idle_timeout)
                break
            if stats.found == 0:
                stop.wait(poll)
