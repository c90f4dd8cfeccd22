"""The fused CPU kernels (speedtronic.kernels.cpu, csrc/cpu/fused_cpu.cpp): numerics against
float64 references, the gate that decides when they run, and the setup.py build that makes them.

The library is built by every ``pip install -e .`` with a working C++ compiler, so CI (README
command 2) always has it: there a missing library is a failure, elsewhere the kernel tests skip.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from speedtronic.config import ModelConfig
from speedtronic.kernels import cpu as ck
from speedtronic.models import reference as ref
from speedtronic.models.loss import extract_loss

REPO = Path(__file__).resolve().parents[2]
BUILT = ck.status().loaded

needs_lib = pytest.mark.skipif(not BUILT, reason=f"cpu kernels not built: {ck.status().reason}")


def test_ci_builds_the_library():
    if os.environ.get("CI", "").lower() not in ("1", "true"):
        pytest.skip("outside CI a machine without a C++ compiler may lack the library")
    assert BUILT, ck.status().line()


# ---------------------------------------------------------------------------------- numerics
@needs_lib
@pytest.mark.parametrize("shape", [(3, 5, 7), (1, 1), (2, 17), (8, 128, 384), (4, 33)])
@pytest.mark.parametrize("scale", [1.0, 12.0])
def test_swiglu_matches_float64_forward_and_backward(shape, scale):
    torch.manual_seed(0)
    gate = (torch.randn(shape) * scale).requires_grad_()
    up = torch.randn(shape).requires_grad_()
    assert ck.usable(gate, up)
    out = ck.swiglu(gate, up)
    grad = torch.randn(shape)
    g_gate, g_up = torch.autograd.grad(out, (gate, up), grad)

    gate64 = gate.detach().double().requires_grad_()
    up64 = up.detach().double().requires_grad_()
    out64 = F.silu(gate64) * up64
    r_gate, r_up = torch.autograd.grad(out64, (gate64, up64), grad.double())
    # fp32 kernels against float64: a few ulps of each term, like torch's own fp32 ops.
    for got, want in ((out, out64), (g_gate, r_gate), (g_up, r_up)):
        torch.testing.assert_close(got.double(), want, rtol=2e-6,
                                   atol=2e-6 * want.abs().max().item())


@needs_lib
def test_swiglu_saturates_like_silu_and_keeps_nan():
    gate = torch.tensor([-3e38, -1e38, -1e30, -200.0, -90.0, -88.722, -88.7, -88.5, -88.0,
                         -87.5, -30.0, 0.0, 30.0, 88.5, 90.0, 1e30, float("inf"), float("-inf"),
                         float("nan")])
    up = torch.full_like(gate, 1.5)
    out = ck.swiglu(gate, up)
    want = F.silu(gate) * up  # torch's fp32 ops: exp overflows to inf, so silu(-1e38) is -0
    finite = want.isfinite()
    # relative to each value, tiny ones near exp's overflow included (-88.7: 2.7e-37)
    torch.testing.assert_close(out[finite], want[finite], rtol=1e-5, atol=0.0)
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.isinf(), want.isinf())
    g = gate.clone().requires_grad_()
    (dg,) = torch.autograd.grad(ck.swiglu(g, up), g, torch.ones_like(up))
    g2 = gate.clone().requires_grad_()
    (want_dg,) = torch.autograd.grad(F.silu(g2) * up, g2, torch.ones_like(up))
    ok = want_dg.isfinite()
    torch.testing.assert_close(dg[ok], want_dg[ok], rtol=1e-5, atol=0.0)


@needs_lib
@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 1), (130, 128), (8, 128, 128), (65, 48)])
def test_rms_norm_matches_float64_forward_and_backward(shape):
    torch.manual_seed(1)
    x = (torch.randn(shape) * 3).requires_grad_()
    w = (torch.rand(shape[-1]) + 0.5).requires_grad_()
    out = ck.rms_norm(x, w, 1e-5)
    grad = torch.randn(shape)
    g_x, g_w = torch.autograd.grad(out, (x, w), grad)

    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    out64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64
    r_x, r_w = torch.autograd.grad(out64, (x64, w64), grad.double())
    for got, want in ((out, out64), (g_x, r_x), (g_w, r_w)):
        # atol at the inputs' scale: with one column dx is 0 up to cancellation (~1e-9 in fp32).
        scale = max(1.0, want.abs().max().item())
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6 * scale)


@needs_lib
def test_rms_norm_without_weight_grad_and_zero_rows():
    x = torch.zeros(4, 8, requires_grad=True)
    x.data[1] = torch.arange(8.0)
    w = torch.ones(8)  # no grad wanted
    out = ck.rms_norm(x, w, 1e-5)
    assert out[0].eq(0).all()  # a zero row stays zero (eps keeps rstd finite)
    (g_x,) = torch.autograd.grad(out.sum(), (x,))
    assert torch.isfinite(g_x).all()


@needs_lib
def test_double_backward_uses_differentiable_ops():
    x = torch.randn(3, 6, dtype=torch.float32, requires_grad=True)
    w = torch.rand(6).add_(0.5).requires_grad_()
    gate = torch.randn(3, 6, requires_grad=True)
    up = torch.randn(3, 6, requires_grad=True)

    def penalty(norm, act):
        y = norm(x, w) * act(gate, up)
        (gx, gg) = torch.autograd.grad(y.sin().sum(), (x, gate), create_graph=True)
        return torch.autograd.grad(gx.pow(2).sum() + gg.pow(2).sum(), (x, w, gate, up))

    got = penalty(lambda a, b: ck.rms_norm(a, b, 1e-5), ck.swiglu)
    want = penalty(lambda a, b: a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-5) * b,
                   lambda g, u: F.silu(g) * u)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ what the backward is handed
class _CountingLib:
    """Wraps the loaded library and counts calls into it."""

    def __init__(self, lib):
        self.lib, self.calls = lib, []

    def __getattr__(self, name):
        fn = getattr(self.lib, name)

        def call(*args):
            self.calls.append(name)
            return fn(*args)
        return call


@needs_lib
@pytest.mark.parametrize("pack", ["half", "transpose"])
def test_saved_tensor_hooks_cannot_make_the_kernel_misread(pack):
    """A hook may hand the backward fp16 or non-contiguous tensors: it must not run C on them
    (an fp16 buffer once took fp32 writes and corrupted the heap)."""
    hooks = {"half": (lambda t: t.half(), lambda t: t),
             "transpose": (lambda t: t.t().contiguous() if t.dim() == 2 else t,
                           lambda t: t.t() if t.dim() == 2 else t)}[pack]
    torch.manual_seed(3)
    g = torch.randn(64, 40, requires_grad=True)
    u = torch.randn(64, 40, requires_grad=True)
    w = torch.rand(40).add_(0.5).requires_grad_()
    grad = torch.randn(64, 40)

    def run(fused):
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            if fused:
                y = ck.rms_norm(ck.swiglu(g, u), w, 1e-5)
            else:
                h = F.silu(g) * u
                y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w
        return torch.autograd.grad(y, (g, u, w), grad)

    for got, want in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@needs_lib
def test_a_compiled_backward_takes_the_torch_path(monkeypatch):
    """Compiled autograd traces the backward with dynamo: no C call may happen there."""
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.rand(16).add_(0.5).requires_grad_()
    y = ck.rms_norm(x, w, 1e-5) * ck.swiglu(x, x)
    spy = _CountingLib(ck._lib)
    monkeypatch.setattr(ck, "_lib", spy)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    got = torch.autograd.grad(y.sum(), (x, w))
    monkeypatch.undo()
    assert spy.calls == []
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    h = x2 * torch.rsqrt(x2.pow(2).mean(-1, keepdim=True) + 1e-5) * w2
    want = torch.autograd.grad((h * F.silu(x2) * x2).sum(), (x2, w2))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@needs_lib
def test_modes_and_lazy_tensors_take_the_torch_path():
    from torch._subclasses.fake_tensor import FakeTensorMode

    norm = ref.RMSNorm(16)
    mlp = ref.SwiGLU(16, 24)
    x = torch.randn(2, 4, 16)
    want = mlp(norm(x))
    with torch.device("meta"):  # a default-device context: buffers must not land on meta
        torch.testing.assert_close(mlp(norm(x)), want)
    with FakeTensorMode(allow_non_fake_inputs=True):  # fake buffers have no data
        assert mlp(norm(x)).shape == want.shape
    neg = torch._neg_view(x)  # lazy negation: data_ptr holds -x
    torch.testing.assert_close(norm(neg), norm(-x))
    gm = torch.fx.symbolic_trace(mlp)
    torch.testing.assert_close(gm(x), mlp(x))
    import torch.autograd.forward_ad as fwad

    with fwad.dual_level():
        out = mlp(fwad.make_dual(x, torch.ones_like(x)))
        assert fwad.unpack_dual(out).tangent is not None
    # Batched gradients (is_grads_batched) reach the backward as legacy batched tensors.
    jac = torch.autograd.functional.jacobian(lambda a: ck.rms_norm(a, norm.weight, 1e-5), x[0, :2],
                                             vectorize=True)
    jac_ref = torch.autograd.functional.jacobian(
        lambda a: a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight, x[0, :2])
    torch.testing.assert_close(jac, jac_ref, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------- gate
@needs_lib
def test_gate_refuses_what_the_kernels_do_not_handle(monkeypatch):
    t = torch.randn(4, 8)
    assert ck.usable(t, t)
    assert not ck.usable(t.double(), t.double())
    assert not ck.usable(t.bfloat16(), t.bfloat16())
    assert not ck.usable(t.t(), t.t())  # not contiguous
    assert not ck.usable(torch.empty(0, 8), torch.empty(0, 8))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not ck.usable(t, t)


@needs_lib
def test_gate_is_off_above_max_threads_and_the_line_says_so():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(ck.MAX_THREADS + 1)
        t = torch.randn(4, 8)
        assert not ck.usable(t, t)
        assert "idle" in ck.status().line() and "single-threaded" in ck.status().line()
        torch.set_num_threads(1)
        assert ck.usable(t, t)
        assert ck.status().line().startswith("cpu kernels: loaded (")
    finally:
        torch.set_num_threads(before)


def test_public_functions_fall_back_when_not_usable(monkeypatch):
    """swiglu / rms_norm are safe to call anywhere: without the kernels (or on tensors they do
    not take) they compute the same thing with torch's ops."""
    monkeypatch.setattr(ck, "_status", None)
    monkeypatch.setenv(ck.ENV, "0")
    g, u = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(ck.swiglu(g, u), F.silu(g) * u)
    w = torch.rand(8, dtype=torch.float64)
    torch.testing.assert_close(ck.rms_norm(g, w, 1e-5), F.rms_norm(g, (8,), w, 1e-5))
    with pytest.raises(ValueError, match="differ"):
        ck.swiglu(g, u[:, :4])
    with pytest.raises(ValueError, match="last dim"):
        ck.rms_norm(g, w[:4], 1e-5)


