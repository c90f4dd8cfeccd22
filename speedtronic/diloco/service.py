"""Running a master inside ``speedtronic train`` and as a standalone process.

``role: master`` under ``speedtronic train`` (:class:`MasterNode`): the node trains like a
worker *and* runs the master loop in a background thread. It bootstraps version 0 from its own
initial weights (every node builds the same seeded model), and after its own training ends it
keeps aggregating until every node it has seen has written its done marker, or
``master_idle_timeout`` seconds pass without a new delta. Its final model is the last global.

``python -m speedtronic.diloco master --config run.yaml`` (:func:`run_master`): a master that does
not train (a small coordinator machine); it builds the model only to publish version 0.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ..config import DistributedConfig, SpeedtronicConfig
from ..errors import SpeedtronicError, first_line
from .master import LeaseLost, Master
from .node import Worker, default_node_id, run_stopped_by, sync_parameters
from .store import open_configured_store, probe_conditional_writes

logger = logging.getLogger("speedtronic.diloco.service")


class MasterThread:
    """Owns a :class:`Master` in a daemon thread: lease, bootstrap, rounds, clean stop."""

    def __init__(self, cfg: DistributedConfig, node_id: str,
                 initial: Callable[[], dict[str, torch.Tensor]],
                 log_metrics: Callable[[dict], None] | None = None,
                 model_config: dict[str, Any] | None = None) -> None:
        self.stop = threading.Event()
        self.store = open_configured_store(cfg, stop=self.stop)
        self.master = Master(self.store, cfg, node_id, initial, log_metrics, model_config)
        self.until: Callable[[Master], bool] | None = None
        self.idle_timeout = 0.0
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True,
                                        name=f"diloco-master-{node_id}")

    def start(self) -> None:
        self._thread.start()

    def _main(self) -> None:
        try:
            if self.store.supports_cas:
                probe_conditional_writes(self.store, self.master.node_id)
            if not self.master.acquire_lease(self.stop):
                return
            self.master.load_or_bootstrap()
            self.ready.set()
            self.master.run(self.stop, until=lambda m: self.until is not None and self.until(m),
                            idle_timeout=0.0)
        except LeaseLost as exc:
            logger.error("diloco master stopped: %s", exc)
            self.error = exc
        except BaseException as exc:  # surfaced to the training thread at the end
            if isinstance(exc, SpeedtronicError):  # a store or config problem: its one line
                logger.error("diloco master stopped: %s", exc)
            else:
                logger.exception("diloco master failed")
            self.error = exc
        finally:
            self.ready.set()

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()


class MasterNode:
    """``role: master`` callback: trains as a worker and runs the master thread."""

    name = "diloco"

    def __init__(self, cfg: DistributedConfig) -> None:
        self.cfg = cfg
        self.worker = Worker(cfg)
        self.node_id = self.worker.node_id
        self.thread: MasterThread | None = None
        self._train_done = False
        self._reported = False

    def on_train_start(self, trainer: Any) -> None:
        """Start the master thread (it adopts the store's state or publishes v0 from this node's
        initial weights), then start the worker, which waits for that global."""
        params = sync_parameters(trainer.model)
        initial = lambda: {k: p.detach().float().cpu().clone() for k, p in params.items()}
        config = getattr(trainer, "config", None)
        self.thread = MasterThread(self.cfg, self.node_id, initial,
                                   getattr(trainer, "log_metrics", None),
                                   config.to_dict(redact=True)["model"] if config else None)
        self.thread.until = self._finished
        self.thread.start()
        self.worker.on_train_start(trainer)  # waits for v0, which the thread publishes

    def _finished(self, m: Master) -> bool:
        if not self._train_done:
            return False
        idle = time.monotonic() - m.last_new_delta
        if idle > self.cfg.master_idle_timeout:
            logger.info("diloco master: no new delta for %.0fs after training; stopping", idle)
            return True
        # expected_workers (when set) is also how many finished nodes to wait for: nodes that
        # start after everyone seen so far finished would otherwise find the master gone.
        return m.all_done(min_nodes=self.cfg.expected_workers or 0)

    def _raise_if_master_died(self) -> None:
        """A dead master thread fails the run: nothing would aggregate this node's work (or
        anyone else's) again, so training on would only burn compute."""
        err = self.thread.error if self.thread is not None else None
        if err is not None and not self._reported:
            self._reported = True
            raise SpeedtronicError(f"diloco master thread died: {type(err).__name__}: "
                                   f"{first_line(err, empty='')}"
                                   " (the run stops; the log above has the details)")

    def after_optimizer_step(self, trainer: Any, step: int) -> None:
        """The worker's step; a dead master thread raises SpeedtronicError first (nothing would
        aggregate the work)."""
        self._raise_if_master_died()
        self.worker.after_optimizer_step(trainer, step)

    def on_train_end(self, trainer: Any) -> None:
        """End the worker, keep aggregating until every node is done (or none sent a delta for
        ``master_idle_timeout``), then sync to the final global. A run stopped early stops the
        master thread instead; a master thread that died raises SpeedtronicError."""
        try:
            self.worker.on_train_end(trainer)
        except BaseException:  # this node's last rounds failed to go out: stop aggregating too
            if self.thread is not None:
                self.thread.stop.set()
                self.thread.join(30)
            raise
        self._train_done = True
        if self.thread is not None and run_stopped_by(trainer) is not None:
            # Interrupted: stop aggregating now (the store holds its state; --resume restarts
            # it) instead of waiting for every other node to finish.
            logger.info("diloco master: run stopped early; the master thread stops too")
            self.thread.stop.set()
            self.thread.join(30)
            return
        if self.thread is not None:
            logger.info("diloco master: training done; aggregating until every node is done "
                        "(or none sends a delta for %gs: distributed.master_idle_timeout)",
                        self.cfg.master_idle_timeout)
            self.thread.join()
            if self.thread.error is None:
                self.worker.final_sync(trainer, timeout=max(5.0, self.cfg.poll_interval * 4))
            else:
                self._raise_if_master_died()

    def state_dict(self) -> dict:
        """The worker's state (the master's own state lives in the store)."""
        return self.worker.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Hand ``state`` to the worker (the master thread reloads its state from the store)."""
        self.worker.load_state_dict(state)


def build_callbacks(cfg: SpeedtronicConfig) -> list[Any]:
    """Trainer callbacks for ``cfg.distributed`` (the runtime calls this when enabled)."""
    d = cfg.distributed
    if not d.enabled:
        return []
    if d.num_shards == 1:
        logger.info("diloco: data shard 0/1 - nodes with this setting see the same samples; set "
                    "distributed.shard/num_shards per node for disjoint data")
    return [MasterNode(d)] if d.role == "master" else [Worker(d)]


def run_master(cfg: SpeedtronicConfig, *, expect_nodes: set[str] | None = None,
               idle_timeout: float | None = None) -> Master:
    """Master-only loop for ``python -m speedtronic.diloco master``; returns when every node it
    has seen (or every expected node) is done, or after ``idle_timeout`` idle seconds."""
    from ..data import check_data
    from ..models import build_model

    d = cfg.distributed
    node_id = d.node_id or default_node_id()
    if cfg.model.vocab_size is None:
        check_data(cfg)  # the vocabulary follows the data (tokenizer), as in a training node

    def initial() -> dict[str, torch.Tensor]:
        torch.manual_seed(cfg.run.seed)
        model = build_model(cfg.model)
        return {k: p.detach().float().clone() for k, p in sync_parameters(model).items()}

    thread = MasterThread(d, node_id, initial, model_config=cfg.to_dict(redact=True)["model"])
    idle = d.master_idle_timeout if idle_timeout is None else idle_timeout
    if not idle >= 0:
        raise ValueError(f"--idle-timeout: must be >= 0 seconds or inf (no limit), got {idle}")
    # as distributed.master_idle_timeout reads everywhere: .inf is no limit, 0 stops at once
    # (here 0 once meant no limit, the opposite of a training master's 0)
    thread.until = lambda m: m.all_done(expect_nodes, d.expected_workers or 0) or (
        time.monotonic() - m.last_new_delta > idle)
    thread.start()
    try:
        thread.join()
    except KeyboardInterrupt:
        thread.stop.set()
        thread.join(30)
    if thread.error is not None:
        raise thread.error
    return thread.master
