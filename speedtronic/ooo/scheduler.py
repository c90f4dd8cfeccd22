"""Out-of-order backprop: weight gradients of ``nn.Linear`` layers leave the critical path.

In a layer's backward, the input gradient ``dX = dY @ W`` is needed at once by the layer below,
while ``dW = dY^T @ X`` is needed only by the optimizer. Following Oh et al. (EuroSys 2022,
"Out-of-order backprop"), each deferrable ``nn.Linear`` runs through :class:`_DeferredLinear`,
whose backward returns ``dX`` immediately on the current stream and hands the ``dW``/``db`` work to
an executor:

* CUDA: the work is launched at once on a side stream (round-robin over ``ooo_streams``, one fixed
  stream per parameter so contributions to one ``.grad`` never race), after the side stream waits
  for the current one.
* CPU (only when forced, for tests and benchmarks): the same work is queued and run in order at
  the end of the backward pass. No streams, same arithmetic, so gradients are bitwise comparable.

At the end of every backward pass (an autograd-engine final callback, which runs on the caller's
stream) the current stream waits for the side streams and the deferred sums are folded into
``.grad``. The fold reproduces autograd's order - ``prev + (sum of this pass)`` - so fp32 gradients
equal the standard backward bit for bit, with gradient accumulation and with tied weights. When
autograd itself also adds into a deferred weight's ``.grad`` in the same pass (the second pass of
a double backward over a tied weight, or the weight also used outside its ``nn.Linear``), the
fold adds the same terms in another order: equal up to fp32 rounding (2.4e-7 on a 16x16 tied
pair), not bitwise.
:meth:`OOOScheduler.flush` (the trainer calls it before clipping/stepping) is then a cheap guard:
it discards the work of a backward that raised and makes the current stream wait for all streams.

Not deferred: ``torch.autograd.grad`` and ``backward(create_graph=True)`` (dW is returned as a
normal gradient there, with its graph, so a double backward matches the standard one), forwards
inside ``torch.func`` transforms, subclasses of ``nn.Linear`` with their own forward,
parametrized weights, fp64. Hooks registered with ``register_post_accumulate_grad_hook`` do not
see deferred gradients.

This module installs the layers and runs the passes (launch, fold, flush, discard). The
per-layer Function, the slots and batches and the gradient arithmetic are in
:mod:`speedtronic.ooo.deferred_linear`; which layers qualify and when the feature stays off, in
:mod:`speedtronic.ooo.eligibility`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..config import SpeedtronicConfig
from .deferred_linear import (
    _accumulate,
    _Batch,
    _Layer,
    _Slot,
    _weight_grads,
    _weight_grads_into,
)
from .eligibility import _fallback_reason, find_deferrable_linears

__all__ = ["OOOScheduler", "build_ooo_scheduler", "find_deferrable_linears"]

logger = logging.getLogger("speedtronic.ooo")


class OOOScheduler:
    """Defers Linear weight gradients; install once, call :meth:`flush` before reading grads.

    Build it with :func:`build_ooo_scheduler` (config path, CUDA only) or directly
    (``OOOScheduler(model, "cpu")`` runs the stream-less queue, for tests and benchmarks).
    """

    def __init__(self, model: nn.Module, device: torch.device | str, num_streams: int = 4,
                 layers: list[tuple[str, nn.Linear]] | None = None) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.mode = "cuda-streams" if self.device.type == "cuda" else "cpu-queue"
        self._active = False
        # Keyed by autograd graph-task id: a global counter, never reused (unlike id(tensor)).
        self._batches: dict[int, _Batch] = {}
        self._warned: set[str] = set()
        self._layers: list[_Layer] = []
        self.deferred_total = 0  # weight/bias gradients folded into .grad so far
        self.streams: list[Any] = []
        if self.mode == "cuda-streams":
            self.streams = [torch.cuda.Stream(device=self.device)
                            for _ in range(max(1, min(8, num_streams)))]
        layers = find_deferrable_linears(model) if layers is None else layers
        try:
            self._install(model, layers)
        except BaseException:
            self._uninstall()
            raise
        self._active = True

    # ----------------------------------------------------------------------------- setup
    def _install(self, model: nn.Module, layers: list[tuple[str, nn.Linear]]) -> None:
        slots: dict[nn.Parameter, _Slot] = {}  # keyed by the live parameter (not its id())

        def slot_for(p: nn.Parameter, name: str, index: int) -> _Slot:
            if p not in slots:
                stream = self.streams[index % len(self.streams)] if self.streams else None
                slots[p] = _Slot(p, name, stream)
            return slots[p]

        for i, (name, m) in enumerate(layers):
            if "forward" in m.__dict__:
                raise RuntimeError(f"{name}.forward is already overridden on the instance")
            weight = slot_for(m.weight, f"{name}.weight", i)
            bias = slot_for(m.bias, f"{name}.bias", i) if m.bias is not None else None
            layer = _Layer(self, name, m, weight, bias)
            m.forward = layer  # instance attribute shadows nn.Linear.forward; removed in close()
            self._layers.append(layer)
        self.num_params = len(slots)

    def _uninstall(self) -> None:
        for layer in self._layers:
            if layer.module.__dict__.get("forward") is layer:
                del layer.module.forward
        self._layers = []

    # ----------------------------------------------------------------------------- runtime
    def _on_forward(self) -> None:
        # A forward outside any backward while work is pending means the last backward raised
        # (final callbacks only run on success): drop that work so it cannot land later.
        if self._batches and torch._C._current_graph_task_id() == -1:
            self._discard_all("a backward pass did not finish")

    @staticmethod
    def _needed(ctx: Any) -> tuple[bool, bool] | None:
        """Whether this backward accumulates into (weight, bias); None under autograd.grad."""
        flags = []
        nodes = [edge[0] for edge in ctx.next_functions]  # tensor inputs only: (x, W[, b])
        for node in (nodes[1], nodes[2] if len(nodes) > 2 else None):
            try:
                # False for a leaf left out of backward(inputs=...).
                flags.append(node is not None and torch._C._will_engine_execute_node(node))
            except RuntimeError:
                return None  # raised for leaves under torch.autograd.grad: return dW there
        return flags[0], flags[1]

    def _defer(self, layer: _Layer, x2d: torch.Tensor, g2d: torch.Tensor, need_w: bool,
               need_b: bool) -> None:
        task_id = torch._C._current_graph_task_id()
        batch = self._batches.get(task_id)
        if batch is None:
            batch = self._batches[task_id] = _Batch(task_id)
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self._finish(task_id))
        if need_w:
            batch.touch(layer.weight)
        if need_b:
            batch.touch(layer.bias)
        if self.mode == "cpu-queue":
            batch.queue.append((layer, x2d, g2d, need_w, need_b))
            return
        ambient = torch.cuda.current_stream(self.device)
        side = layer.weight.stream
        # The result buffers come from the ambient stream's pool BEFORE the side stream waits
        # for it: their previous users are then ordered before the side stream's writes, and
        # the ambient stream only reads and frees them after the fold has waited for the side
        # stream. So they need no record_stream, and the work needs no event: the fold waits
        # for every side stream this pass used. Stream API calls per layer: 11.2 -> 4.3
        # (benchmarks/results/ooo_host_cpu.md as committed at c55d75d; the current file
        # measures the host time per layer that remains, most of it the autograd.Function
        # round trip itself).
        dw = torch.empty_like(layer.weight.param) if need_w else None
        db = torch.empty_like(layer.bias.param) if need_b and layer.bias is not None else None
        side.wait_stream(ambient)  # dY (and X) were produced on the ambient stream
        # Autograd frees X and dY as soon as this backward returns; keep the allocator from
        # handing their blocks to ambient-stream work before the side stream has read them.
        x2d.record_stream(side)
        g2d.record_stream(side)
        with torch.cuda.stream(side):
            _weight_grads_into(x2d, g2d, dw, db)
            if dw is not None:
                _accumulate(batch, layer.weight, dw)
            if db is not None:
                _accumulate(batch, layer.bias, db)
        batch.streams.add(side)

    def _finish(self, task_id: int) -> None:
        batch = self._batches.pop(task_id, None)
        if batch is None:
            return
        with torch.no_grad():
            if self.mode == "cpu-queue":
                for layer, x2d, g2d, need_w, need_b in batch.queue:
                    dw, db = _weight_grads(layer, x2d, g2d, need_w, need_b)
                    if dw is not None:
                        _accumulate(batch, layer.weight, dw)
                    if db is not None:
                        _accumulate(batch, layer.bias, db)
                batch.queue.clear()
            else:
                current = torch.cuda.current_stream(self.device)
                for stream in batch.streams:
                    current.wait_stream(stream)
                batch.keep.clear()  # safe to free now: the ambient stream waits for the reads
            for slot, prev in batch.stash.items():
                total = batch.local.get(slot)
                if total is None:
                    slot.param.grad = prev
                    continue
                during = slot.param.grad  # written by autograd meanwhile (tied / functional use)
                if during is not None:
                    total = during + total
                if prev is None:
                    slot.param.grad = total
                else:
                    slot.param.grad = prev.add_(total)
                self.deferred_total += 1

    def _discard_all(self, why: str) -> None:
        if not self._batches:
            return
        n = sum(len(b.stash) for b in self._batches.values())
        self._warn_once(f"discarded deferred gradients of {n} parameters ({why}); their .grad "
                        "is restored to its value before that backward")
        if self.streams:
            current = torch.cuda.current_stream(self.device)
            for stream in self.streams:  # pending side writes must land before buffers recycle
                current.wait_stream(stream)
        for batch in self._batches.values():
            for slot, prev in batch.stash.items():
                slot.param.grad = prev
        self._batches.clear()

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            logger.warning("ooo backprop: %s", message)

    # ----------------------------------------------------------------------------- public
    @property
    def num_layers(self) -> int:
        """Number of ``nn.Linear`` layers whose weight gradients are deferred."""
        return len(self._layers)

    def flush(self) -> None:
        """Make gradients safe to read on the current stream (call after ``backward()``).

        Normal passes were already folded by the end-of-backward callback; this waits for every
        side stream and discards (with a warning) the work of a backward that raised.
        """
        if torch._C._current_graph_task_id() != -1:
            raise RuntimeError("OOOScheduler.flush() must be called after backward() returns, "
                               "not from inside the backward pass")
        self._discard_all("the backward pass that queued them raised")
        if self.streams:
            current = torch.cuda.current_stream(self.device)
            for stream in self.streams:
                current.wait_stream(stream)

    def discard(self) -> None:
        """Drop deferred work of an unfinished backward (call from an ``except`` block)."""
        self._discard_all("discard() was called")

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Run forwards inside the block with the standard backward (e.g. to time it)."""
        was, self._active = self._active, False
        try:
            yield
        finally:
            self._active = was

    def close(self) -> None:
        """Flush, then restore every layer's original forward. Idempotent."""
        if self._layers:
            self.flush()
        self._active = False
        self._uninstall()

    def as_dict(self) -> dict[str, Any]:
        """Summary for the ``train_start`` payload."""
        return {"enabled": bool(self._layers), "mode": self.mode, "streams": len(self.streams),
                "layers": self.num_layers}

    def __enter__(self) -> OOOScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.discard()
        self.close()