@pytest.mark.parametrize("value", ["0", "off", "False", "no"])
def test_env_switch_turns_them_off(monkeypatch, value):
    monkeypatch.setattr(ck, "_status", None)
    monkeypatch.setenv(ck.ENV, value)
    st = ck.status()
    assert not st.loaded and st.line() == f"cpu kernels: off ({ck.ENV}={value.lower()})"
    assert not ck.usable(torch.randn(2, 2), torch.randn(2, 2))


def test_env_switch_rejects_other_values(monkeypatch):
    monkeypatch.setattr(ck, "_status", None)
    monkeypatch.setenv(ck.ENV, "maybe")
    st = ck.status()
    assert not st.loaded and "'maybe' is not valid: use 1" in st.reason


def test_the_abi3_library_wins_over_a_stale_versioned_one(monkeypatch, tmp_path):
    import importlib.machinery
    import types

    versioned = [s for s in importlib.machinery.EXTENSION_SUFFIXES if "abi3" not in s][0]
    (tmp_path / f"_cpu_kernels{versioned}").write_bytes(b"old")
    (tmp_path / "_cpu_kernels.abi3.so").write_bytes(b"new")
    real = importlib.util.find_spec
    fake_pkg = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: fake_pkg if name == "speedtronic" else real(name, *a))
    assert ck._find_library() == str(tmp_path / "_cpu_kernels.abi3.so")


