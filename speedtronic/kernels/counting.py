"""Count what a piece of PyTorch code dispatches: kernel-bearing ops, host syncs, and an
estimate of the CUDA launches the same ops would cost.

Why: the optimizer step is host-bound when it dispatches too many ops (~15 us each on an H200
host), and a host sync in ``step()`` stalls the CPU and breaks CUDA-graph capture. Neither is
visible without a GPU unless it is counted, so the tests and ``benchmarks/bench_step_dispatch.py``
count them with this :class:`DispatchCounter` (a ``TorchDispatchMode``, so it sees every aten op
and custom op exactly as the dispatcher does, on CPU or meta tensors).

The CUDA launch estimate per op:

* a ``_foreach_*`` op is ``multi_tensor_apply``: its tensors are cut into 65,536-element chunks
  and packed into launches of at most 320 chunks and 110 / 64 / 48 / 36 / 30 tensors for 1 to
  5 tensor lists (torch's ``depth_to_max_tensors``); :func:`foreach_launches` replays that;
* ``cat`` / ``stack`` batch 128 contiguous inputs per launch, else one copy per input;
* ``baddbmm`` / ``addmm`` with a non-zero ``beta`` first copy the input into the output
  (cuBLAS needs ``C == D``): 2 launches;
* a view or metadata op (``view``, ``transpose``, ``empty``, ...) launches nothing;
* our custom ops with a CUDA kernel: what their launcher in ``csrc/`` issues
  (:data:`CUSTOM_OP_LAUNCHES`);
* anything else: 1 launch.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CUSTOM_OP_LAUNCHES", "DispatchCounter", "HOST_SYNC_OPS", "NO_KERNEL_OPS",
           "foreach_launches"]

#: Ops that read a device value on the host (a sync on CUDA).
HOST_SYNC_OPS = frozenset({"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "item",
                           "allclose", "_assert_async"})

#: Ops that only make a new view or allocate: no kernel.
NO_KERNEL_OPS = frozenset({
    "view", "_unsafe_view", "as_strided", "t", "transpose", "permute", "unsqueeze", "squeeze",
    "expand", "slice", "select", "alias", "detach", "unbind", "split", "split_with_sizes",
    "chunk", "diagonal", "_reshape_alias", "reshape", "empty", "empty_like", "empty_strided",
    "new_empty", "new_empty_strided", "lift_fresh", "lift_fresh_copy", "resize_", "_to_copy_noop",
    "unflatten", "flatten", "view_as", "expand_as", "movedim", "narrow", "_conj", "_neg_view",
    "numpy_T", "mT", "set_", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
})


def _muon_plus_launches(args: tuple, kwargs: dict) -> int:
    # row stats, column partials, column finalize, apply (csrc/kernels/muon.cuh), after a
    # contiguous copy of a strided input (csrc/ops_impl.h)
    return 4 + (0 if args[0].is_contiguous() else 1)


def _cautious_mask_launches(args: tuple, kwargs: dict) -> int:
    # with rescale: zero the kept counts, count, apply; without: one pass (elementwise.cuh);
    # a strided update is copied in and written back, a strided grad copied (ops_impl.h)
    rescale = args[2] if len(args) > 2 else kwargs.get("rescale", True)
    updates, grads = args[0], args[1]
    return ((3 if rescale else 1) + sum(2 for u in updates if not u.is_contiguous())
            + sum(1 for g in grads if not g.is_contiguous()))


_LEAN_MATS = 128  # st::kLeanMats: matrices per launch table (csrc/kernels/args.h)


def _lean_tables(tensors: list, others: list) -> int:
    """Launch tables of a lean pass: per (dtype, dtype) pair, ceil(matrices / 128); empty
    matrices get no block."""
    pairs: Counter = Counter()
    for t, o in zip(tensors, others, strict=True):
        if t.numel():
            pairs[(t.dtype, o.dtype)] += 1
    return sum(math.ceil(k / _LEAN_MATS) for k in pairs.values())


def _lean_pre_launches(args: tuple, kwargs: dict) -> int:
    # momentum + sums of squares, then scale + cast: 2 per table (csrc/kernels/muon_lean.cuh)
    return 2 * _lean_tables(list(args[0]), list(args[2]))


def _lean_update_launches(args: tuple, kwargs: dict) -> int:
    return _lean_tables(list(args[0]), list(args[1]))


def _lean_cautious_count_launches(args: tuple, kwargs: dict) -> int:
    # zero the counts, then one count pass per table (csrc/ops_impl.h, muon_lean.cuh)
    return 1 + _lean_tables(list(args[0]), list(args[0]))


def _lean_plus_stats_launches(args: tuple, kwargs: dict) -> int:
    # row partials, rows, column partials, columns: 4 per table (csrc/kernels/muon_lean.cuh)
    return 4 * _lean_tables(list(args[0]), list(args[0]))


#: CUDA launches of our custom ops that have a CUDA kernel, read off their launchers (one
#: dtype pair of inputs assumed).
CUSTOM_OP_LAUNCHES = {"muon_plus_normalize": _muon_plus_launches,
                      "cautious_mask_": _cautious_mask_launches,
                      "muon_lean_pre_": _lean_pre_launches,
                      "muon_lean_update_": _lean_update_launches,
                      "muon_lean_plus_stats_": _lean_plus_stats_launches,
                      "muon_lean_cautious_count_": _lean_cautious_count_launches}

_CHUNK = 65536
_MAX_BLOCKS = 320
_MAX_TENSORS = {1: 110, 2: 64, 3: 48, 4: 36, 5: 30}


def foreach_launches(numels: list[int], depth: int) -> int:
    """CUDA launches of one ``multi_tensor_apply`` over tensors of ``numels`` elements with
    ``depth`` tensor lists (inputs plus outputs)."""
    max_tensors = _MAX_TENSORS.get(depth, 30)
    launches, blocks, tensors = 0, 0, 0
    for n in numels:
        if n == 0:
            continue
        tensors += 1
        for _ in range(math.ceil(n / _CHUNK)):
            blocks += 1
            if blocks == _MAX_BLOCKS:
                launches, blocks = launches + 1, 0
        if tensors == max_tensors:
            launches += 1 if blocks else 0
            blocks, tensors = 0, 0
    return launches + (1 if blocks else 0)


def _tensor_lists(args: tuple, kwargs: dict) -> list[list[torch.Tensor]]:
    return [a for a in (*args, *kwargs.values())
            if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]


def _estimate_launches(name: str, args: tuple, kwargs: dict, out: Any) -> int:
    if name.startswith("_foreach_"):
        lists = _tensor_lists(args, kwargs)
        depth = len(lists) + (0 if name.endswith("_") else 1)
        numels = [t.numel() for t in lists[0]] if lists else []
        extra = 1 if name.startswith("_foreach_norm") else 0  # the per-tensor cleanup pass
        return foreach_launches(numels, depth) + extra
    if name in ("cat", "stack"):
        inputs = args[0] if args else kwargs.get("tensors", [])
        if all(t.is_contiguous() for t in inputs):
            return max(1, math.ceil(len(inputs) / 128))
        return len(inputs)
    if name in ("baddbmm", "addmm", "addbmm"):
        beta = kwargs.get("beta", 1)
        return 1 if beta == 0 else 2
    return 1


class DispatchCounter(TorchDispatchMode):
    """``with DispatchCounter() as c: ...`` then read :attr:`ops` (kernel-bearing ops),
    :attr:`host_syncs`, :attr:`launches` (the CUDA estimate) and :attr:`by_name`."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.host_syncs = 0
        self.launches = 0
        self.by_name: Counter[str] = Counter()
        self.sync_names: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
        namespace = getattr(func, "namespace", "aten")
        name = packet if namespace == "aten" else f"{namespace}::{packet}"
        if packet in HOST_SYNC_OPS:
            self.host_syncs += 1
            self.sync_names[name] += 1
            return out
        if (namespace == "aten" and packet in NO_KERNEL_OPS) or namespace == "profiler":
            return out
        if namespace == "aten" and packet == "copy_" and args[0] is args[1]:
            return out
        self.ops += 1
        self.by_name[name] += 1
        if namespace == "speedtronic" and packet in CUSTOM_OP_LAUNCHES:
            self.launches += CUSTOM_OP_LAUNCHES[packet](args, kwargs)
        else:
            self.launches += _estimate_launches(packet, args, kwargs, out)
        return out

    def summary(self) -> dict[str, Any]:
        """Plain values for a results file."""
        return {"ops": self.ops, "host_syncs": self.host_syncs, "cuda_launches_est":
                self.launches, "by_name": dict(self.by_name.most_common())}
