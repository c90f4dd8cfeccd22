"""speedtronic.optim.Muon against torch's own test data for torch.optim.Muon
(``torch.testing._internal.common_optimizers``): every sample input steps like torch's, every
error input raises the same error type with a message matching torch's regex."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("expecttest")  # torch's internal test helpers import it
common = pytest.importorskip("torch.testing._internal.common_optimizers")

from speedtronic.optim import Muon  # noqa: E402

INFO = next(o for o in common.optim_db if o.optim_cls is torch.optim.Muon)
SAMPLES = INFO.optim_inputs_func(device="cpu", dtype=torch.float32)
ERRORS = INFO.optim_error_inputs_func(device="cpu", dtype=torch.float32)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g))
            for shape in ((8, 16), (16, 8), (12, 12), (12, 12))]


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.desc for s in SAMPLES])
def test_every_sample_input_steps_like_torch(sample):
    ours, theirs = _params(), _params()
    kwargs = copy.deepcopy(sample.kwargs)
    opt_t = torch.optim.Muon(theirs, **kwargs)
    opt_o = Muon(ours, **copy.deepcopy(sample.kwargs), ns_dtype="bf16")  # torch's NS dtype
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for a, b in zip(ours, theirs, strict=True):
            grad = torch.randn(a.shape, generator=g)
            a.grad, b.grad = grad.clone(), grad.clone()
        opt_t.step()
        opt_o.step()
    for a, b in zip(ours, theirs, strict=True):
        # Same math; bf16 Newton-Schulz batched by shape vs one matrix at a time rounds a little
        # differently (updates are lr-sized, so compare the parameters' change).
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=2e-3)
        assert "momentum_buffer" in opt_o.state[a] and "momentum_buffer" in opt_t.state[b]


@pytest.mark.parametrize("error", ERRORS, ids=[e.error_regex[:40] for e in ERRORS])
def test_every_error_input_raises_like_torch(error):
    inp = error.optimizer_error_input
    params = copy.deepcopy(inp.params) if inp.params is not None else _params()
    kwargs = copy.deepcopy(inp.kwargs)
    if issubclass(error.error_type, Warning):
        with pytest.warns(error.error_type, match=error.error_regex):
            Muon(params, **kwargs)
        return
    if error.error_on == common.OptimizerErrorEnum.CONSTRUCTION_ERROR:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(error.error_type, match=error.error_regex):
                Muon(params, **kwargs)
        return
    opt = Muon(params, **kwargs)
    with pytest.raises(error.error_type, match=error.error_regex):
        opt.step()
