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
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import DistributedConfig
from . import codec
from .codec import POINTER_KEY, FormatError, Pointer
from .faults import crash_point
from .lease import LeaseLost, MasterLease
from .outer import OuterOptimizer, carry_weight, staleness_weight
from .store import ObjectNotFound, PreconditionFailed, Store, StoreError

logger = logging.getLogger("speedtronic.diloco.master")

_QUARANTINE_LOG = 1000  # newest quarantine records kept in the state (older ones only logged)


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


class Master(MasterLease):
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

    # ------------------------------------------------------------------ state
    def load_or_bootstrap(self) -> None:
        """Adopt the published global + master state, or publish version 0 if there is none."""
        try:
            data, etag = self.store.get_with_etag(POINTER_KEY)
        except ObjectNotFound:
            if self._initial is None:
                raise StoreError(f"{self.store.url} has no {POINTER_KEY} and this master has no "
                                 "initial weights to publish as version 0") from None
            self.weights = {k: v.detach().float().cpu().clone() for k, v in self._initial().items()}
            try:
                self._publish(version=0, applied=[], parent="", expected=None)
                logger.info("diloco master: published initial global v0 (%d tensors)",
                            len(self.weights))
                return
            except PreconditionFailed:
                data, etag = self.store.get_with_etag(POINTER_KEY)
        try:
            pointer = Pointer.from_bytes(data)
        except FormatError as exc:
            pointer = self._rebuilt_pointer(exc)
            etag = self.store.swap(POINTER_KEY, pointer.to_bytes(), etag)
        tensors, published_model = codec.decode_global_with_model(self.store.get(pointer.path),
                                                                  pointer)
        self.weights = {k: v.float() for k, v in tensors.items()}
        state_bytes = self.store.get(pointer.state_path)
        if codec.sha256(state_bytes) != pointer.state_sha256:
            raise FormatError(f"master state {pointer.state_path}: sha256 mismatch")
        tensors, meta = codec.decode(state_bytes)
        self.outer.load(tensors, meta.get("outer", {}))
        self.hwm = {k: int(v) for k, v in meta.get("hwm", {}).items()}
        self.quarantined = meta.get("quarantined", [])
        # A quarantined name far ahead never moves a high-water mark (it would hide the real
        # deltas below it): the recorded ones are skipped by name after a restart too.
        self.skip.update(str(record[0]) for record in self.quarantined if record)
        self.node_last_version = meta.get("node_last_version", {})
        # Sessions of nodes the published state applied deltas from (a session whose deltas
        # were all quarantined has a mark too, but is nobody to wait for).
        self.seen_sessions.update(s for s in self.hwm
                                  if s.split("/")[0] in self.node_last_version)
        self.totals.update(meta.get("totals", {}))
        self.pointer, self.pointer_etag = pointer, etag
        self._adopt_model(published_model)
        logger.info("diloco master: resumed at v%d (epoch %d -> %d), %d sessions tracked",
                    pointer.version, pointer.master_epoch, self.epoch, len(self.hwm))

    def _rebuilt_pointer(self, damage: FormatError) -> Pointer:
        """A pointer for the newest global + master state pair still in the store, when the
        pointer itself is unreadable (truncated, overwritten by hand). Both objects are written
        before the pointer under one name suffix, so a complete pair is a consistent state: its
        high-water marks say which deltas it holds. A restart had failed although every global
        and state was intact."""
        states = {key[len("master/state-"):] for key in self.store.list("master/state-")}
        pairs = []
        for key in self.store.list("global/v"):
            m = _NAME_SUFFIX.fullmatch(key[len("global/"):])
            if m and m.group(0) in states:
                pairs.append((int(m.group(1)), int(m.group(2)), m.group(0)))
        for version, epoch, name in sorted(pairs, reverse=True):
            gkey, skey = f"global/{name}", f"master/state-{name}"
            try:
                wbytes, sbytes = self.store.get(gkey), self.store.get(skey)
                weights, meta = codec.decode(wbytes)
                _, state_meta = codec.decode(sbytes)
            except (FormatError, ObjectNotFound) as exc:
                logger.warning("diloco master: %s is unusable (%s); trying an older one", gkey,
                               exc)
                continue
            if meta.get("version") != version:
                continue
            logger.warning("diloco master: %s is unreadable (%s); rebuilt it from %s", POINTER_KEY,
                           damage, gkey)
            return Pointer(version=version, path=gkey, sha256=codec.sha256(wbytes),
                           weights_digest=codec.tensor_digest(weights), outer_step=version,
                           master_epoch=max(epoch, self.epoch), state_path=skey,
                           state_sha256=codec.sha256(sbytes), master=self.node_id,
                           hwm={k: int(v) for k, v in state_meta.get("hwm", {}).items()},
                           carry=self.carry_weight())
        raise FormatError(f"{damage}; and no complete global + master state pair is left in "
                          f"{self.store.url} to rebuild it from")

    def _adopt_model(self, published: dict[str, Any]) -> None:
        """A restarted master keeps the model the run was bootstrapped with (workers are held
        to it); a different ``model.*`` in its own config is said once, not published."""
        if not published:
            return
        from ..models.builtin import architecture_changes

        changes = architecture_changes(published, self.model_config, "the store") \
            if self.model_config else ""
        if changes:
            logger.warning("diloco master: this store's run was started with another model "
                           "(%s); keeping the store's, which every worker must build", changes)
        self.model_config = dict(published)

    def _state_bytes(self, version: int, applied: list[str], parent: str) -> bytes:
        meta = {"format": codec.STATE_FORMAT, "version": version, "epoch": self.epoch,
                "parent": parent, "applied": applied, "hwm": self.hwm,
                "quarantined": self.quarantined[-_QUARANTINE_LOG:],
                "node_last_version": self.node_last_version, "outer": self.outer.state_meta(),
                "totals": self.totals}
        return codec.encode(self.outer.state_tensors(), meta)

    def _publish(self, version: int, applied: list[str], parent: str,
                 expected: str | None) -> int:
        nonce = uuid.uuid4().hex[:8]
        gkey = codec.global_key(version, self.epoch, nonce)
        skey = codec.state_key(version, self.epoch, nonce)
        wbytes = codec.encode_global(self.weights, version, self.model_config)
        sbytes = self._state_bytes(version, applied, parent)
        pointer = Pointer(version=version, path=gkey, sha256=codec.sha256(wbytes),
                          weights_digest=codec.tensor_digest(self.weights), outer_step=version,
                          master_epoch=self.epoch, state_path=skey,
                          state_sha256=codec.sha256(sbytes), master=self.node_id,
                          hwm=dict(self.hwm), carry=self.carry_weight(),
                          workers=self._workers(set()), fastest_step_s=self.fastest_step_s())
        pbytes = pointer.to_bytes()
        if getattr(self.store, "single_commit", False):
            try:
                etag = self.store.commit({gkey: wbytes, skey: sbytes},
                                         (POINTER_KEY, pbytes, expected))
            except PreconditionFailed:
                # A retried commit whose first try landed (the reply was lost) finds its own
                # pointer: that is success, as for the file and S3 stores below.
                data, etag = self.store.get_with_etag(POINTER_KEY)
                if data != pbytes:
                    raise
        else:
            self.store.put(gkey, wbytes, if_absent=True)
            self.store.put(skey, sbytes, if_absent=True)
            crash_point("after_weights_written")
            try:
                etag = self.store.swap(POINTER_KEY, pbytes, expected)
            except PreconditionFailed:
                data, etag = self.store.get_with_etag(POINTER_KEY)
                if data != pbytes:  # not our own retried write: someone else moved it
                    raise
        crash_point("after_pointer_written")
        self.pointer, self.pointer_etag = pointer, etag
        return len(wbytes) + len(sbytes) + len(pbytes)

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

    def fastest_step_s(self) -> float:
        """Seconds per inner step of the fastest session heard from in the last 50 listings
        (delta gap / its inner steps; 0 = unknown): workers with ``adaptive_inner_steps``
        shorten their rounds to ``inner_steps * fastest / own`` so all rounds last as long."""
        recent = [v for v, seen in self._step_s.values() if self._round - seen <= 50 and v > 0]
        return min(recent, default=0.0)

    def has_new_deltas(self) -> bool:
        """Whether a listing shows a delta above its session's high-water mark (names only)."""
        for key in self.store.list("nodes/"):
            parsed = codec.parse_delta_key(key)
            if parsed is not None and key not in self.skip and \
                    parsed[2] > self.hwm.get(f"{parsed[0]}/{parsed[1]}", -1):
                return True
        return False

    # ------------------------------------------------------------------ one round
    def _workers(self, batch_nodes: set[str]) -> float:
        if self.cfg.expected_workers:
            return float(self.cfg.expected_workers)
        version = self.pointer.version if self.pointer else 0
        window = max(2, self.cfg.max_staleness)
        recent = {n for n, v in self.node_last_version.items() if v >= version - window}
        return float(max(1, len(recent | batch_nodes)))

    def _validate(self, delta: dict[str, torch.Tensor]) -> str | None:
        if set(delta) != set(self.weights):
            missing = sorted(set(self.weights) - set(delta))[:3]
            extra = sorted(set(delta) - set(self.weights))[:3]
            return f"keys differ (missing {missing}, unexpected {extra})"
        for key, t in delta.items():
            if t.shape != self.weights[key].shape:
                return f"shape of {key}: {tuple(t.shape)} != {tuple(self.weights[key].shape)}"
            if not bool(torch.isfinite(t).all()):
                return f"non-finite values in {key}"
        if self.cfg.max_delta_norm is not None:
            norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in delta.values()))
            if norm > self.cfg.max_delta_norm:
                return f"norm {norm:.4g} above max_delta_norm={self.cfg.max_delta_norm}"
        return None

    def _quarantine(self, key: str, reason: str, stats: MasterStats) -> None:
        logger.warning("diloco master: quarantined %s: %s", key, reason)
        self.quarantined.append([key, reason])
        self.skip.add(key)  # never downloaded again by this master (the hwm covers restarts)
        stats.rejected += 1
        stats.reasons.append(reason)
        self._check_fence()  # a deposed master must not reject or delete anybody's work
        parsed = codec.parse_delta_key(key)
        if parsed is not None:  # tell the sender, so its final sync need not wait for a global
            node, session, seq, _base = parsed
            try:
                self.store.put(codec.rejection_key(node, session, seq),
                               json.dumps({"key": key, "reason": reason}).encode())
            except (StoreError, ValueError) as exc:  # ValueError: a name no valid key allows
                logger.warning("diloco master: could not record the rejection of %s: %s",
                               key, exc)
        if self.cfg.delete_processed:
            try:
                self.store.delete(key)
            except ValueError:
                pass  # listed but not addressable: the high-water mark skips it from now on

    @property
    def max_object_bytes(self) -> int:
        """Largest delta this master downloads (see ``distributed.max_object_mb``)."""
        if self.cfg.max_object_mb is not None:
            return int(self.cfg.max_object_mb * 2**20)
        fp32 = sum(4 * v.numel() for v in self.weights.values())
        return int(1.25 * fp32) + 2**20

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

    def _collect_garbage(self, applied_keys: list[str]) -> None:
        self._check_fence()
        try:
            doomed = list(applied_keys) if self.cfg.delete_processed else []
            keep_from = self.pointer.version - self.cfg.keep_versions + 1
            current = {self.pointer.path, self.pointer.state_path}
            for key in self.store.list("global/v") + self.store.list("master/state-"):
                ver = _version_of(key)
                if ver is None:  # a stray object under our prefixes: not ours to judge
                    if key not in self.skip:
                        self.skip.add(key)
                        logger.warning("diloco master: ignoring unexpected object %s", key)
                    continue
                # An orphan is a failed publish of *this* master's epoch. A newer master's
                # objects (its publish in flight, or its current global while this one is
                # deposed and not yet fenced) have a higher epoch: deleting them by version
                # alone once left the pointer naming a missing global.
                orphan = (ver >= self.pointer.version and key not in current
                          and _epoch_of(key) == self.epoch)
                if ver < keep_from or orphan:
                    doomed.append(key)
            self._check_fence()  # again: listing may have taken retries' worth of time
            self.store.delete_many(doomed)
        except StoreError as exc:  # garbage collection is best effort
            logger.warning("diloco master: cleanup failed (will retry next round): %s", exc)

    def _check_poll_interval(self) -> None:
        """Warn once when this master lists less often than ~4 times per round (the median gap
        between a session's deltas): every listing interval a delta waits is lag for the
        workers that install the global in between (bench_diloco_async.md)."""
        if self._warned_poll or not self._gap:
            return
        gaps = sorted(self._gap.values())
        round_s = gaps[len(gaps) // 2]
        if round_s > 0 and self.cfg.master_poll > 0.25 * round_s:
            self._warned_poll = True
            logger.warning("diloco master: it lists deltas every %.3gs, more than 1/4 of a "
                           "round (%.3gs): set distributed.master_poll_interval <= %.3g",
                           self.cfg.master_poll, round_s, 0.25 * round_s)

    def _check_round_length(self, inner_steps: int) -> None:
        """Warn once when workers' rounds (from their delta headers) are short for the outer
        momentum: the paper's 0.7/0.9 were tuned for rounds of ~500 steps, and with short ones
        the momentum overshoots (bench_diloco.md, H=20: 1.185 against 1.031 at 0.5/0.5)."""
        cfg = self.cfg
        if self._warned_round_length or cfg.outer_optimizer == "sgd" \
                or cfg.outer_momentum < 0.8 or not 0 < inner_steps < 100:
            return
        self._warned_round_length = True
        logger.warning("diloco master: outer_momentum %.2g with rounds of %d inner steps: short "
                       "rounds with a high outer momentum overshoot; docs/diloco.md"
                       "#recommendation starts from outer_lr 0.5, outer_momentum 0.5",
                       cfg.outer_momentum, inner_steps)

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

    def _warn_about_shared_node_ids(self) -> None:
        """Two sessions of one node listing new deltas in the same round, three rounds over:
        two live workers share a ``distributed.node_id`` (a restarted worker's dead session stops
        uploading). Their deltas are all applied and all_done waits for both; say it once."""
        active: dict[str, list[str]] = {}
        for session_key, last in self._last_new.items():
            if last == self._round:
                node, session = session_key.split("/")
                active.setdefault(node, []).append(session)
        for node, sessions in active.items():
            if len(sessions) < 2:
                continue
            self._overlap_rounds[node] = self._overlap_rounds.get(node, 0) + 1
            if self._overlap_rounds[node] == 3:
                logger.warning("diloco master: node %s has %d sessions uploading at the same time "
                               "(%s): do two workers share distributed.node_id? Give each its "
                               "own.", node, len(sessions), ", ".join(sorted(sessions)))

    # ------------------------------------------------------------------ loop
    def all_done(self, expected_nodes: set[str] | None = None, min_nodes: int = 0) -> bool:
        """Every node with an accepted delta (or every expected node) has finished: a session
        of it is done, and each of its other sessions is done too or gone quiet. The caller
        checks after a round that found nothing.

        Best effort, as nothing but uploads says a worker is alive: a session counts as gone
        once it has listed no new delta for three of its own upload intervals (its node's, when
        it uploaded once; at least three poll intervals). A restarted worker's dead session so
        stops counting, while a second live worker under the same node id is waited for as
        long as it keeps its pace."""
        seen = {s.split("/")[0] for s in self.seen_sessions}
        nodes = expected_nodes if expected_nodes is not None else seen
        sessions: dict[str, set[str]] = {}
        for s in self.seen_sessions | self.done_sessions:
            sessions.setdefault(s.split("/")[0], set()).add(s)
        now, finished = self._clock(), set()
        for node, node_sessions in sessions.items():
            done = node_sessions & self.done_sessions
            if not done:
                continue
            node_gap = max((self._gap[s] for s in node_sessions if s in self._gap), default=0.0)
            if all(now - self._last_new_time.get(s, -math.inf)
                   > 3 * max(self._gap.get(s, node_gap), self.cfg.poll_interval)
                   for s in node_sessions - done):
                finished.add(node)
        done = bool(nodes) and nodes <= finished and len(finished) >= min_nodes
        if done and not self._applied_here and not self._warned_finished and \
                self.done_sessions <= (self._done_at_first_listing or set()):
            self._warned_finished = True
            logger.warning("diloco master: the run in %s was finished before this master "
                           "started (v%s, every node it tracks is done), so it ends now. For "
                           "a new run use an empty distributed.store: workers started on this "
                           "one continue v%s and nothing applies their deltas", self.store.url,
                           getattr(self.pointer, "version", "?"),
                           getattr(self.pointer, "version", "?"))
        return done

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


# The name suffix of every global and master state (codec.global_key / state_key): version,
# epoch, nonce. A global and the state published with it share it.
_NAME_SUFFIX = re.compile(r"v(\d{8})-e(\d{4,})-[0-9a-f]+\.safetensors")
_VERSIONED = re.compile(rf"(?:global/|master/state-){_NAME_SUFFIX.pattern}")


def _version_of(key: str) -> int | None:
    """The version in a global or master-state name this code writes, else None."""
    m = _VERSIONED.fullmatch(key)
    return int(m.group(1)) if m else None


def _epoch_of(key: str) -> int | None:
    """The master epoch in a global or master-state name this code writes, else None."""
    m = _VERSIONED.fullmatch(key)
    return int(m.group(2)) if m else None
