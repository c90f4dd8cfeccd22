"""The ``optimizer``, ``scheduler`` and ``precision`` sections: how a step turns gradients into
new weights, at what learning rate, in which number format.

``OptimizerConfig`` is the largest section and the one built on its own too
(``build_optimizer`` validates it without a whole config), so its ``validate`` runs the shared
choice and finiteness checks itself. Field docstrings are the reference documentation of each
key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import brief
from .rules import check_choices, check_finite, require

__all__ = ["OptimizerConfig", "PrecisionConfig", "SchedulerConfig"]


@dataclass
class OptimizerConfig:
    """The optimizer. ``adamw`` trains every parameter with AdamW; ``muon`` routes hidden 2-D
    matrices to Muon and everything else (embeddings, head, norms, biases) to AdamW."""

    name: Literal["adamw", "muon"] = "adamw"
    """``adamw`` or ``muon`` (hybrid Muon + AdamW)."""
    lr: float = 3e-4
    """AdamW learning rate (peak, before the schedule)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas, each in [0, 1)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (matrices only; see ``decay_embeddings``/``decay_norms``)."""
    decay_embeddings: bool = False
    """Apply weight decay to embeddings and the (tied) output head too."""
    decay_norms_and_biases: bool = False
    """Apply weight decay to norm gains and biases too."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value; None disables clipping."""
    fused: bool | None = None
    """Use a fused AdamW implementation when available; None = automatic."""
    muon_lr: float = 0.02
    """Muon learning rate (Muon's updates are orthogonal, so its lr is not AdamW's)."""
    muon_weight_decay: float = 0.01
    """Muon decoupled weight decay."""
    muon_momentum: float = 0.95
    """Muon momentum in [0, 1)."""
    muon_nesterov: bool = True
    """Nesterov-style momentum for Muon."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations."""
    muon_coefficients: str | list[float] = "quintic"
    """Newton-Schulz polynomial: ``quintic`` (3.4445, -4.7750, 2.0315), ``polar_express``
    (a per-iteration schedule), or an explicit list of 3 (or 3 x ns_steps) floats."""
    muon_eps: float = 1e-7
    """Epsilon of the Frobenius pre-normalization before Newton-Schulz."""
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = "original"
    """Shape-dependent lr scale: ``original`` = sqrt(max(1, rows/cols)) (torch.optim.Muon's
    default), ``match_rms_adamw`` = 0.2 * sqrt(max(rows, cols))."""
    muon_ns_dtype: Literal["auto", "fp16", "bf16", "fp32", "fp64"] = "auto"
    """Newton-Schulz matmul dtype: auto = fp16 on CUDA (3-7x more accurate than bf16,
    benchmarks/results/gram_restarts.md; overflow-free after normalization), fp32 on CPU (~6000x
    closer to a float64 evaluation than bf16, benchmarks/results/optimizer_cpu.md). On CPUs with
    native bf16 GEMM (AVX512-BF16, AMX) ``bf16`` is faster. ``fp64`` works everywhere (PyTorch path
    on CUDA)."""
    muon_conv: bool = False
    """Also train convolution kernels larger than 1x1 with Muon, each flattened to
    ``(out, in * kh * kw)`` (pointwise 1x1 convolutions always go to Muon: they are a Linear over
    channels; grouped and depthwise ones always stay on AdamW). Requires ``name: muon``."""
    muon_plus: bool = False
    """Muon+: normalize rows then columns after orthogonalization (requires name: muon)."""
    muon_norm_eps: float = 1e-8
    """Epsilon inside the square root of the Muon+ normalization."""
    cuda_graph: Literal["off", "on", "auto"] = "off"
    """The Muon step as one captured CUDA graph, replayed each step (CUDA only; off on CPU and
    under ``compile`` with one log line). ``auto`` times 3 eager steps against 3 replays
    after the warm-up and keeps the faster. Off by default until a GPU run has measured it
    (benchmarks/gpu_check.sh); docs/optimizers.md lists what invalidates a capture."""
    cautious: bool = False
    """Cautious masking: drop update entries whose sign disagrees with the gradient (AdamW: the
    Adam direction; Muon: the orthogonalized update). Applies to both branches."""
    cautious_rescale: bool = True
    """Rescale kept entries by numel / (kept + 1) as in the Cautious Optimizers paper."""

    def validate(self, p: str = "optimizer") -> None:
        """Check choices, ranges and the options only Muon takes; raise ConfigError naming the key.
        ``build_optimizer`` runs it too, for a section built in Python."""
        check_choices(self, p)  # build_optimizer validates this section on its own
        check_finite(self, p)
        for key in ("lr", "eps", "muon_lr", "muon_eps", "muon_norm_eps"):
            value = getattr(self, key)
            require(value > 0, f"{p}.{key}", f"must be > 0, got {value}")
        for key in ("weight_decay", "muon_weight_decay"):
            value = getattr(self, key)
            require(value >= 0, f"{p}.{key}", f"must be >= 0, got {value}")
        require(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas), f"{p}.betas",
               f"must be two values in [0, 1), got {list(self.betas)}")
        if self.grad_clip is not None:
            require(self.grad_clip > 0, f"{p}.grad_clip",
                   f"must be > 0 or null, got {self.grad_clip}")
        require(0.0 <= self.muon_momentum < 1.0, f"{p}.muon_momentum",
               f"must be in [0, 1), got {self.muon_momentum}")
        require(0 < self.muon_ns_steps < 100, f"{p}.muon_ns_steps",
               f"must be in [1, 100), got {str(self.muon_ns_steps)[:40]}")
        coeffs = self.muon_coefficients
        if isinstance(coeffs, str):
            require(coeffs in ("quintic", "polar_express"), f"{p}.muon_coefficients",
                   f"must be 'quintic', 'polar_express' or a list of floats, got {brief(coeffs)}")
        else:
            require(len(coeffs) in (3, 3 * self.muon_ns_steps), f"{p}.muon_coefficients",
                   f"a list must hold 3 or 3 x muon_ns_steps={3 * self.muon_ns_steps} floats, "
                   f"got {len(coeffs)}")
        require(not (self.fused and self.cautious), f"{p}.fused",
                "true cannot be combined with optimizer.cautious: true (torch's fused AdamW has "
                "no cautious mask); set fused: null or false")
        require(not self.muon_plus or self.name == "muon", f"{p}.muon_plus",
               f"requires optimizer.name: muon (got name: {self.name}); Muon+ normalizes "
               "orthogonalized updates, which AdamW does not produce")
        require(self.cuda_graph == "off" or self.name == "muon", f"{p}.cuda_graph",
               f"requires optimizer.name: muon (got name: {self.name}); it captures the Muon "
               "step (AdamW's fused step is already a few launches)")
        require(not self.muon_conv or self.name == "muon", f"{p}.muon_conv",
               f"requires optimizer.name: muon (got name: {self.name}); it routes convolution "
               "kernels to Muon")