def build_ooo_scheduler(model: nn.Module, cfg: SpeedtronicConfig, device: torch.device | str,
                        *, force_cpu: bool = False) -> OOOScheduler | None:
    """Install out-of-order backprop if ``cfg.ooo_backprop`` and it can run; else None.

    Logs one line with the decision. ``force_cpu=True`` allows the stream-less CPU queue on a
    CPU device (tests and benchmarks); the config path alone never uses it.
    """
    reason = _fallback_reason(cfg, torch.device(device), force_cpu)
    if reason is not None:
        logger.info("ooo backprop: off (%s)", reason)
        return None
    try:
        layers = find_deferrable_linears(model)
        if len(layers) < 2:
            logger.info("ooo backprop: off (fewer than two deferrable nn.Linear layers: %d)",
                        len(layers))
            return None
        sched = OOOScheduler(model, device, cfg.ooo_streams, layers)
    except Exception as exc:  # never fail a run for an optional speed feature
        logger.info("ooo backprop: off (setup error: %s: %s)", type(exc).__name__, exc)
        return None
    where = (f"{len(sched.streams)} CUDA side streams" if sched.streams
             else "the CPU queue (forced)")
    logger.info("ooo backprop: on (%d nn.Linear layers, weight gradients on %s)",
                sched.num_layers, where)
    return sched