def test_missing_library_falls_back_with_a_reason(monkeypatch):
    monkeypatch.setattr(ck, "_status", None)
    monkeypatch.delenv(ck.ENV, raising=False)
    monkeypatch.setattr(ck, "_find_library", lambda: None)
    st = ck.status()
    assert not st.loaded and "not built" in st.reason and "C++ compiler" in st.reason
    assert "--force-reinstall" in st.reason and ck.ENV in st.reason  # how to get it built
    t = torch.randn(2, 4, 8)
    norm = ref.RMSNorm(8)
    assert "RMSNormCPU" in type(norm(t.requires_grad_()).grad_fn).__name__  # torch path


def test_stale_library_is_refused(monkeypatch, tmp_path):
    """A library whose ABI number differs from the package's is not called."""
    monkeypatch.setattr(ck, "_status", None)
    monkeypatch.delenv(ck.ENV, raising=False)
    monkeypatch.setattr(ck, "ABI", ck.ABI + 1)
    if not BUILT:
        pytest.skip("needs the built library")
    st = ck.status()
    assert not st.loaded and "ABI" in st.reason and "reinstall" in st.reason


# ---------------------------------------------------------------------------- in the model
def _model_grads(monkeypatch, on: bool, checkpointing: bool = False):
    monkeypatch.setattr(ck, "SWIGLU_MIN_NUMEL", 1)  # this small model's SwiGLU takes the kernel
    monkeypatch.setattr(ck, "_status", None)
    monkeypatch.setenv(ck.ENV, "1" if on else "0")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, max_seq_len=32, n_layer=2, n_head=4, n_kv_head=2,
                      d_model=32, gradient_checkpointing=checkpointing)
    model = ref.build_reference_transformer(cfg)
    x = torch.randint(0, 64, (2, 32))
    loss = extract_loss(model(x, x))
    loss.backward()
    kinds = {type(fn).__name__ for fn in _grad_fns(loss)}
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, kinds


