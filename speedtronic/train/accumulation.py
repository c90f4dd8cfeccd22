"""Token-weighted gradient accumulation: an accumulated step is a mean over its tokens.

With ``k`` micro-batches per optimizer step, plain averaging backpropagates ``loss / k`` for each
micro-batch's *mean* loss. That is a mean over tokens only when every micro-batch counts the same
number of label tokens; padding (labels of ``IGNORE_INDEX``) breaks it: a padded 4 x 4 step once
moved the weights 4.5e-3 away from the same 16 tokens taken as one batch.

The trainer instead backpropagates each micro-batch's mean loss with ``rel = n / ref`` (``n``:
its counted tokens; ``ref``: the step's first counted micro-batch's count) and multiplies the
step's gradients by ``k * ref / n_total`` once all are in. Equal counts (padded or not) give
``rel = 1.0`` and a factor of 1: exactly plain averaging, with no extra pass over the gradients.
``rel`` exceeds 1 when a later micro-batch counts more tokens; under fp16 an overflow is the
GradScaler's usual skipped step. A micro-batch of nothing but padding is skipped (its mean loss
is NaN and it carries no gradient).
"""

from __future__ import annotations

import numpy as np
import torch

IGNORE_INDEX = -100
"""Label value that counts for no token (the reference model's and Hugging Face's)."""


def counted_tokens(labels: torch.Tensor) -> int | None:
    """Label tokens of a micro-batch that count (not ``IGNORE_INDEX``), read on the host.

    None (no token weighting) for labels that are not integer ids in host memory: labels that a
    user's data yields on the device would need a sync to count, and float labels are not ids."""
    if labels.device.type != "cpu" or labels.is_floating_point() or labels.is_complex() \
            or labels.dtype == torch.bool:
        return None
    return int(np.count_nonzero(labels.numpy() != IGNORE_INDEX))


class StepWeights:
    """The token weights of one optimizer step's micro-batches (see the module docstring).

    Call :meth:`weight` for every micro-batch that counts tokens (``n != 0``), in order, then
    :meth:`gradient_factor` once."""

    def __init__(self, accumulation_steps: int) -> None:
        self.accumulation_steps = accumulation_steps
        self.reference: int | None = None  # the first counted micro-batch's token count
        self.total = 0  # counted tokens so far (an uncounted micro-batch weighs as the first)

    def weight(self, n: int | None) -> float:
        """``rel`` for a micro-batch of ``n`` counted tokens (None: not countable)."""
        if n is not None and self.reference is None:
            self.reference = n
        if self.reference is not None:
            self.total += self.reference if n is None else n
        return 1.0 if n is None or n == self.reference else n / self.reference

    def gradient_factor(self) -> float:
        """What the step's summed gradients are multiplied by (1.0: leave them alone)."""
        if not self.reference or not self.total:
            return 1.0
        return self.accumulation_steps * self.reference / self.total
