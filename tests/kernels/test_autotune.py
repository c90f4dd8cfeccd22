"""Per-shape dispatch (kernels/autotune.py) with fake timers, its use by Newton-Schulz, and the
per-op fallback for dtypes the CUDA kernels lack."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch

from speedtronic.kernels import autotune, ops
from speedtronic.kernels import newton_schulz as ns


def fake_timer(times: dict[str, float], calls: list[str]):
    """A timer that runs the candidate once and reports the preset milliseconds for it."""

    def timer(fn):
        name = fn.__name__
        calls.append(name)
        fn()
        return times[name]

    return timer


def named(name: str, log: list[str] | None = None):
    def fn():
        if log is not None:
            log.append(name)
        return name

    fn.__name__ = name
    return fn


def test_picks_the_faster_candidate_and_remembers_it_on_disk(tmp_path):
    path = tmp_path / "table.json"
    calls: list[str] = []
    d = autotune.ShapeDispatch(path, fake_timer({"a": 2.0, "b": 1.0}, calls), enabled=True,
                               info={"device": "fake"})
    cands = {"a": named("a"), "b": named("b")}
    assert d.choose("k1", cands, default="a") == "b"
    assert d.choose("k1", cands, default="a") == "b" and calls == ["a", "b"]  # timed once
    saved = json.loads(path.read_text())
    assert saved["entries"]["k1"]["choice"] == "b" and saved["fingerprint"] == {"device": "fake"}
    again = autotune.ShapeDispatch(path, fake_timer({}, calls), enabled=True)
    assert again.choose("k1", cands, default="a") == "b" and calls == ["a", "b"]
    assert again.table() == [{"key": "k1", "choice": "b", "ms": {"a": 2.0, "b": 1.0}}]


def test_default_is_kept_unless_another_is_at_least_5_percent_faster(tmp_path):
    calls: list[str] = []
    d = autotune.ShapeDispatch(None, fake_timer({"a": 1.0, "b": 0.97}, calls), enabled=True)
    assert d.choose("close", {"a": named("a"), "b": named("b")}, default="a") == "a"
    d = autotune.ShapeDispatch(None, fake_timer({"a": 1.0, "b": 0.94}, calls), enabled=True)
    assert d.choose("clear", {"a": named("a"), "b": named("b")}, default="a") == "b"


def test_a_failing_candidate_is_dropped_with_a_log_line(caplog):
    def boom():
        raise RuntimeError("CUDA error: illegal address")

    boom.__name__ = "b"
    d = autotune.ShapeDispatch(None, fake_timer({"a": 5.0, "b": 0.1}, []), enabled=True)
    with caplog.at_level(logging.WARNING, logger="speedtronic.autotune"):
        assert d.choose("k", {"a": named("a"), "b": boom}, default="a") == "a"
    assert any("b failed" in r.getMessage() for r in caplog.records)


def test_disabled_never_times_and_uses_the_default(monkeypatch, tmp_path):
    monkeypatch.setenv(autotune.DISABLE_ENV, "0")
    calls: list[str] = []
    d = autotune.ShapeDispatch(tmp_path / "t.json", fake_timer({"a": 9.0, "b": 1.0}, calls))
    assert not d.enabled
    assert d.choose("k", {"a": named("a"), "b": named("b")}, default="a") == "a" and not calls
    assert not (tmp_path / "t.json").exists()


def test_unreadable_table_is_ignored(tmp_path, caplog):
    path = tmp_path / "t.json"
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="speedtronic.autotune"):
        d = autotune.ShapeDispatch(path, enabled=False)
    assert d.entries == {} and "unreadable" in caplog.text


def test_newton_schulz_auto_follows_the_measured_choice(monkeypatch):
    """On CPU with a fake-timed dispatch: the shape's measured winner is what runs."""
    ran: list[str] = []
    real_std, real_gram = ns.ns_standard, ns.ns_gram

    def spy_std(*a, **k):
        ran.append("standard")
        return real_std(*a, **k)

    def spy_gram(*a, **k):
        ran.append("gram")
        return real_gram(*a, **k)

    monkeypatch.setattr(ns, "ns_standard", spy_std)
    monkeypatch.setattr(ns, "ns_gram", spy_gram)
    G = torch.randn(2, 16, 128)  # aspect 8: the static rule says gram

    def timer_preferring(winner):
        def timer(fn):
            ran.clear()
            fn()
            return 1.0 if ran == [winner] else 3.0
        return timer

    for winner in ("standard", "gram"):
        d = autotune.ShapeDispatch(None, timer_preferring(winner), enabled=True, device_type="cpu")
        monkeypatch.setattr(autotune, "_active", d)
        ran.clear()
        ns.orthogonalize(G, 5, list(ns.QUINTIC), 1e-7, torch.float32, "auto")
        assert ran[-1] == winner
        assert [r["choice"] for r in d.table()] == [winner]
        assert d.table()[0]["key"] == "newton_schulz 2x16x128 float32 quintic 5 steps"


