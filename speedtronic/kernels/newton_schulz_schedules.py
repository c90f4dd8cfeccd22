"""Newton-Schulz coefficient schedules, their tuned Gram restarts, and the compute dtype.

What the polynomial ``p(x) = a x + b x^3 + c x^5`` is at each iteration (Keller Jordan's quintic
or the Polar Express table), how a config's name or list becomes the flat list the op takes,
which shipped schedule a list is (the Gram restarts were tuned per schedule, so an unknown list
runs standard NS), and which dtype the GEMMs run in. Pure functions of their arguments: the
iterations that use them are in :mod:`.newton_schulz`, whose docstring also argues why fp16 is
safe as the CUDA default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "COEFFICIENT_SCHEDULES",
    "GRAM_RESTARTS",
    "POLAR_EXPRESS_PUBLISHED",
    "QUINTIC",
    "gram_restarts",
    "polar_express_coefficients",
    "resolve_coefficients",
    "resolve_compute_dtype",
    "schedule_name",
]

QUINTIC: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic (a, b, c), the same every iteration (torch.optim.Muon's default)."""

# Published per-iteration (a, b, c) of Polar Express, degree 5 (Amsel, Persson, Musco, Gower,
# arXiv 2505.16932, Algorithm 1). Iterations past the 8th repeat the last entry, which is the
# limit polynomial (15x - 10x^3 + 3x^5)/8 rescaled. The paper divides every entry but the last by
# the safety factor 1.01 (a/1.01, b/1.01^3, c/1.01^5) and normalizes by 1.01*||X||_F.
POLAR_EXPRESS_PUBLISHED: tuple[tuple[float, float, float], ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
_PE_SAFETY = 1.01

COEFFICIENT_SCHEDULES = ("quintic", "polar_express")
"""Names accepted wherever Newton-Schulz coefficients are configured."""

GRAM_RESTARTS: dict[str, tuple[int, ...]] = {"quintic": (2,), "polar_express": (1, 2)}
"""Per schedule, the iterations (1-based) after which the Gram iteration re-forms ``X = Q X``
and ``R = X X^T``. Chosen by ``benchmarks/tune_gram_restarts.py``: the fewest restarts whose
error on Gaussian and power-law spectra (aspect 2 to 8, fp16 and fp32, inputs also scaled by
1.05 as a safety margin) stays within 1.25x standard Newton-Schulz in the same dtype
(``benchmarks/results/gram_restarts.md``). Coefficients that match no schedule, and bf16, use
standard NS."""


def polar_express_coefficients(steps: int) -> list[float]:
    """Flat ``3 * steps`` Polar Express schedule, equivalent to the paper's Algorithm 1.

    The safety factor is applied as published. The paper's extra ``1.01`` in the normalization
    (X / (1.01 ||X||_F)) is folded into the first polynomial: p(x / s) has coefficients
    (a/s, b/s^3, c/s^5), so our ops keep the plain Frobenius normalization.
    """
    if steps < 1:
        raise ValueError(f"polar_express needs steps >= 1, got {steps}")
    s = _PE_SAFETY
    table = [(a / s, b / s**3, c / s**5) for a, b, c in POLAR_EXPRESS_PUBLISHED[:-1]]
    table.append(POLAR_EXPRESS_PUBLISHED[-1])
    table = table[:steps] + [table[-1]] * max(0, steps - len(table))
    a, b, c = table[0]
    table[0] = (a / s, b / s**3, c / s**5)
    return [float(v) for abc in table for v in abc]


def resolve_coefficients(spec: str | Sequence[float], steps: int) -> list[float]:
    """Turn a schedule name or an explicit list into a flat list of 3 or ``3 * steps`` floats.

    ``"quintic"`` gives :data:`QUINTIC` (3 floats, reused every iteration); ``"polar_express"``
    gives :func:`polar_express_coefficients`; a list of 3 or ``3 * steps`` floats is returned as
    floats. Anything else raises ``ValueError`` naming the valid choices.
    """
    if isinstance(spec, str):
        if spec == "quintic":
            return list(QUINTIC)
        if spec == "polar_express":
            return polar_express_coefficients(steps)
        raise ValueError(f"unknown Newton-Schulz coefficient schedule {spec!r}; valid: "
                         f"{', '.join(COEFFICIENT_SCHEDULES)} or a list of 3 or 3*steps floats")
    flat = [float(v) for v in spec]
    if len(flat) not in (3, 3 * steps):
        raise ValueError(f"Newton-Schulz coefficients must hold 3 or 3*steps={3 * steps} floats, "
                         f"got {len(flat)}")
    return flat


def schedule_name(coefficients: Sequence[float], steps: int) -> str | None:
    """The shipped schedule these coefficients are (``"quintic"``, ``"polar_express"``), or None."""
    flat = [float(v) for v in coefficients]
    if flat == list(QUINTIC) or flat == list(QUINTIC) * steps:
        return "quintic"
    if len(flat) == 3 * steps and flat == polar_express_coefficients(steps):
        return "polar_express"
    return None


def gram_restarts(coefficients: Sequence[float], steps: int) -> tuple[int, ...] | None:
    """Restart points for these coefficients, or None when they were not tuned (use standard)."""
    name = schedule_name(coefficients, steps)
    return GRAM_RESTARTS.get(name) if name is not None else None


def resolve_compute_dtype(device: torch.device, dtype: torch.dtype,
                          requested: torch.dtype | None = None) -> torch.dtype:
    """Newton-Schulz matmul dtype: ``requested`` if given; else float64 stays float64, fp16 on CUDA
    (3-7x more accurate than bf16 for the same GEMM work, and overflow-free here: see
    :mod:`.newton_schulz`'s docstring), fp32 elsewhere: AVX2-only CPUs have no 16-bit GEMM path
    and run it tens of times slower than fp32 (each CPU benchmark records the machine's flags and
    GEMM rates, e.g. benchmarks/results/optimizer_cpu.md)."""
    if requested is not None:
        return requested
    if dtype == torch.float64:
        return torch.float64
    return torch.float16 if torch.device(device).type == "cuda" else torch.float32


def _iter_coefficients(coefficients: Sequence[float], steps: int) -> list[tuple[float, ...]]:
    flat = [float(v) for v in coefficients]
    if len(flat) == 3:
        return [tuple(flat)] * steps
    return [tuple(flat[3 * k:3 * k + 3]) for k in range(steps)]
