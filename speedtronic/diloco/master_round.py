"""One aggregation round of the DiLoCo master: list, download, weigh, apply the outer step.

:meth:`MasterRound.run_once` is the round the master's module docstring walks through: it takes
each session's pending deltas fairly, checks each (master_quarantine.py refuses the bad ones),
adds the rest one at a time into a weighted sum (staleness x tokens per step) and, once there
are ``min_deltas`` of them, applies the outer optimizer to a copy of the global and publishes it
(master_publish.py), rolling everything back if the publish fails so no delta is applied twice.

:class:`MasterRound` is mixed into :class:`~speedtronic.diloco.master.Master`, which owns the
state it reads and writes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from . import codec
from .codec import FormatError
from .faults import crash_point
from .lease import LeaseLost
from .outer import carry_weight, staleness_weight
from .store import ObjectNotFound, PreconditionFailed

logger = logging.getLogger("speedtronic.diloco.master")


@dataclass
class MasterStats:
    """Counters of one round (also the master's metrics)."""

    version: int = 0
    found: int = 0
    applied: int = 0
    rejected: int = 0
    stale_dropped: int = 0
    mean_staleness: float = 0.0
    bytes_down: int = 0
    bytes_up: int = 0
    published: bool = False
    reasons: list[str] = field(default_factory=list)


class _WeightedSum:
    """``sum(w_i * delta_i)``, the total weight and the count, built one delta at a time."""

    def __init__(self) -> None:
        self.total: dict[str, torch.Tensor] = {}
        self.weight = 0.0
        self.count = 0

    def add(self, delta: dict[str, torch.Tensor], w: float) -> None:
        for key, t in delta.items():
            if key in self.total:
                self.total[key].add_(t.float(), alpha=w)
            else:
                self.total[key] = t.float() * w
        self.weight += w
        self.count += 1


class MasterRound:
    """The aggregation round and the weights it gives each delta."""

    def carry_weight(self) -> float:
        """``c`` for the pointer: the total weight this master's outer step gives one delta
        (:func:`~speedtronic.diloco.outer.carry_weight`), at the M it divides by now."""
        return carry_weight(self.cfg.outer_optimizer, self.cfg.outer_lr,
                            self.cfg.outer_momentum, self._workers(set()))

    def _token_weight(self, session_key: str, header: codec.DeltaHeader) -> float:
        """A delta's weight for the tokens per step it trained on, relative to the mean over
        sessions: a worker with twice the batch counts twice, as its examples would in one
        data-parallel batch. Not per token of the round: a delta is a displacement, already
        proportional to its steps (a short round moves less), so weighting it by its tokens
        would count its length twice. 1.0 when every worker runs the same batch (or a header
        has no token count)."""
        if header.tokens <= 0 or header.inner_steps <= 0:
            return 1.0
        self._tokens_per_step[session_key] = header.tokens / header.inner_steps
        mean = sum(self._tokens_per_step.values()) / len(self._tokens_per_step)
        return self._tokens_per_step[session_key] / mean

    def _workers(self, batch_nodes: set[str]) -> float:
        if self.cfg.expected_workers:
            return float(self.cfg.expected_workers)
        version = self.pointer.version if self.pointer else 0
        window = max(2, self.cfg.max_staleness)
        recent = {n for n, v in self.node_last_version.items() if v >= version - window}
        return float(max(1, len(recent | batch_nodes)))

    # ------------------------------------------------------------------ one round
    def run_once(self) -> MasterStats:
        """One aggregation round; returns its counters. Raises LeaseLost if deposed."""
        assert self.pointer is not None, "call load_or_bootstrap() first"
        self.renew_lease()
        version = self.pointer.version
        self._round += 1
        stats = MasterStats(version=version)
        pending: dict[str, list[tuple[str, str, int, int]]] = {}
        for key in self.store.list("nodes/"):
            parts = key.split("/")
            if len(parts) == 4 and parts[3] == "done.json":
                self.done_sessions.add(f"{parts[1]}/{parts[2]}")
                continue
            parsed = codec.parse_delta_key(key)
            if parsed is None:
                continue
            node, session, seq, _base = parsed
            if seq > self.hwm.get(f"{node}/{session}", -1) and key not in self.skip:
                pending.setdefault(f"{node}/{session}", []).append((key, node, session, seq))
                if key not in self._listed_at:
                    self._listed_at[key] = version
                    session_key = f"{node}/{session}"
                    if self._last_new.get(session_key) != self._round:  # once per round: two
                        now = self._clock()  # keys listed together (a backlog) are no pace
                        if session_key in self._last_new_time:
                            self._gap[session_key] = now - self._last_new_time[session_key]
                        self._last_new_time[session_key] = now
                    self._last_new[session_key] = self._round
        if self._done_at_first_listing is None:
            self._done_at_first_listing = set(self.done_sessions)
        self._check_poll_interval()
        listed = {item[0] for items in pending.values() for item in items}
        self._listed_at = {k: v for k, v in self._listed_at.items() if k in listed}
        self._warn_about_shared_node_ids()
        # Fair and gap-free: each session's pending deltas in seq order, taken round-robin
        # (every session's oldest first, then the lowest seq: sorting by node id once starved
        # the last-named node into staleness), at most max_deltas_per_round per version. The
        # rest stay above their session's high-water mark and are found again next round.
        ranked = [(rank, item) for items in pending.values()
                  for rank, item in enumerate(sorted(items, key=lambda it: it[3]))]
        ranked.sort(key=lambda r: (r[0], r[1][3], r[1][1], r[1][2]))
        new = [item for _, item in ranked[:self.cfg.max_deltas_per_round]]
        stats.found = len(new)
        # One decoded delta at a time is added into the running weighted sum (fp32, like the
        # weights): memory is 2x the model whatever the backlog.
        accepted = _WeightedSum()
        applied_keys: list[str] = []
        staleness: list[int] = []
        hwm = dict(self.hwm)
        for key, node, session, seq in new:
            try:
                info = self.store.stat(key)
                if info is not None and info.size > self.max_object_bytes:
                    self._quarantine(key, f"{info.size} bytes, above the {self.max_object_bytes}"
                                     "-byte limit (distributed.max_object_mb); not downloaded",
                                     stats)
                    continue
                data = self.store.get(key)
            except ObjectNotFound:
                continue
            except ValueError as exc:  # a name that lists but is not a valid store key
                self._quarantine(key, f"unusable key: {exc}", stats)
                continue
            stats.bytes_down += len(data)
            try:
                delta, header = codec.decode_delta(data)
            except FormatError as exc:
                self._quarantine(key, str(exc), stats)
                continue
            if (header.node, header.session, header.seq) != (node, session, seq) \
                    or header.key != key:
                self._quarantine(key, f"header ({header.node}/{header.session}/{header.seq}, "
                                 f"base {header.base_version}) does not match its name", stats)
                continue
            # Versions the master published while this delta waited in its own queue (the
            # per-round cap, a backlog after an outage) do not count against it: staleness is
            # measured from the version at which the master first listed it.
            stale = self._listed_at.get(key, version) - header.base_version
            if stale < 0:
                # Ahead of us: either a newer master published (we are deposed; the fence
                # says so) or the sender lies about its base.
                self._check_fence()
                self._quarantine(key, f"base_version {header.base_version} is ahead of the "
                                 f"current version {version}", stats)
                continue
            if stale > self.cfg.max_staleness:
                stats.stale_dropped += 1
                self._quarantine(key, f"stale: {stale} versions behind "
                                 f"(max_staleness={self.cfg.max_staleness})", stats)
                continue
            self._check_round_length(header.inner_steps)
            session_key = f"{node}/{session}"
            if session_key in self._gap and header.inner_steps > 0:  # this session's pace
                self._step_s[session_key] = (self._gap[session_key] / header.inner_steps,
                                             self._round)
            reason = self._validate(delta)
            if reason is not None:
                self._quarantine(key, reason, stats)
                continue
            accepted.add(delta, staleness_weight(stale, self.cfg.staleness_weighting)
                         * self._token_weight(session_key, header))
            del delta
            applied_keys.append(key)
            staleness.append(stale)
            hwm[f"{node}/{session}"] = max(seq, hwm.get(f"{node}/{session}", -1))
            self.seen_sessions.add(f"{node}/{session}")
        for key, node, session, seq in new:  # each session's keys in seq order
            # A quarantined delta moves the mark only when it is the next one in its session
            # (a real upload that failed a check), and only if this round publishes; a junk name
            # far ahead never does, or it would hide the real deltas below it. In between, the
            # skip set (and, after a restart, the recorded quarantine list) keeps it unfetched.
            if key in self.skip and seq == hwm.get(f"{node}/{session}", -1) + 1:
                hwm[f"{node}/{session}"] = seq
        self.totals["bytes_down"] += stats.bytes_down
        if new:
            self.last_new_delta = time.monotonic()
        if accepted.count < max(1, self.cfg.min_deltas):
            self._emit(stats)
            return stats
        self._apply_and_publish(accepted, applied_keys, staleness, hwm, stats)
        return stats

    def _apply_and_publish(self, accepted, applied_keys, staleness, hwm, stats) -> None:
        batch_nodes = {k.split("/")[1] for k in applied_keys}
        workers = self._workers(batch_nodes)
        old = (self.weights, self.hwm, self.node_last_version, self.outer.state_tensors(),
               self.outer.state_meta(), dict(self.totals))
        self.weights = {k: v.clone() for k, v in self.weights.items()}
        self.outer.buf = {k: v.clone() for k, v in self.outer.buf.items()}
        self.outer.acc = {k: v.clone() for k, v in self.outer.acc.items()}
        self.outer.step_sum(self.weights, accepted.total, accepted.weight, accepted.count,
                            workers)
        crash_point("after_apply")
        version = self.pointer.version + 1
        self.hwm = hwm
        self.node_last_version = {**self.node_last_version, **{n: version for n in batch_nodes}}
        self.totals["applied"] += accepted.count
        self._applied_here += accepted.count
        self.totals["rejected"] += stats.rejected
        self.totals["versions"] += 1
        try:
            stats.bytes_up = self._publish(version, applied_keys, self.pointer.path,
                                           self.pointer_etag)
        except BaseException as exc:
            # Roll back so the same deltas are applied exactly once on the next round.
            (self.weights, self.hwm, self.node_last_version, tensors, meta, self.totals) = old
            self.outer.load(tensors, meta)
            if isinstance(exc, PreconditionFailed):
                raise LeaseLost(f"pointer moved under master {self.node_id}: {exc}") from exc
            raise
        self.totals["bytes_up"] += stats.bytes_up
        stats.version, stats.applied, stats.published = version, accepted.count, True
        stats.mean_staleness = sum(staleness) / len(staleness)
        logger.info("diloco master: v%d from %d deltas (M=%.0f, staleness mean %.2f, max %d), "
                    "%d rejected", version, accepted.count, workers, stats.mean_staleness,
                    max(staleness), stats.rejected)
        self._emit(stats)
        self._collect_garbage(applied_keys)

    def _emit(self, stats: MasterStats) -> None:
        if self._log_metrics is None:
            return
        self._log_metrics({
            "diloco/master_version": stats.version, "diloco/master_found": stats.found,
            "diloco/master_applied": stats.applied, "diloco/master_rejected": stats.rejected,
            "diloco/master_stale_dropped": stats.stale_dropped,
            "diloco/master_staleness": stats.mean_staleness,
            "diloco/master_bytes_down": stats.bytes_down, "diloco/master_bytes_up": stats.bytes_up,
        })