def test_cpu_without_measurement_uses_the_aspect_rule(monkeypatch):
    monkeypatch.setattr(autotune, "_active", autotune.ShapeDispatch(None, enabled=False))
    ran: list[str] = []
    monkeypatch.setattr(ns, "ns_gram", lambda *a, **k: ran.append("gram") or a[0])
    monkeypatch.setattr(ns, "ns_standard", lambda *a, **k: ran.append("standard") or a[0])
    ns.orthogonalize(torch.randn(8, 32), 5, list(ns.QUINTIC), 1e-7, torch.float32, "auto")
    ns.orthogonalize(torch.randn(8, 12), 5, list(ns.QUINTIC), 1e-7, torch.float32, "auto")
    assert ran == ["gram", "standard"]


def test_dtypes_the_cuda_kernels_lack_run_the_pytorch_implementation(caplog, monkeypatch):
    cuda = torch.device("cuda")  # a device object only: no GPU is needed to pick the path
    # without the extension (this machine), every CUDA op runs its PyTorch implementation
    assert ops.kernel_or_fallback("muon_post_update_", cuda, [torch.float32]) \
        is ops._muon_post_impl
    monkeypatch.setattr(ops._kernels, "available", lambda: True)  # as on a GPU with it built
    with caplog.at_level(logging.INFO, logger="speedtronic.ops"):
        pre = ops.kernel_or_fallback("muon_pre_orthogonalize_", cuda, [torch.float64])
        again = ops.kernel_or_fallback("muon_pre_orthogonalize_", cuda, [torch.float64])
    assert pre is ops._muon_pre_impl and again is pre
    assert sum("PyTorch implementation for float64" in r.getMessage()
               for r in caplog.records) == 1
    assert ops.kernel_or_fallback("muon_post_update_", cuda,
                                  [torch.float32, torch.float16]) is ops.muon_post_update_
    # Off CUDA, eager: the Python body without the dispatcher (no torch._dynamo import), which
    # like the op may update leaf parameters that require grad.
    post = ops.kernel_or_fallback("muon_post_update_", torch.device("cpu"), [torch.float64])
    assert post is ops._PYTHON_BODIES["muon_post_update_"] and post is not ops.muon_post_update_
    params = [torch.nn.Parameter(torch.ones(4, 4, dtype=torch.float64))]
    post(params, torch.ones(1, 4, 4, dtype=torch.float64), [torch.ones(4, 4, dtype=torch.float64)],
         0.1, 0.0, 1.0, False, 1e-8, False, True)
    assert torch.allclose(params[0].detach(), torch.full((4, 4), 0.9, dtype=torch.float64))


def test_eager_cpu_training_never_imports_torch_dynamo():
    """torch imports torch._dynamo (0.75 s) on the first custom-op call and the first call of
    Optimizer methods it decorates; eager CPU training must not pay for it."""
    code = """
import sys, torch
from torch import nn
from speedtronic.config import OptimizerConfig
from speedtronic.optim import build_optimizer
m = nn.Sequential(nn.Embedding(20, 16), nn.Linear(16, 32), nn.Linear(32, 20))
for cfg in (OptimizerConfig(name="muon", cautious=True, muon_plus=True), OptimizerConfig()):
    opt = build_optimizer(m, cfg)
    for _ in range(2):
        opt.zero_grad()
        m(torch.randint(0, 20, (2, 4))).sum().backward()
        opt.step()
    opt.load_state_dict(opt.state_dict())
print("torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("ns_dtype", ["fp16", "fp64"])
def test_muon_runs_every_documented_ns_dtype(ns_dtype):
    from speedtronic.optim import Muon

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 48))
    w.grad = torch.randn(16, 48)
    before = w.detach().clone()
    Muon([w], lr=0.02, ns_dtype=ns_dtype).step()
    assert torch.isfinite(w).all() and not torch.equal(w, before)


def test_fp16_guard_skips_a_non_finite_result_and_counts_it(monkeypatch):
    """A non-finite fp16 NS result (which the bound excludes) is not applied: that update is
    skipped on the device, without a host sync, and counted for the trainer to report."""
    from speedtronic.optim import Muon

    real = ops._PYTHON_BODIES["newton_schulz"]  # what Muon calls on CPU
    seen: list[torch.dtype] = []

    def flaky(G, steps, coeffs, eps, compute_dtype, method, normalized):
        seen.append(compute_dtype)
        out = real(G, steps, coeffs, eps, compute_dtype, method, normalized)
        return out.fill_(float("nan")) if len(seen) == 1 else out

    monkeypatch.setitem(ops._PYTHON_BODIES, "newton_schulz", flaky)
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 48))
    w.grad = torch.randn(16, 48)
    before = w.detach().clone()
    opt = Muon([w], lr=0.02, weight_decay=0.0, ns_dtype="fp16")
    opt.step()
    assert seen == [torch.float16] and torch.equal(w, before)
    assert opt.nonfinite_counts() == [((16, 48), 1)]
    opt.step()  # the next step is finite and applies
    assert torch.isfinite(w).all() and not torch.equal(w, before)
    assert opt.nonfinite_counts() == [((16, 48), 1)]
