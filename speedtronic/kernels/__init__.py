"""The kernel layer: everything that runs the optimizer's hot path, and the choice of which.

* :mod:`.extension` finds and loads the compiled CUDA extension (``speedtronic._C``) and says
  why not, in one line, when it falls back.
* :mod:`.ops` is the op registry: each op's schema, fake (meta) kernel and pure-PyTorch
  fallback side by side, registered with ``torch.library``, one module per op family
  (:mod:`.ops_orthogonalize`, :mod:`.ops_cautious_adamw`, :mod:`.ops_muon`,
  :mod:`.ops_muon_lean`); :mod:`.ops` imports them all and is where callers take the ops from.
* :mod:`.cpu` loads the torch-free fused fp32 CPU kernels (``speedtronic._cpu_kernels``).
* :mod:`.newton_schulz` is the Newton-Schulz math (the standard and the Gram iteration),
  :mod:`.newton_schulz_schedules` its coefficient schedules and compute dtype,
  :mod:`.newton_schulz_gemm` the GEMM behind each of its products;
  :mod:`.choice` and :mod:`.autotune` pick, per shape, the kernel that measured fastest.

May import: :mod:`speedtronic.errors` and the package root (``__version__``). Nothing above it
(optim, models, train, ...) is imported here; importing this package itself loads nothing.
"""

from .._renamed import moved_into_package

# ``speedtronic.kernels`` was the extension loader's module before 2.1.
__getattr__ = moved_into_package(__name__)
