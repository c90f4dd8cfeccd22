"""A worker's own deltas that the newest global does not hold yet: the consistent-base carry.

Why: asynchronous DiLoCo installed, at each round boundary, a global G that was missing work the
master *would* apply later - always the round that just ended, plus whatever sat between the
worker's poll, the master's poll and publication (2.4-4.2 deltas when polls were about a round
long). The next round started from that base and the master then applied the missing work on
top of it: a delayed-gradient instability whose loss tracked the lag (0 deltas missing: 1.318,
2.66: 1.772, one node alone 1.495; the diagnosis in issue #31). Installing

    base = G - c * sum(own deltas G does not hold)

starts the next round from where G will be once the master has applied them. ``c`` is the total
weight the master's outer step gives one delta (``outer.carry_weight``: ``lr / (M (1 - mu))``
for (delayed) Nesterov, ``lr / M`` for sgd) and comes with G in the pointer, as does the
per-session high-water mark that says which deltas G holds; so the carry is exact for the G it
is applied to, however old that G is. Each delta is carried until a pointer's mark covers it
(applied or rejected), never twice.

Memory: one host fp32 copy of the synchronized parameters per carried delta, at most
``distributed.max_unapplied`` (default 4).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .codec import Pointer

logger = logging.getLogger("speedtronic.diloco.node")

__all__ = ["Carry", "ConsistentBase", "OwnDelta"]


@dataclass
class OwnDelta:
    """One delta this session made: ``tensors`` is what the master will apply (the decoded wire
    values once the upload has encoded it), ``uploaded`` once the store confirmed it."""

    seq: int
    tensors: dict[str, torch.Tensor]  # CPU fp32, the synchronized parameters' shapes
    uploaded: bool = False


class Carry:
    """The ordered list of own deltas a global may still lack."""

    def __init__(self) -> None:
        self._deltas: list[OwnDelta] = []

    def __len__(self) -> int:
        return len(self._deltas)

    def __iter__(self) -> Iterator[OwnDelta]:
        return iter(self._deltas)

    def add(self, delta: OwnDelta) -> None:
        if self._deltas and delta.seq <= self._deltas[-1].seq:
            raise ValueError(f"carry: seq {delta.seq} after {self._deltas[-1].seq}")
        self._deltas.append(delta)

    def find(self, seq: int) -> OwnDelta | None:
        return next((d for d in self._deltas if d.seq == seq), None)

    def missing_from(self, held: int) -> int:
        """How many carried deltas a global holding seqs up to ``held`` lacks (the lag)."""
        return sum(1 for d in self._deltas if d.seq > held)

    def drop_held(self, held: int) -> list[OwnDelta]:
        """Forget the deltas a global holding seqs up to ``held`` contains; returns them."""
        gone = [d for d in self._deltas if d.seq <= held]
        self._deltas = [d for d in self._deltas if d.seq > held]
        return gone

    def drop_oldest(self) -> OwnDelta:
        return self._deltas.pop(0)

    def drop_newest(self) -> OwnDelta:
        return self._deltas.pop()

    def clear(self) -> list[OwnDelta]:
        gone, self._deltas = self._deltas, []
        return gone

    @torch.no_grad()
    def base(self, global_weights: dict[str, torch.Tensor], c: float) -> dict[str, torch.Tensor]:
        """``G - c * sum(carried deltas)`` as new tensors (G is left untouched)."""
        out = {k: v.clone() for k, v in global_weights.items()}
        if c:
            for d in self._deltas:
                for k, t in out.items():
                    t.sub_(d.tensors[k], alpha=c)
        return out


class ConsistentBase:
    """The worker's consistent-base half (mixed into :class:`~speedtronic.diloco.node.Worker`,
    which owns the lock, the threads and the store): deltas are made on the training thread at
    the boundary, carried until a pointer covers them, and every boundary installs
    ``G - c * carry``; with ``push_pull_timeout`` it first waits for a global holding them."""

    # Provided by Worker.
    _snapshot_record: Any  # its upload-queue record type
    cfg: Any
    node_id: str
    session: str
    m: dict[str, Any]
    _lock: threading.Condition
    _carry: Carry
    _global: tuple[Pointer, dict[str, torch.Tensor]] | None
    _candidate: tuple[Pointer, dict[str, torch.Tensor]] | None
    _refs: dict[int, dict[str, torch.Tensor]]
    _pending: dict[int, Any]
    _pool: list[dict[str, torch.Tensor]]
    _params: dict[str, torch.nn.Parameter]
    _residual: dict[str, torch.Tensor] | None
    _poll_soon: threading.Event
    _stop: threading.Event
    _clock: Callable[[], float]
    _step_end: float | None
    _step_s: float
    round_steps: int
    _rounds_timed: int = 0

    # ------------------------------------------------------------------ training thread
    @torch.no_grad()
    def _snapshot_delta(self) -> None:
        """This round's delta, ``base - weights``, numbered and queued for upload and carried.

        The weights are copied into a fresh buffer that becomes the next reference, and the old
        reference buffer turns into the delta in place: one device->host copy and one pass."""
        steps, self._steps_in_round = self._steps_in_round, 0
        with self._lock:
            weights = self._pool.pop() if self._pool else {
                k: torch.empty(p.shape, dtype=torch.float32) for k, p in self._params.items()}
            for k, p in self._params.items():
                weights[k].copy_(p.detach())           # blocking: the delta is needed now
            delta = self._refs[self.gen]
            for k, t in delta.items():                 # reference <- reference - weights
                t.sub_(weights[k])
            if self._residual is not None:             # last upload's codec rounding error
                for k, t in delta.items():
                    t.add_(self._residual[k])
                self._residual = None
            self._refs[self.gen] = weights             # the next delta is measured from here
            seq, self._seq = self._seq, self._seq + 1
            snap = self._snapshot_record(self.gen, self.version, delta, steps,
                                         steps * self.tokens_per_step, seq=seq)
            self._pending[seq] = snap
            self._carry.add(OwnDelta(seq, delta))
            self._lock.notify_all()

    def _newest_pointer(self) -> Pointer | None:
        if self._candidate is not None:
            return self._candidate[0]
        return self._global[0] if self._global is not None else None

    def _held(self) -> int:
        pointer = self._newest_pointer()
        return pointer.holds(self.node_id, self.session) if pointer is not None else -1

    def _await_master(self) -> None:
        """Push-pull (``push_pull_timeout``): wait for a global holding this round's delta. And
        with ``max_unapplied`` deltas outstanding, wait up to ``unapplied_wait`` for the master,
        then stop carrying the oldest (bounded memory; counted in ``carry_dropped``)."""
        cfg, t0 = self.cfg, time.perf_counter()
        with self._lock:
            if cfg.push_pull_timeout > 0:
                self._wait_for(lambda: self._carry.missing_from(self._held()) == 0,
                               cfg.push_pull_timeout)
            if self._carry.missing_from(self._held()) > cfg.max_unapplied:
                if self._merge_stuck_uploads():
                    return
                self._wait_for(lambda: self._carry.missing_from(self._held())
                               <= cfg.max_unapplied, cfg.unapplied_wait)
            while self._carry.missing_from(self._held()) > cfg.max_unapplied:
                self._carry.drop_oldest()  # its buffer is still the upload's until confirmed
                self.m["carry_dropped"] += 1
                self._warn_once("dropped", "diloco worker %s: %d deltas outstanding after "
                                "%.0fs (distributed.max_unapplied=%d): the master is not "
                                "keeping up; the oldest is no longer carried", self.node_id,
                                len(self._carry), cfg.unapplied_wait, cfg.max_unapplied)
        self.m["boundary_wait_s"] += time.perf_counter() - t0

    def _merge_stuck_uploads(self) -> bool:
        """When this round's delta and the one before it both still wait for the store (an
        outage), send them as one: the sum of two displacements is the work of both rounds
        (the master weighs it as one delta; counted in ``coalesced``). Waiting would not help
        while uploads fail, and memory stays at ``max_unapplied`` deltas. Lock held."""
        deltas = list(self._carry)
        if len(deltas) < 2:
            return False
        prev, newest = deltas[-2], deltas[-1]
        if prev.seq not in self._pending or newest.seq not in self._pending:
            return False  # the older one is uploading or sent: the master is what lags
        for k, t in prev.tensors.items():
            t.add_(newest.tensors[k])
        snap, gone = self._pending[prev.seq], self._pending.pop(newest.seq)
        snap.steps += gone.steps
        snap.tokens += gone.tokens
        self._carry.drop_newest()
        self._seq -= 1  # the newest number was the last one given out: no gap in the session
        if len(self._pool) < 2:
            self._pool.append(newest.tensors)
        self.m["coalesced"] += 1
        return True

    def _wait_for(self, done: Callable[[], bool], timeout: float) -> None:
        """Wait (lock held) until ``done()``, polling the store every ~50 ms meanwhile."""
        deadline = time.monotonic() + timeout
        while not done() and not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._poll_soon.set()
            self._lock.wait(min(left, 0.05))

    def _base_of_newest(self) -> tuple[Pointer, dict[str, torch.Tensor]] | None:
        """``(pointer, G - c * (own deltas G lacks))`` for the newest global G known, the
        covered deltas released (lock held); None before the first global."""
        if self._candidate is not None:
            self._global, self._candidate = self._candidate, None
        if self._global is None:
            return None
        pointer, weights = self._global
        self._release(self._carry.drop_held(pointer.holds(self.node_id, self.session)))
        c = pointer.carry * (1.0 + self.cfg.carry_lookahead * max(0.0, pointer.workers - 1))
        return pointer, self._carry.base(weights, c)

    @torch.no_grad()
    def _rebase_within_round(self, trainer: Any) -> None:
        """``rebase_within_round``: a newer global staged mid-round moves the weights by
        ``new base - old base`` at once, instead of at the next boundary.

        The round's own work is kept: with ``w = b_old + u`` (``u`` the local progress so far),
        the shift gives ``b_new + u``, and the delta at the boundary, ``b_new - w_end``, is still
        exactly ``-(u + the rest of the round)``. What changes is how soon the other workers'
        deltas (and the master's momentum) reach this worker's weights: within a poll, not up to
        a round later. Cost: one pass over the parameters per new global (about M per round)."""
        with self._lock:
            if self._candidate is None or self.gen not in self._refs:
                return
            pointer, base = self._base_of_newest()  # type: ignore[misc]
            new_version = pointer.version != self.version
            old = self._refs[self.gen]
            for k, p in self._params.items():
                shift = old[k].sub_(base[k])                       # old base - new base
                p.sub_(shift.to(device=p.device, dtype=p.dtype))   # w <- w + new - old
            self._refs[self.gen] = base
            self.version, self.digest = pointer.version, pointer.weights_digest
            if len(self._pool) < 2:
                self._pool.append(old)  # the old base's buffer holds the shift: free now
        self.m["rebases"] += 1
        self.m["installs"] += int(new_version)  # a global counts once, however it came in
        replaced = getattr(trainer, "weights_replaced", None)
        if callable(replaced):  # a torchrun group's other ranks follow (GroupRelay)
            replaced(f"DiLoCo global v{pointer.version} (within the round)")

    @torch.no_grad()
    def _install_consistent(self, trainer: Any) -> None:
        """Install ``G - c * (own deltas G lacks)`` for the newest global G known."""
        with self._lock:
            newest = self._base_of_newest()
            if newest is None:
                return
            pointer, base = newest
            lag = len(self._carry)
            for k, p in self._params.items():
                p.copy_(base[k])
            new_version = pointer.version != self.version
            self.gen += 1
            self._refs[self.gen] = base
            self.version, self.digest = pointer.version, pointer.weights_digest
            self._drop_unused_refs()
        self.m["installs"] += int(new_version)  # globals installed; every boundary re-bases
        self._record_lag(lag, pointer)
        if new_version:
            logger.info("diloco worker %s: installed global v%d (carrying %d own deltas, "
                        "c=%.3g)", self.node_id, pointer.version, lag, pointer.carry)
        replaced = getattr(trainer, "weights_replaced", None)
        if callable(replaced):
            replaced(f"DiLoCo global v{pointer.version}")

    # ------------------------------------------------------------------ upload thread
    def _confirm_delta(self, job: Any) -> None:
        with self._lock:
            own = self._carry.find(job.seq)
            if own is not None:
                own.uploaded = True
            elif len(self._pool) < 2:  # already covered (or dropped): the buffer is free
                self._pool.append(job.snapshot.tensors)
            self._reset_due = True
            self.last_seq = job.seq
            self.m["deltas_sent"] += 1
            self.m["staleness"] = max(0, self.version - job.snapshot.base_version)
            self._inflight = None
            self._lock.notify_all()

    def _release(self, gone: list[OwnDelta]) -> None:
        """Recycle the buffers of deltas no longer carried whose upload is done (lock held)."""
        for d in gone:
            if d.uploaded and len(self._pool) < 2:
                self._pool.append(d.tensors)

    # ------------------------------------------------------------------ guards
    def _time_round(self) -> None:
        now = self._clock()
        if self._round_start is not None:
            seconds = now - self._round_start
            self._round_s = seconds if not self._round_s else 0.8 * self._round_s + 0.2 * seconds
            self._rounds_timed += 1
            if self._rounds_timed >= 3 and self.cfg.poll_interval > POLL_WARN_FRACTION * \
                    self._round_s:
                self._warn_once("poll", "diloco worker %s: poll_interval %.3gs is more than "
                                "%.0f%% of a round (%.3gs): globals arrive late and the "
                                "asynchronous schedule loses quality; set "
                                "distributed.poll_interval <= %.3g", self.node_id,
                                self.cfg.poll_interval, 100 * POLL_WARN_FRACTION, self._round_s,
                                POLL_WARN_FRACTION * self._round_s)
        self._round_start = now

    def _time_step(self) -> None:
        """Seconds of the step that just ended (from the end of the previous callback: the
        boundary's own work and waits are not the worker's speed)."""
        if self._step_end is not None:
            seconds = self._clock() - self._step_end
            self._step_s = seconds if not self._step_s else 0.9 * self._step_s + 0.1 * seconds

    def _adapt_round_steps(self) -> None:
        """``adaptive_inner_steps``: H scaled by the fastest worker's step time over ours."""
        pointer = self._newest_pointer()
        if not self.cfg.adaptive_inner_steps or pointer is None or not self._step_s \
                or not pointer.fastest_step_s:
            return
        h = self.cfg.inner_steps
        scaled = round(h * min(1.0, pointer.fastest_step_s / self._step_s))
        self.round_steps = max(1, h // 8, min(h, scaled))
        self.m["round_steps"] = self.round_steps

    def _record_lag(self, lag: int, pointer: Pointer) -> None:
        """Metrics of one install: own deltas the global lacked (carried, in this mode), their
        running mean, and how old the global was (its publication time, the master's clock)."""
        self.m["lag"] = lag
        self._lag_sum += lag
        self._installs_counted += 1
        self.m["lag_mean"] = self._lag_sum / self._installs_counted
        self.m["version_age_s"] = max(0.0, time.time() - pointer.created_at)
        self._check_lag()

    def _check_lag(self) -> None:
        """Warn once when the globals this worker installs lack, on average, more than half a
        delta of its own beyond the round it has just ended (which no global can hold yet):
        with M workers alike that is more than M/2 deltas missing from each install."""
        if self._installs_counted >= LAG_WARN_AFTER and self.m["lag_mean"] > 1.5:
            self._warn_once("lag", "diloco worker %s: the globals it installed lacked %.2g of "
                            "its deltas on average (1 is the round just ended): with M workers "
                            "alike, more than M/2 deltas are missing from each; the master or "
                            "the polls are slow for this round length "
                            "(distributed.master_poll_interval, poll_interval)", self.node_id,
                            self.m["lag_mean"])

    def _warn_once(self, what: str, msg: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(msg, *args)


LAG_WARN_AFTER = 5
"""Installs a worker averages over before it may warn about its lag."""
POLL_WARN_FRACTION = 0.25
"""A worker warns once when its poll interval exceeds this fraction of its measured round:
polling once per round, as shipped before the consistent base, three workers ended 30-50%
above lock-step DiLoCo in the simulated schedule (bench_diloco_async.md)."""
