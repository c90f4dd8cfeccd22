"""What the DiLoCo master learns about the sessions behind the deltas from its listings.

Nothing but uploads says a worker is alive, so the master times each session's new deltas
(run_once records when it listed them). From those times come: the fastest worker's seconds per
inner step, which goes into the pointer for ``adaptive_inner_steps``; warnings said once (a poll
interval too long for the rounds, short rounds under a high outer momentum, two live workers
sharing a node id); and :meth:`SessionWatch.all_done`, which decides when the run is over.

:class:`SessionWatch` is mixed into :class:`~speedtronic.diloco.master.Master`.
"""

from __future__ import annotations

import logging
import math

logger = logging.getLogger("speedtronic.diloco.master")


class SessionWatch:
    """Pace, sharing and completion of the sessions that upload deltas."""

    def fastest_step_s(self) -> float:
        """Seconds per inner step of the fastest session heard from in the last 50 listings
        (delta gap / its inner steps; 0 = unknown): workers with ``adaptive_inner_steps``
        shorten their rounds to ``inner_steps * fastest / own`` so all rounds last as long."""
        recent = [v for v, seen in self._step_s.values() if self._round - seen <= 50 and v > 0]
        return min(recent, default=0.0)

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
