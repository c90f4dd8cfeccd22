"""The one rule for turning a model's output into the scalar loss the trainer backpropagates.

Used by the trainer (train and eval steps) and exported as :func:`speedtronic.models.extract_loss`
for users who drive a model themselves. Accepted outputs, in the order they are tried:

* a tensor with one element (``()`` or ``(1,)``), returned as a 0-d tensor;
* a mapping with a ``"loss"`` entry (a dict, or a Hugging Face ``ModelOutput``);
* a non-empty tuple or list whose first element is the loss;
* any other object with a ``.loss`` attribute (dataclass-style outputs).

Anything else is a :class:`~speedtronic.errors.SpeedtronicError` naming what was returned.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import SpeedtronicError

__all__ = ["extract_loss"]


def extract_loss(output: Any) -> torch.Tensor:
    """The scalar loss in ``output`` as a 0-d tensor (see the module docstring for the forms)."""
    loss = output
    if isinstance(output, Mapping):
        if "loss" not in output:
            raise SpeedtronicError(f"model returned a mapping without 'loss' (keys: "
                                   f"{sorted(map(str, output))}); was it called without labels?")
        loss = output["loss"]
    elif isinstance(output, (tuple, list)):
        if not output:
            raise SpeedtronicError("model returned an empty tuple; expected (loss, ...)")
        loss = output[0]
    elif not isinstance(output, torch.Tensor) and hasattr(output, "loss"):
        loss = output.loss
    if not isinstance(loss, torch.Tensor):
        raise SpeedtronicError(f"model must return a loss tensor, {{'loss': tensor}} or "
                               f"(loss, ...); got {type(loss).__name__}")
    if loss.numel() != 1:
        raise SpeedtronicError(f"model returned a loss of shape {tuple(loss.shape)}; expected a "
                               "scalar (reduce it, e.g. with .mean(); labels are already shifted "
                               "by the data: y[t] = x[t+1])")
    return loss.reshape(())
