"""Fault-tolerant replica groups on torchft: ``torchft.mode: ddp`` and ``torchft.mode: diloco``.

A *replica group* is one ``speedtronic train`` process holding a full replica, or a torchrun
job of W ranks (DDP inside the group; every rank runs a Manager, rank 0's talks to the
Lighthouse, and rank r is paired with rank r of the other groups). A torchft
Lighthouse (``torchft_lighthouse``, one per job) decides at each step which groups are alive
(the *quorum*); every group runs a torchft ``Manager`` that joins the quorum, reconfigures the
cross-group process group when it changes, and *heals* a group that is behind (restarted, or
new) by fetching a live peer's state over HTTP before it takes part again.

* ``ddp``: every step, the quorum is started before the forward (asynchronously: it overlaps
  the micro-batches), the accumulated gradients are averaged over the live groups in one
  flat all-reduce per dtype after backward, and the update is applied only if every group of
  the quorum votes to commit. A step that does not commit is dropped: no update, no schedule
  move, no step counted (the next batch retries it).
* ``diloco``: synchronous DiLoCo (torchft's ``local_sgd.DiLoCo``): ``inner_steps`` local
  steps of our optimizer, then the groups' pseudo-gradients are averaged and one outer
  Nesterov-SGD step is taken; a round that does not commit is discarded (weights back to the
  last global).

What is healed: model weights, optimizer and schedule state, the GradScaler and the step
counter (and, under ``diloco``, the last global and the outer momentum). What is not: the data
position. A healed group goes on with its own shard from where its process is (a restarted one
from its checkpoint, or from the start), so some samples can be seen twice or not at all
across a failure; torchft's own trainers behave the same.

What listens where: the Manager server and the healing HTTP server bind every interface
(torchft binds ``[::]``; ``torchft.manager_port`` picks the Manager's port), the group's
TCPStore too; ``torchft.hostname`` is the address advertised to the other groups. Keep the
job on a private network. Tests run everything on 127.0.0.1.

The trainer asks this module through :meth:`ReplicaGroups.begin_step` and
:meth:`ReplicaGroups.commit` (``ddp``) or not at all (``diloco`` hooks the optimizer's step);
the checkpoint holds the Manager's step (:meth:`ReplicaGroups.state_dict`).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
import warnings
from typing import Any

import torch
from torch import nn

from ..config import ConfigError, SpeedtronicConfig
from ..errors import SpeedtronicError
from .process_group import torchrun_world_size

logger = logging.getLogger("speedtronic.torchft")

__all__ = ["ReplicaGroups", "check_supported", "require_torchft"]

_STATE_KEY = "speedtronic"


def require_torchft() -> Any:
    """Import torchft (quietly: its Rust side logs every quorum at INFO unless ``RUST_LOG`` says
    otherwise) or fail with how to install it."""
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
    except ImportError as exc:
        raise ConfigError(f"torchft.mode needs the torchft package ({exc}): pip install "
                          "'speedtronic[ft]' (torchft 0.2), or set torchft.mode: off") from None
    for name in ("torchft_quorums", "torchft_commits", "torchft_errors", "torchft"):
        if logging.getLogger(name).level == logging.NOTSET:
            logging.getLogger(name).setLevel(logging.WARNING)
    if not any(isinstance(f, _NoFlightRecorderNotice)
               for f in logging.getLogger("torchft.manager").filters):
        logging.getLogger("torchft.manager").addFilter(_NoFlightRecorderNotice())
    # A healing transfer loads tensors from a read-only buffer, and torch warns once about it;
    # the loaded state is copied into our own tensors (load_state_dict), never written there.
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    return torchft


def _all_gather() -> Any:
    """torch 2.13 renamed ``all_gather_into_tensor`` (and warns on the old name); 2.11, the
    H200's, only has the old one."""
    import torch.distributed as dist

    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _NoFlightRecorderNotice(logging.Filter):
    """Drops torchft's warning, at every quorum change, that it cannot reset NCCL's flight
    recorder: it says nothing about training (gloo has no flight recorder at all)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "flight recorder" not in record.getMessage()


def check_supported(cfg: SpeedtronicConfig) -> None:
    """Refuse, before anything is built, what does not run correctly with torchft groups."""
    ft = cfg.torchft
    mode = f"torchft.mode: {ft.mode}"
    if torchrun_world_size() > 1:  # a replica group of several ranks (DDP inside it)
        dp = cfg.data_parallel
        for on, what, why in [
                (dp.zero1, "data_parallel.zero1: true", "a healing peer's optimizer state "
                 "would be gathered by one rank, outside the lock-step of the others"),
                (dp.reduce_scatter_muon, "data_parallel.reduce_scatter_muon: true",
                 "the average across groups needs every rank's whole gradient")]:
            if on:
                raise ConfigError(f"{mode} under torchrun with {what}: {why}; turn it off")
    if cfg.distributed.enabled:
        raise ConfigError(f"{mode} with distributed.enabled: true: torchft groups and "
                          "object-store DiLoCo are two ways to combine replicas; pick one "
                          "(torchft.mode: diloco is DiLoCo inside a cluster)")
    if cfg.ooo_backprop:
        raise ConfigError(f"{mode} with ooo_backprop: true: gradients are averaged across "
                          "groups once backward ends, and deferred weight gradients would "
                          "still be in flight; set ooo_backprop: false")
    if cfg.optimizer.cuda_graph != "off":
        raise ConfigError(f"{mode} with optimizer.cuda_graph: {cfg.optimizer.cuda_graph}: a "
                          "replayed graph skips the commit vote and the DiLoCo hooks; set "
                          "optimizer.cuda_graph: off")
    if ft.mode == "diloco" and cfg.run.max_steps < ft.inner_steps:
        logger.warning("torchft.inner_steps=%d exceeds run.max_steps=%d: the groups never "
                       "synchronize", ft.inner_steps, cfg.run.max_steps)
    if ft.min_replica_size == ft.replica_groups and ft.replica_groups > 1:
        logger.warning("torchft.min_replica_size=%d equals torchft.replica_groups: while any "
                       "group is down no step commits (after %d tries the run stops with an "
                       "error); set min_replica_size below %d to train through a failure",
                       ft.min_replica_size, ft.max_commit_failures, ft.replica_groups)
    require_torchft()


class ReplicaGroups:
    """This process's torchft Manager and what the trainer needs from it.

    Built by :func:`speedtronic.train.runtime` after the trainer (the healing state reads the
    trainer's step) and before a resume (the checkpoint restores the Manager's step). It is one
    of the trainer's callbacks (checkpoint state, the DiLoCo round count, shutdown) and, under
    ``ddp``, the trainer's ``replicas`` (the per-step calls)."""

    name = "torchft"

    def __init__(self, cfg: SpeedtronicConfig, trainer: Any) -> None:
        torchft = require_torchft()
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        ft = cfg.torchft
        assert ft.replica_group is not None and ft.lighthouse is not None  # validated
        self.cfg = ft
        self.mode = ft.mode
        self.trainer = trainer
        self.group = ft.replica_group
        self.commit_failures = 0
        """Consecutive steps (ddp) or rounds (diloco) that did not commit."""
        self.heals = 0
        """Times this group loaded a live peer's state."""
        self.participants = 0
        """Groups in the last quorum."""
        timeout = datetime.timedelta(seconds=ft.timeout_s)
        host = ft.hostname or socket.gethostname()
        dp = trainer.dp
        # The Manager needs a TCPStore of its group. Under torchrun the group's ranks share
        # torchrun's (torchft keeps its keys under its own prefix); a lone process hosts its
        # own (port 0: any free one). Other groups reach the Manager at `host`.
        self._store: Any = None
        if dp is None:
            self._store = torch.distributed.TCPStore(host, 0, is_master=True,
                                                     wait_for_workers=False, timeout=timeout)
            self._store_at = (host, self._store.port)
        else:
            self._store_at = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        self.group_rank, self.group_size = (0, 1) if dp is None else (dp.rank, dp.world_size)
        on_cuda = trainer.device.type == "cuda"
        pg = ProcessGroupNCCL(timeout=timeout) if on_cuda else ProcessGroupGloo(timeout=timeout)
        try:
            self.manager = self._build_manager(torchft, pg, host, timeout)
        except Exception as exc:  # noqa: BLE001 - torchft raises RuntimeError from Rust
            raise SpeedtronicError(
                f"torchft: cannot join the job through the Lighthouse at {ft.lighthouse} "
                f"({str(exc).splitlines()[0][:300]}); start it first (torchft_lighthouse "
                "--min_replicas 1 --bind [::]:29510) and check torchft.lighthouse / "
                "TORCHFT_LIGHTHOUSE") from None
        self._flat: dict[torch.dtype, torch.Tensor] = {}  # ddp: gradient all-reduce buffers
        self._at_begin: tuple[int, int, int] | None = None  # (step, tokens, samples), ddp
        self._diloco: Any = None
        if ft.mode == "diloco":
            from torchft.local_sgd import DiLoCo

            model = trainer.model
            self._outer = torch.optim.SGD(model.parameters(), lr=ft.outer_lr,
                                          momentum=ft.outer_momentum, nesterov=True)
            self._diloco = DiLoCo(self.manager, [model], trainer.optimizer, self._outer,
                                  sync_every=ft.inner_steps)
            self._diloco._step_post_hook = self._explained(self._diloco._step_post_hook)
            self._diloco.__enter__()  # hooks the optimizer's step (the wrapped hook above)
            self._round_start = self.manager.current_step()
        logger.info("torchft: replica group %d of %d (%s), %d rank(s), lighthouse %s, "
                    "min_replica_size %d, %s", self.group, ft.replica_groups, ft.mode,
                    self.group_size, ft.lighthouse, ft.min_replica_size,
                    "gloo" if not on_cuda else "nccl")

    def _no_quorum(self, exc: BaseException, what: str) -> SpeedtronicError:
        return SpeedtronicError(
            f"torchft: no quorum for {what} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:300] if str(exc) else ''}); is the Lighthouse at "
            f"{self.cfg.lighthouse} running and reachable, with --min_replicas groups started? "
            "(torchft.quorum_timeout_s bounds the wait)")

    def _explained(self, hook: Any) -> Any:
        """DiLoCo's optimizer hook, with torchft's raw quorum failure (a timeout from its Rust
        client, raised inside ``optimizer.step()``) turned into the error a user can act on.
        Failed collectives do not raise: torchft reports them as a round that did not commit."""

        def step_post_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
            try:
                hook(optimizer, args, kwargs)
            except Exception as exc:  # noqa: BLE001 - torchft raises plain exceptions
                raise self._no_quorum(exc, f"the DiLoCo round at step {self.trainer.step + 1}"
                                      ) from exc

        return step_post_hook

    def _build_manager(self, torchft: Any, pg: Any, host: str,
                       timeout: datetime.timedelta) -> Any:
        ft = self.cfg
        return torchft.Manager(
            pg=pg, load_state_dict=self._load_peer_state, state_dict=self._peer_state,
            min_replica_size=ft.min_replica_size,
            # ddp: the quorum overlaps the forward; DiLoCo needs it synchronous (torchft
            # refuses otherwise) and asks for it only at a round's end.
            use_async_quorum=ft.mode == "ddp",
            timeout=timeout, quorum_timeout=datetime.timedelta(seconds=ft.quorum_timeout_s),
            connect_timeout=timeout, rank=self.group_rank, world_size=self.group_size,
            store_addr=self._store_at[0], store_port=self._store_at[1],
            lighthouse_addr=ft.lighthouse,
            replica_id=f"speedtronic_{self.group}", port=ft.manager_port, hostname=host,
            # every group builds the same initial weights from run.seed: no transfer at step 0
            init_sync=False)

    # -- healing state (called by torchft: sent from a live peer, loaded by a healing group) --
    def _counters(self) -> tuple[int, int, int]:
        """``(step, tokens, samples)`` as they stood when this step began: under ``ddp`` the
        asynchronous quorum sends the healing state from torchft's thread while the trainer's
        thread counts this step's micro-batches (a healed group once ended one micro-batch,
        128 tokens, short of its peer). Weights and step change only after the commit."""
        t = self.trainer
        if self._at_begin is not None and self._at_begin[0] == t.step:
            return self._at_begin
        return t.step, t.tokens, t.samples

    def _peer_state(self) -> dict[str, Any]:
        t = self.trainer
        step, tokens, samples = self._counters()
        return {"model": t.model.state_dict(), "optimizer": t.optimizer.state_dict(),
                "scheduler": t.scheduler.state_dict() if t.scheduler is not None else None,
                "scaler": t.scaler.state_dict() if t.scaler is not None else None,
                "step": step, "tokens": tokens, "samples": samples}

    def _load_peer_state(self, state: dict[str, Any]) -> None:
        t = self.trainer
        t0 = time.perf_counter()
        behind = state["step"] - t.step
        t.model.load_state_dict(state["model"])
        t.optimizer.load_state_dict(state["optimizer"])
        if t.scheduler is not None and state["scheduler"] is not None:
            t.scheduler.load_state_dict(state["scheduler"])
        if t.scaler is not None and state["scaler"] is not None:
            t.scaler.load_state_dict(state["scaler"])
        # the counters follow the step: two groups at one step once logged 896 and 1920 tokens;
        # the peer's stand at the start of the step, and this group's micro-batches of the
        # step it is healed inside count on top, as the peer's own will
        _, own_tokens, own_samples = self._counters()
        tokens, samples = state.get("tokens"), state.get("samples")
        t.jump_to_step(state["step"],
                       None if tokens is None else tokens + t.tokens - own_tokens,
                       None if samples is None else samples + t.samples - own_samples)
        self.heals += 1
        logger.warning("torchft: replica group %d healed from a live peer at step %d (%+d "
                       "steps; loaded in %.3f s)", self.group, t.step, behind,
                       time.perf_counter() - t0)
        t.metrics.emit("torchft_heal", {"step": t.step, "behind": behind, "group": self.group})

    # -- ddp: the trainer's per-step calls ------------------------------------------------------
    def begin_step(self) -> None:
        """Start this step's quorum (asynchronous under ``ddp``: it overlaps the forward)."""
        t = self.trainer
        self._at_begin = (t.step, t.tokens, t.samples)
        if self.mode == "ddp":
            self.manager.start_quorum()

    def commit(self, params: list[nn.Parameter]) -> bool:
        """Average the step's gradients over the live groups, then vote; True = apply it.

        One flat all-reduce per gradient dtype (a parameter without a gradient sends zeros, so
        every group sends the same buffers). A group being healed sends zeros too and torchft
        divides by the groups that count; it then loads its peer's state here, before the
        update, and applies the same averaged gradient: it leaves the step bitwise equal.

        A group of W torchrun ranks holds one gradient, DDP's average, on every rank: rank r
        averages only slice r of the flat buffer with rank r of the other groups (torchft pairs
        equal group ranks), and an all-gather inside the group reassembles it. Across groups
        each rank then sends 1/W of the gradient, not all of it W times over."""
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        for dtype, group in by_dtype.items():
            grads = [p.grad for p in group]
            # one flat buffer per dtype, allocated once: the same size every step
            n = sum(g.numel() for g in grads)  # type: ignore[union-attr]
            per = -(-n // self.group_size)  # slice per group rank (the last one padded)
            padded = self._flat.get(dtype)
            if padded is None:
                padded = self._flat[dtype] = torch.zeros(per * self.group_size, dtype=dtype,
                                                         device=grads[0].device)
            flat = padded[:n]
            torch.cat([g.reshape(-1) for g in grads], out=flat)  # type: ignore[union-attr]
            mine = padded if self.group_size == 1 else \
                padded[self.group_rank * per:(self.group_rank + 1) * per].clone()
            try:  # waits for the quorum: a Lighthouse that never forms one raises here
                self.manager.allreduce(mine).wait()
            except Exception as exc:  # noqa: BLE001 - torchft raises plain exceptions
                raise self._no_quorum(exc, f"step {self.trainer.step + 1}") from exc
            if self.group_size > 1:  # every rank of the group gets every averaged slice
                _all_gather()(padded, mine)
            sizes = [g.numel() for g in grads]  # type: ignore[union-attr]
            torch._foreach_copy_(grads, [f.view_as(g) for f, g in  # type: ignore[arg-type]
                                         zip(flat.split(sizes), grads, strict=True)])
        committed = self.manager.should_commit()
        self._saw_quorum(self.manager.num_participants(), self.trainer.step + 1)
        self._count(committed, "step")
        return committed

    def _saw_quorum(self, participants: int, step: int) -> None:
        """Log a change in how many groups train together (a group lost, one healed back)."""
        if participants != self.participants:
            logger.info("torchft: step %d: %d replica group(s) in the quorum (was %d)", step,
                        participants, self.participants)
            self.trainer.metrics.emit("torchft_quorum", {"step": step,
                                                         "participants": participants})
        self.participants = participants

    # -- diloco: after each inner step ----------------------------------------------------------
    def after_optimizer_step(self, trainer: Any, step: int) -> None:
        """Count a DiLoCo round that did not commit (its work is discarded by torchft)."""
        if self._diloco is None or step % self.cfg.inner_steps:
            return
        now = self.manager.current_step()
        self._saw_quorum(self.manager.num_participants(), step)
        self._count(now > self._round_start, "round")
        self._round_start = now

    def _count(self, committed: bool, what: str) -> None:
        if committed:
            self.commit_failures = 0
            return
        self.commit_failures += 1
        ft = self.cfg
        step = self.trainer.step + (1 if what == "step" else 0)
        logger.warning("torchft: %s %d not committed (%d group(s) in the quorum, "
                       "min_replica_size %d; %d in a row)", what, step,
                       self.participants, ft.min_replica_size, self.commit_failures)
        self.trainer.metrics.emit("torchft_uncommitted", {
            "step": step, "what": what, "participants": self.participants,
            "in_a_row": self.commit_failures})
        if self.commit_failures >= ft.max_commit_failures:
            raise SpeedtronicError(
                f"torchft: {self.commit_failures} {what}s in a row did not commit: the quorum "
                f"holds {self.participants} replica group(s) and torchft.min_replica_size is "
                f"{ft.min_replica_size} (or a collective kept failing). Restart the missing "
                "groups, or lower torchft.min_replica_size to train on with fewer")

    # -- checkpoint ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The Manager's step count (and, under diloco, the last global and outer momentum)."""
        out: dict[str, Any] = {"manager": self.manager.state_dict()}
        if self._diloco is not None:  # torchft registers these with its Manager
            out["diloco"] = {k: fn() for k, fn in self.manager._user_state_dicts.items()
                             if k != "default"}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.manager.load_state_dict(state["manager"])
        for key, value in state.get("diloco", {}).items():
            self.manager._load_state_dict_fns[key](value)
        if self._diloco is not None:
            self._round_start = self.manager.current_step()

    def on_train_end(self, trainer: Any) -> None:
        self.close()

    def close(self) -> None:
        """Leave the job: stop the Manager's servers (idempotent)."""
        if self._diloco is not None:
            self._diloco.__exit__(None, None, None)
            self._diloco = None
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None  # type: ignore[assignment]
