"""The DiLoCo master's state in the store: adopt or bootstrap it, publish it, clean up after it.

Everything a restarted master needs lives in the store, never on its disk: the global, the
master state (outer momentum, high-water marks, quarantine, totals) and ``global/latest.json``,
which names both. :meth:`MasterPublication._publish` writes the two objects under fresh
immutable names and then swaps the pointer on the etag this master last wrote - the commit
point. :meth:`MasterPublication.load_or_bootstrap` adopts what the pointer names (or rebuilds a
damaged pointer from the newest complete pair), and
:meth:`MasterPublication._collect_garbage` deletes applied deltas and versions older than
``keep_versions``, but never a newer master's objects.

:class:`MasterPublication` is mixed into :class:`~speedtronic.diloco.master.Master`.
"""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any

from . import codec
from .codec import POINTER_KEY, FormatError, Pointer
from .faults import crash_point
from .store import ObjectNotFound, PreconditionFailed, StoreError

logger = logging.getLogger("speedtronic.diloco.master")

_QUARANTINE_LOG = 1000  # newest quarantine records kept in the state (older ones only logged)


class MasterPublication:
    """Load, publish and garbage-collect the global and master state."""

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
