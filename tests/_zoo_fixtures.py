"""The check every model-zoo row passes (tests/optim/test_model_zoo*.py): routing complete with
the expected layouts, a few hybrid-Muon steps reduce the loss, and the optimizer state
round-trips through ``state_dict`` (a fresh optimizer loaded from bytes steps exactly like the
original)."""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from speedtronic.config import OptimizerConfig
from speedtronic.optim import build_optimizer, route_parameters


def check_zoo_model(build: Callable[[], nn.Module], loss: Callable[[nn.Module, int], torch.Tensor],
                    layouts: dict[str, int], steps: int = 8, **optimizer: object) -> None:
    """``layouts``: expected number of Muon tensors per layout, e.g. ``{"matrix": 4}``."""
    torch.manual_seed(0)
    model = build()
    model.eval()  # no dropout: the round trip below compares two models bit for bit
    cfg = dict(name="muon", lr=3e-3, muon_lr=0.02, **optimizer)
    routes = route_parameters(model, muon_conv=bool(optimizer.get("muon_conv", False)))
    assert dict(Counter(routes.layouts.values())) == layouts, routes.reasons
    assert not routes.hidden_unrouted, routes.hidden_unrouted
    on_muon = {id(p) for _, p in routes.muon}
    for name, p in model.named_parameters():  # only embeddings/heads/norms/biases/depthwise left
        if id(p) not in on_muon and p.ndim >= 2:
            why = routes.reasons[name]
            assert "embedding/head" in why or "depthwise" in why, (name, why)

    opt = build_optimizer(model, OptimizerConfig(**cfg))
    first = loss(model, 0).item()
    for _ in range(steps):
        opt.zero_grad()
        loss(model, 0).backward()
        opt.step()
    assert loss(model, 0).item() < first

    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    twin = build()
    twin.eval()
    twin.load_state_dict(model.state_dict())
    opt2 = build_optimizer(twin, OptimizerConfig(**cfg))
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    for m, o in ((model, opt), (twin, opt2)):
        o.zero_grad()
        loss(m, 1).backward()
        o.step()
    for (k, a), (_, b) in zip(model.state_dict().items(), twin.state_dict().items(),
                              strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)
