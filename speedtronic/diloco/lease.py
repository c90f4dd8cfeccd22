"""The DiLoCo master's lease and fencing: one master publishes at a time, across crashes.

The lease is ``master/lease.json``, renewed by a compare-and-swap at the start of every round
(:meth:`MasterLease.renew_lease`). A lease held by another node is taken over only after it went
``lease_ttl`` seconds without renewal, timed on this process's monotonic clock so wall clocks
need not agree; so is one held under this node id by a live process (a standby started from
the same config). A restarted master (same node id, same host, the old process gone) takes it
over at once. A new holder takes the next epoch and at once stamps the pointer with it
(:meth:`MasterLease._fence`): the pointer's etag changes, so an older master that lost the lease
mid-round fails its next swap, and its writes that cannot be undone check the pointer's epoch
first (:meth:`MasterLease._check_fence`).

:class:`MasterLease` is mixed into :class:`~speedtronic.diloco.master.Master`, whose ``store``,
``cfg``, ``node_id`` and ``session`` it reads.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .codec import LEASE_KEY, POINTER_KEY, FormatError, Pointer
from .store import ObjectNotFound, PreconditionFailed, StoreError

logger = logging.getLogger("speedtronic.diloco.master")

__all__ = ["LeaseLost", "MasterLease"]


class LeaseLost(StoreError):
    """Another master holds the lease now; this one must stop publishing."""


def _read_lease(data: bytes) -> dict[str, Any]:
    """The lease as a dict; a damaged one reads as held by nobody known, so the usual
    ``lease_ttl`` wait applies (a live holder's renewals replace it) and then it is taken over,
    instead of stopping every master on every restart."""
    try:
        lease = json.loads(data)
        if isinstance(lease, dict) and isinstance(lease.get("epoch", 0), int):
            return lease
        raise ValueError("not a lease object")
    except ValueError as exc:
        logger.warning("diloco master: %s is unreadable (%s); treating it as an unknown holder",
                       LEASE_KEY, exc)
        return {"holder": "<unreadable lease>", "epoch": 0}


def _process_identity() -> dict[str, Any]:
    """Where this process's pid means something: host name, boot and pid namespace (two
    containers can share a host name, and each may be pid 1, without sharing pids)."""
    identity: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid()}
    try:
        identity["boot"] = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        identity["pidns"] = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # not Linux: a pid cannot be placed, so no lease is taken over early
        pass
    return identity


def _dead_predecessor(lease: dict[str, Any]) -> bool:
    """True when ``lease`` was written in this host's boot and pid namespace by a process that
    no longer runs, or by this very process. Anything that cannot be placed there (another
    host or container, a lease of an older version without these fields): False, and the
    ``lease_ttl`` wait applies."""
    pid, here = lease.get("pid"), _process_identity()
    if "pidns" not in here or not isinstance(pid, int) or pid <= 0 or any(
            lease.get(k) != here[k] for k in ("host", "boot", "pidns")):
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except OSError:  # PermissionError: alive, another user's
        return False
    return False


class MasterLease:
    """Acquire, renew and fence the master lease."""

    def _lease_bytes(self, epoch: int, renewals: int) -> bytes:
        return json.dumps({"holder": self.node_id, "session": self.session, "epoch": epoch,
                           "renewals": renewals, "ttl": self.cfg.lease_ttl,
                           **_process_identity(), "at": time.time()}).encode()

    def acquire_lease(self, stop: threading.Event, timeout: float | None = None) -> bool:
        """Block until this master holds the lease (or ``stop``/``timeout``). A lease held by
        another node is taken over only after it went ``lease_ttl`` seconds without renewal
        (observed here on the monotonic clock, so wall clocks need not agree). A lease held by
        this same node id is taken over at once only when it is a restart: written on this
        host by a process that is gone (:func:`_dead_predecessor`). A second live master started
        with the same config once deposed the running one at once; it now stands by."""
        deadline = None if timeout is None else time.monotonic() + timeout
        seen, since, told = None, time.monotonic(), False
        while not stop.is_set():
            try:
                data, etag = self.store.get_with_etag(LEASE_KEY)
                lease = _read_lease(data)
            except ObjectNotFound:
                data, etag, lease = None, None, {}
            pointer_epoch = self._peek_pointer_epoch()
            epoch = max(int(lease.get("epoch", 0)), pointer_epoch) + 1
            if etag != seen:
                seen, since = etag, time.monotonic()
            restart = lease.get("holder") == self.node_id and _dead_predecessor(lease)
            takeover = (data is None or restart
                        or time.monotonic() - since >= self.cfg.lease_ttl)
            if takeover:
                try:
                    self.lease_etag = self.store.swap(LEASE_KEY, self._lease_bytes(epoch, 0), etag)
                    self.epoch, self._renewals = epoch, 0
                    logger.info("diloco master %s holds the lease (epoch %d)", self.node_id, epoch)
                    self._fence()
                    return True
                except PreconditionFailed:
                    continue
            if not told:
                same = (" under this same node id (a live duplicate, or a restart on another "
                        "host; give a standby master its own distributed.node_id)"
                        if lease.get("holder") == self.node_id else "")
                logger.warning("diloco master %s: lease held by %s (epoch %s, host %s, pid %s)%s; "
                               "standing by until it goes %.0fs without renewal", self.node_id,
                               lease.get("holder"), lease.get("epoch"), lease.get("host", "?"),
                               lease.get("pid", "?"), same, self.cfg.lease_ttl)
                told = True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            stop.wait(min(self.cfg.master_poll, self.cfg.lease_ttl / 4))
        return False

    def _fence(self) -> None:
        """Stamp the pointer with this master's epoch at once (same version, new bytes).

        The lease alone is checked when a round starts, so a master that lost it mid-round could
        still swap the pointer. Rewriting the pointer here changes its etag: every later swap by
        an older master fails (and it stops), and its destructive writes check the pointer's
        epoch first (:meth:`_check_fence`). A publish that lands between our read and our swap
        is adopted: the loop re-reads and stamps the newer pointer."""
        while True:
            try:
                data, etag = self.store.get_with_etag(POINTER_KEY)
            except ObjectNotFound:
                return  # nothing published yet: bootstrap writes our epoch
            try:
                pointer = Pointer.from_bytes(data)
            except FormatError:
                return  # unreadable: load_or_bootstrap rebuilds it, stamped with our epoch
            if pointer.master_epoch >= self.epoch:
                return
            stamped = Pointer(**{**asdict(pointer), "master_epoch": self.epoch,
                                 "master": self.node_id})
            try:
                self.store.swap(POINTER_KEY, stamped.to_bytes(), etag)
                logger.info("diloco master %s fenced v%d at epoch %d", self.node_id,
                            pointer.version, self.epoch)
                return
            except PreconditionFailed:
                continue

    def _check_fence(self) -> None:
        """Raise LeaseLost when a newer master has stamped the pointer (see :meth:`_fence`);
        called before every write that cannot be undone (rejections, deletions)."""
        current = self._peek_pointer_epoch()
        if current > self.epoch:
            raise LeaseLost(f"master {self.node_id} (epoch {self.epoch}) is fenced: epoch "
                            f"{current} holds the store")

    def _peek_pointer_epoch(self) -> int:
        try:
            return Pointer.from_bytes(self.store.get(POINTER_KEY)).master_epoch
        except (ObjectNotFound, FormatError):  # none yet, or damaged (the lease still rules)
            return 0

    def renew_lease(self) -> None:
        self._renewals += 1
        try:
            self.lease_etag = self.store.swap(
                LEASE_KEY, self._lease_bytes(self.epoch, self._renewals), self.lease_etag)
        except (PreconditionFailed, ObjectNotFound) as exc:
            # A retried swap whose first try landed sees its own write: still ours.
            try:
                data, etag = self.store.get_with_etag(LEASE_KEY)
                lease = _read_lease(data)
            except ObjectNotFound:
                lease, etag = {}, None
            if lease.get("session") == self.session and lease.get("epoch") == self.epoch:
                self.lease_etag = etag
                return
            raise LeaseLost(f"master {self.node_id} lost the lease (epoch {self.epoch}) to "
                            f"{lease.get('holder')} (epoch {lease.get('epoch')})") from exc