def _grad_fns(t: torch.Tensor) -> list:
    seen, out, todo = set(), [], [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        out.append(fn)
        todo.extend(f for f, _ in fn.next_functions)
    return out


@needs_lib
@pytest.mark.parametrize("checkpointing", [False, True])
def test_reference_model_matches_the_torch_ops(monkeypatch, checkpointing):
    loss_on, grads_on, kinds_on = _model_grads(monkeypatch, True, checkpointing)
    loss_off, grads_off, kinds_off = _model_grads(monkeypatch, False, checkpointing)
    if not checkpointing:  # the fused Functions really ran (and not with the switch off)
        assert {"_SwiGLUBackward", "_RMSNormBackward"} <= kinds_on
        assert not {"_SwiGLUBackward", "_RMSNormBackward"} & kinds_off
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-6, atol=1e-6)
    for name, g in grads_off.items():
        torch.testing.assert_close(grads_on[name], g, rtol=1e-4, atol=1e-6 * g.abs().max().item(),
                                   msg=name)


@needs_lib
def test_inference_mode_and_torchscript():
    import io

    norm = ref.RMSNorm(8)
    mlp = ref.SwiGLU(8, 24)
    x = torch.randn(2, 3, 8)
    with torch.inference_mode():
        got = mlp(norm(x))
    with torch.no_grad():
        want = mlp(norm(x))
    torch.testing.assert_close(got, want)
    # A jit trace records torch's ops (a ctypes call could not be saved), and scripting the
    # SwiGLU module compiles its torch-ops line only.
    traced = torch.jit.trace(mlp, (x,))
    buffer = io.BytesIO()
    torch.jit.save(traced, buffer)
    buffer.seek(0)
    torch.testing.assert_close(torch.jit.load(buffer)(x * 2), mlp(x * 2))
    torch.testing.assert_close(torch.jit.script(mlp)(x), mlp(x))


