"""Out-of-order backprop: the opt-in CUDA-stream scheduler and the trial that keeps it only
where it measures faster.

* :mod:`.scheduler` defers ``nn.Linear`` weight gradients onto side streams
  (:class:`~speedtronic.ooo.scheduler.OOOScheduler`, ``build_ooo_scheduler``).
* :mod:`.deferred_linear` is what runs inside each taken-over layer: the forward wrapper and
  the autograd Function whose backward hands dW/db to the scheduler.
* :mod:`.eligibility` picks the layers and says why the feature stays off.
* :mod:`.trial` alternates it on and off over the first steps and keeps the faster.

May import: :mod:`speedtronic.config` and :mod:`speedtronic.errors` only. The trainer
(:mod:`speedtronic.train`) drives it.
"""

from .._renamed import moved_into_package

# ``speedtronic.ooo`` was the scheduler's module before 2.1.
__getattr__ = moved_into_package(__name__)
