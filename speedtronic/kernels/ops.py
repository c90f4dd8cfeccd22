"""The Speedtronic op registry: every custom op in the ``speedtronic`` namespace.

Each op is defined once with :func:`torch.library.custom_op` and a fixed schema (the CUDA
kernels in ``csrc/`` implement exactly these schemas), in the module of its family below, where
its schema, fake kernel and PyTorch body sit side by side. This module is the registry's front:
importing it imports every family (which defines the ops), then loads the CUDA kernels onto
them; callers use the ops from here. What is registered:

* the pure-PyTorch implementation as the ``CompositeExplicitAutograd`` kernel, i.e. the default
  for every device. A ``TORCH_LIBRARY_IMPL(speedtronic, CUDA, m)`` kernel overrides it on CUDA,
  and the Python API above the ops does not change;
* a fake (meta) implementation so ``torch.compile`` traces the ops without graph breaks;
* mutated arguments marked in the schema (``Tensor(a!)[]``), so functionalization is correct.

Ops (see each function's docstring for the exact math):

:mod:`.ops_orthogonalize`, one matrix or a batch:

``newton_schulz``            odd quintic polar-factor iteration, ``(m, n)`` or ``(b, m, n)``
``muon_plus_normalize``      Muon+ row-then-column L2 normalization (arXiv 2602.21545)

:mod:`.ops_cautious_adamw`, list-wide updates:

``cautious_mask_``           cautious masking of a list of updates (arXiv 2411.16085)
``cautious_adamw_step_``     AdamW (optionally cautious) over lists of tensors

:mod:`.ops_muon`, the classic Muon step, one shape group per call:

``muon_pre_orthogonalize_``  momentum EMA + Nesterov + stack + Frobenius normalization
``muon_post_update_``        Muon+ / cautious post-pass + decoupled weight decay + param update

:mod:`.ops_muon_lean`, the lean Muon step, every matrix of the step per call:

``muon_lean_pre_``           the lean step's pre-pass: every matrix of the step, tensor ``mu``
``muon_lean_update_``        the lean step's weight decay + update, tensor ``lr``/``wd``, guard
                             skip, Muon+ row/column scales
``muon_lean_plus_stats_``    Muon+ inverse row and column norms of every matrix of a step
``muon_lean_cautious_count_`` the cautious mask's kept entries of every matrix of a step

Coefficient schedules for ``newton_schulz`` are named in :data:`COEFFICIENT_SCHEDULES` and
resolved with :func:`resolve_coefficients`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from . import extension as _kernels
from . import newton_schulz as _ns
from .newton_schulz import (
    COEFFICIENT_SCHEDULES,
    POLAR_EXPRESS_PUBLISHED,
    QUINTIC,
    polar_express_coefficients,
    resolve_coefficients,
    resolve_compute_dtype,
)

# The op families. Importing them is what defines the ops; the ops (and adamw_traceable) are
# re-exported, this module being their public home, and the private bodies fill the tables below.
from .ops_cautious_adamw import (  # noqa: F401  (re-exported)
    _adamw_impl,
    _cautious_mask_impl,
    adamw_traceable,
    cautious_adamw_step_,
    cautious_mask_,
)
from .ops_muon import (  # noqa: F401  (re-exported)
    _muon_post_impl,
    _muon_pre_impl,
    muon_post_update_,
    muon_pre_orthogonalize_,
)
from .ops_muon_lean import (  # noqa: F401  (re-exported)
    _lean_cautious_count_impl,
    _lean_plus_stats_impl,
    _lean_pre_impl,
    _lean_update_impl,
    muon_lean_cautious_count_,
    muon_lean_plus_stats_,
    muon_lean_pre_,
    muon_lean_update_,
)
from .ops_orthogonalize import (  # noqa: F401  (re-exported)
    _muon_plus_impl,
    _newton_schulz_impl,
    muon_plus_normalize,
    newton_schulz,
)

#: Every custom op, defined in the family modules imported above.
OP_NAMES: tuple[str, ...] = (
    "newton_schulz",
    "muon_plus_normalize",
    "cautious_mask_",
    "muon_pre_orthogonalize_",
    "muon_post_update_",
    "cautious_adamw_step_",
    "muon_lean_pre_",
    "muon_lean_update_",
    "muon_lean_plus_stats_",
    "muon_lean_cautious_count_",
)

#: The ops with a hand-written CUDA kernel in ``speedtronic._C`` (the extension must register
#: each). ``newton_schulz`` is not one: its CUDA path is cuBLAS GEMMs driven by the same Python
#: body as on the CPU.
CUDA_KERNEL_OPS: tuple[str, ...] = tuple(n for n in OP_NAMES if n != "newton_schulz")

#: Dtypes the CUDA kernels take; other dtypes (float64) run the op's PyTorch implementation.
CUDA_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

__all__ = [
    "OP_NAMES",
    "CUDA_KERNEL_OPS",
    "CUDA_KERNEL_DTYPES",
    "COEFFICIENT_SCHEDULES",
    "GRAM_MIN_ASPECT",
    "kernel_or_fallback",
    "QUINTIC",
    "POLAR_EXPRESS_PUBLISHED",
    "polar_express_coefficients",
    "resolve_coefficients",
    "resolve_compute_dtype",
    *OP_NAMES,
]

logger = logging.getLogger("speedtronic.ops")
_fallback_logged: set[tuple[str, tuple[str, ...]]] = set()


def kernel_or_fallback(name: str, device: torch.device, dtypes: Sequence[torch.dtype]) -> Callable:
    """The op ``name``, or its PyTorch implementation when a CUDA kernel would be asked for a
    dtype it lacks (float64 params or ``ns_dtype="fp64"``): every documented option works on
    every device, at the fallback's speed, with one log line per op and dtype combination.

    On meta tensors an op with a CUDA kernel is returned as the op (a step counted on meta
    dispatches what the GPU would). Off CUDA and outside ``torch.compile`` it returns the
    Python body itself: the op would run the same body after the dispatcher, whose first
    custom-op call imports ``torch._dynamo`` (0.75 s of a short CPU run)."""
    op = _OPS_BY_NAME[name]
    kind = torch.device(device).type
    if kind == "meta" and name in CUDA_KERNEL_OPS:
        # Meta tensors stand in for the GPU when a step is counted (kernels/counting.py): the
        # op itself, as one dispatch (its fake kernel), is what CUDA would launch
        return op
    if kind != "cuda":
        return op if torch.compiler.is_compiling() else _PYTHON_BODIES[name]
    if name in _PYTORCH_IMPLS and not _kernels.available():
        # no extension, or one the loader turned down (a device arch it lacks, a kernel
        # missing): an imported binary's CUDA kernels are still registered with the dispatcher
        return _PYTORCH_IMPLS[name]
    if all(d in CUDA_KERNEL_DTYPES for d in dtypes):
        return op
    tag = (name, tuple(str(d).removeprefix("torch.") for d in dtypes))
    if tag not in _fallback_logged:
        _fallback_logged.add(tag)
        logger.info("%s: PyTorch implementation for %s (the CUDA kernel takes float32, "
                    "float16 and bfloat16)", name, "/".join(tag[1]))
    return _PYTORCH_IMPLS[name]


# The Newton-Schulz math and its schedules live in kernels.newton_schulz; re-exported here
# because they are part of the op's contract (its ``coefficients`` argument).
GRAM_MIN_ASPECT = _ns.GRAM_MIN_ASPECT


# CUDA implementations of the ops imported above (speedtronic._C), registered when available;
# otherwise one "cuda kernels: fallback: <reason>" line is logged and the defaults above run
# everywhere. Loaded only now, after every family module has defined its schemas, so the CUDA
# impls attach to defined ops.
_kernels.load(op_names=CUDA_KERNEL_OPS)

# A plain dict, not globals(): torch.compile cannot trace globals() (a graph break per call).
_OPS_BY_NAME: dict[str, Callable] = {name: globals()[name] for name in OP_NAMES}

#: The pure-PyTorch body of each op with a CUDA kernel (what :func:`kernel_or_fallback` returns).
_PYTORCH_IMPLS: dict[str, Callable] = {
    "muon_plus_normalize": _muon_plus_impl,
    "cautious_mask_": _cautious_mask_impl,
    "muon_pre_orthogonalize_": _muon_pre_impl,
    "muon_post_update_": _muon_post_impl,
    "cautious_adamw_step_": _adamw_impl,
    "muon_lean_pre_": _lean_pre_impl,
    "muon_lean_update_": _lean_update_impl,
    "muon_lean_plus_stats_": _lean_plus_stats_impl,
    "muon_lean_cautious_count_": _lean_cautious_count_impl,
}

# Every op's Python body, called directly off CUDA (see kernel_or_fallback); under no_grad, as
# the dispatcher runs a custom op's body (so it may update leaf parameters in place).
_PYTHON_BODIES: dict[str, Callable] = {
    name: torch.no_grad()(fn)
    for name, fn in {**_PYTORCH_IMPLS, "newton_schulz": _newton_schulz_impl}.items()}