@needs_lib
def test_small_swiglu_keeps_torch_ops_and_large_uses_the_kernel(monkeypatch):
    spy = _CountingLib(ck._lib)
    monkeypatch.setattr(ck, "_lib", spy)
    small = torch.randn(ck.SWIGLU_MIN_NUMEL // 128 - 1, 128)
    large = torch.randn(ck.SWIGLU_MIN_NUMEL // 128, 128)
    torch.testing.assert_close(ck.swiglu(small, small), F.silu(small) * small)
    assert spy.calls == []
    torch.testing.assert_close(ck.swiglu(large, large), F.silu(large) * large)
    assert spy.calls == ["speedtronic_swiglu_fwd"]


@needs_lib
def test_default_device_cpu_keeps_the_kernels_and_nested_tensors_do_not_reach_them():
    t = torch.randn(4, 8)
    before = torch.get_default_device()
    try:
        torch.set_default_device("cpu")
        assert ck.usable(t, t)
    finally:
        torch.set_default_device(before)
    nested = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)])
    assert not ck.usable(nested, nested)
    # The public functions trace under fx (the shapes are proxies there).
    gm = torch.fx.symbolic_trace(lambda a, b: ck.rms_norm(ck.swiglu(a, b), b[0], 1e-5))
    torch.testing.assert_close(gm(t, t), ck.rms_norm(ck.swiglu(t, t), t[0], 1e-5))


@needs_lib
def test_torch_func_transforms_take_the_torch_path():
    norm = ref.RMSNorm(8)
    x = torch.randn(3, 4, 8)
    # vmap wraps the tensors: the gate must refuse them (ctypes would read the wrong memory).
    got = torch.func.vmap(norm)(x)
    torch.testing.assert_close(got, norm(x))
    g = torch.func.grad(lambda a: norm(a).sin().sum())(x)
    a = x.clone().requires_grad_()
    torch.testing.assert_close(g, torch.autograd.grad(norm(a).sin().sum(), a)[0])


# ------------------------------------------------------------------------------- the build
def _build(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    run_env = dict(os.environ, SPEEDTRONIC_CUDA="0", **env)
    return subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
         "--build-temp", str(tmp_path / "tmp")],
        cwd=REPO, env=run_env, capture_output=True, text=True, timeout=300)


def test_setup_builds_a_loadable_library(tmp_path):
    out = _build(tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    libs = list((tmp_path / "lib" / "speedtronic").glob("_cpu_kernels*"))
    if not libs:
        pytest.skip(f"no working C++ compiler here: {out.stderr[-500:]}")
    import ctypes

    lib = ctypes.CDLL(str(libs[0]))
    lib.speedtronic_cpu_abi.restype = ctypes.c_int32
    assert lib.speedtronic_cpu_abi() == ck.ABI


@pytest.mark.parametrize("inplace", [False, True])
def test_setup_survives_a_broken_compiler(tmp_path, inplace):
    """Also in place, as `pip install -e .` builds: setuptools then copies each built library
    into the source tree, and a library that did not build must be skipped, not fail."""
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'no compiler here' >&2\nexit 1\n")
    broken.chmod(0o755)
    env = dict(CC=str(broken), CXX=str(broken), LDSHARED=f"{broken} -shared",
               LDCXXSHARED=f"{broken} -shared")
    if inplace:  # a copy of the sources, so the real checkout's library is never touched
        src = tmp_path / "src"
        (src / "speedtronic").mkdir(parents=True)
        (src / "csrc" / "cpu").mkdir(parents=True)
        for rel in ("setup.py", "csrc/cpu/fused_cpu.cpp"):
            (src / rel).write_bytes((REPO / rel).read_bytes())
        (src / "speedtronic" / "__init__.py").write_text("")
        out = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace",
                              "--build-temp", str(tmp_path / "tmp")], cwd=src,
                             env=dict(os.environ, SPEEDTRONIC_CUDA="0", **env),
                             capture_output=True, text=True, timeout=300)
        assert not list((src / "speedtronic").glob("_cpu_kernels*"))
    else:
        out = _build(tmp_path, **env)
        assert not list((tmp_path / "lib").rglob("_cpu_kernels*"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "speedtronic: CPU kernels: not built" in out.stderr


def test_setup_skip_switch(tmp_path):
    out = _build(tmp_path, SPEEDTRONIC_CPU_KERNELS="0")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "CPU kernels: skipped (SPEEDTRONIC_CPU_KERNELS=0)" in out.stderr
    bad = _build(tmp_path, SPEEDTRONIC_CPU_KERNELS="maybe")
    assert bad.returncode != 0 and "SPEEDTRONIC_CPU_KERNELS='maybe' is not valid" in bad.stderr
    assert not list((tmp_path / "lib").rglob("_cpu_kernels*"))
