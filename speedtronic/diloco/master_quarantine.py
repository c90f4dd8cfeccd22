"""What the DiLoCo master refuses, and how: the tensor checks and the quarantine of a delta.

:meth:`MasterRound.run_once <speedtronic.diloco.master_round.MasterRound.run_once>` refuses a
delta that is too large to download (:attr:`DeltaQuarantine.max_object_bytes`), unreadable,
misnamed, ahead of the master or too stale; :meth:`DeltaQuarantine._validate` then checks its
tensors (keys, shapes, finite values, the optional norm bound). Every refusal ends in
:meth:`DeltaQuarantine._quarantine`: logged with its reason, recorded in the master state,
skipped from then on, and answered with a rejection receipt so the sender's final sync need not
wait for a global that will never hold it.

:class:`DeltaQuarantine` is mixed into :class:`~speedtronic.diloco.master.Master`.
"""

from __future__ import annotations

import json
import logging
import math

import torch

from . import codec
from .master_round import MasterStats
from .store import StoreError

logger = logging.getLogger("speedtronic.diloco.master")


class DeltaQuarantine:
    """Checks on a downloaded delta, and the quarantine of one that fails them."""

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