@dataclass
class SchedulerConfig:
    """Learning-rate schedule, applied to every parameter group (keeps the Muon/AdamW ratio)."""

    name: Literal["cosine", "constant"] = "cosine"
    """``cosine`` (linear warmup, cosine decay to min_lr_ratio) or ``constant`` (warmup, flat)."""
    warmup_steps: int = 100
    """Linear warmup length in optimizer steps."""
    max_steps: int | None = None
    """Horizon of the cosine decay; None = ``run.max_steps``."""
    min_lr_ratio: float = 0.1
    """The cosine's floor as a fraction of the peak (cosine only), in [0, 1]: reached at step
    ``scheduler.max_steps``, one step after the last one a run of that length trains (which
    runs above it by sin^2(pi / (2 (max_steps - warmup))) of the range: 2.5e-6 with 1000 decay
    steps, 0.15 with 4)."""

    def validate(self, p: str = "scheduler") -> None:
        """Check the step counts and ``min_lr_ratio``; raise ConfigError naming the key."""
        require(self.warmup_steps >= 0, f"{p}.warmup_steps",
               f"must be >= 0, got {self.warmup_steps}")
        if self.max_steps is not None:
            require(self.max_steps > 0, f"{p}.max_steps", f"must be > 0, got {self.max_steps}")
        require(0.0 <= self.min_lr_ratio <= 1.0, f"{p}.min_lr_ratio",
               f"must be in [0, 1], got {self.min_lr_ratio}")


@dataclass
class PrecisionConfig:
    """Numeric precision of forward/backward (parameters and optimizer state stay fp32)."""

    mode: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """``auto``: bf16 on CUDA that supports it, fp16 + GradScaler on other CUDA, fp32 on CPU.
    An explicit mode the device cannot run falls back with a warning."""

    def validate(self, p: str = "precision") -> None:
        """No rule beyond ``mode``'s choices, which ``finalize`` checks (ConfigError naming it)."""
        pass
