"""The kernel loader (kernels.extension) and the setup.py extension seam, on a CPU machine."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest
import torch

import speedtronic.kernels.extension as kernels
import speedtronic.kernels.ops  # noqa: F401  (defines the schemas, then hands its op list to the loader)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fresh_status(monkeypatch):
    monkeypatch.setattr(kernels, "_status", None)
    yield
    kernels._status = None


def test_disable_env_wins_and_logs_one_line(monkeypatch, caplog):
    monkeypatch.setenv("SPEEDTRONIC_DISABLE_KERNELS", "1")
    with caplog.at_level(logging.INFO, logger="speedtronic.kernels"):
        st = kernels.load()
    assert not st.active and "SPEEDTRONIC_DISABLE_KERNELS=1" in st.reason
    lines = [r.getMessage() for r in caplog.records if r.name == "speedtronic.kernels"]
    assert lines == ["cuda kernels: fallback: disabled by SPEEDTRONIC_DISABLE_KERNELS=1"]
    assert not kernels.available()


def test_cpu_only_torch_falls_back_with_reason(monkeypatch):
    monkeypatch.delenv("SPEEDTRONIC_DISABLE_KERNELS", raising=False)
    monkeypatch.setattr(torch.version, "cuda", None)
    st = kernels.load(force=True)
    assert not st.active and "CPU-only" in st.reason
    assert st.line().startswith("cuda kernels: fallback: ")


def test_missing_extension_says_how_to_build(monkeypatch):
    monkeypatch.delenv("SPEEDTRONIC_DISABLE_KERNELS", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(kernels, "_find_extension", lambda: None)
    st = kernels.load(force=True)
    assert not st.active and "not built" in st.reason and "--no-build-isolation" in st.reason


def test_build_for_another_torch_is_not_imported(monkeypatch, tmp_path):
    so = tmp_path / "_C.so"
    so.write_bytes(b"not a real library")
    (tmp_path / kernels.BUILD_INFO_NAME).write_text(json.dumps(
        {"torch_version": "1.0.0+cu999", "arch_list": "8.0"}))
    monkeypatch.delenv("SPEEDTRONIC_DISABLE_KERNELS", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(kernels, "_find_extension", lambda: so)
    imported = []
    monkeypatch.setattr(kernels.importlib, "import_module", lambda name: imported.append(name))
    st = kernels.load(force=True)
    assert not st.active and "built for torch 1.0.0+cu999" in st.reason
    assert "speedtronic._C" not in imported  # never loads a mismatched binary


def _fake_cuda_build(monkeypatch, tmp_path, arch_list: str, capability: tuple[int, int]) -> None:
    """A built extension (empty file, build JSON with ``arch_list``) beside a CUDA torch that
    sees one device of ``capability``."""
    so = tmp_path / "_C.so"
    so.write_bytes(b"")
    (tmp_path / kernels.BUILD_INFO_NAME).write_text(json.dumps(
        {"torch_version": torch.__version__, "arch_list": arch_list}))
    monkeypatch.delenv("SPEEDTRONIC_DISABLE_KERNELS", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(kernels, "_find_extension", lambda: so)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)


def test_incompatible_device_arch_is_caught_before_import(monkeypatch, tmp_path):
    _fake_cuda_build(monkeypatch, tmp_path, "8.0;9.0", (12, 0))
    imported = []
    monkeypatch.setattr(kernels.importlib, "import_module", lambda name: imported.append(name))
    st = kernels.load(force=True)
    assert not st.active and st.device_arch == "sm_120"
    assert "TORCH_CUDA_ARCH_LIST=12.0" in st.reason and "speedtronic._C" not in imported


def test_import_failure_and_loader_bugs_never_raise(monkeypatch, tmp_path):
    so = tmp_path / "_C.so"
    so.write_bytes(b"")
    monkeypatch.delenv("SPEEDTRONIC_DISABLE_KERNELS", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(kernels, "_find_extension", lambda: so)

    def boom(name):
        if name == "speedtronic._C":
            raise ImportError("undefined symbol: _ZN3c10")

    monkeypatch.setattr(kernels.importlib, "import_module", boom)
    st = kernels.load(force=True)
    assert not st.active and "undefined symbol" in st.reason

    monkeypatch.setattr(kernels, "_decide", lambda: 1 / 0)
    st = kernels.load(force=True)
    assert not st.active and st.reason.startswith("loader error: ZeroDivisionError")


def test_env_info_has_the_fields_speedtronic_env_prints(monkeypatch):
    monkeypatch.setenv("SPEEDTRONIC_DISABLE_KERNELS", "1")
    info = kernels.env_info()
    assert info["cuda_kernels"] == "fallback"
    keys = {"reason", "extension", "extension_arches", "device_arch", "built_with_torch"}
    assert keys <= set(info)


@pytest.mark.parametrize("text,expected", [
    ("8.0;9.0+PTX", ("sm_80", "sm_90", "compute_90")),
    ("800,900", ("sm_80", "sm_90")),
    ("9.0a", ("sm_90a",)),
    ("", ()),
])
def test_parse_arch_list(text, expected):
    assert kernels.parse_arch_list(text) == expected


@pytest.mark.parametrize("arches,cap,ok", [
    (("sm_80",), (8, 6), True),       # same major, newer minor: SASS runs
    (("sm_80",), (9, 0), False),      # no Hopper SASS, no PTX
    (("sm_80", "compute_90"), (12, 0), True),  # PTX JIT on newer GPUs
    (("sm_90a",), (9, 0), True),
    (("sm_90a",), (10, 0), False),
    (("sm_86",), (8, 0), False),
])
def test_arch_compatibility(arches, cap, ok):
    assert kernels.arch_compatible(arches, *cap) is ok


def test_ops_owns_the_op_list_and_hands_it_to_the_loader():
    from speedtronic.kernels import ops

    for name in ops.OP_NAMES:
        assert hasattr(torch.ops.speedtronic, name), name
    # OP_NAMES must name every custom op, or the CUDA registration check (and CI's check of the
    # built extension) would miss a new op's kernel.
    defined = {n for n in ops.__all__
               if isinstance(getattr(ops, n), torch._library.custom_ops.CustomOpDef)}
    assert defined == set(ops.OP_NAMES)
    assert kernels.expected_ops() == ops.CUDA_KERNEL_OPS
    assert "newton_schulz" not in ops.CUDA_KERNEL_OPS  # cuBLAS driven by the Python body


# ------------------------------------------------------------------------------ setup.py seam
def _setup_module(monkeypatch):
    import setuptools

    calls = []
    monkeypatch.setattr(setuptools, "setup", lambda **kw: calls.append(kw))
    spec = importlib.util.spec_from_file_location("speedtronic_setup", REPO / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, calls


def test_setup_without_cuda_builds_pure_python(monkeypatch, capsys):
    monkeypatch.delenv("SPEEDTRONIC_CUDA", raising=False)
    monkeypatch.setattr(torch.version, "cuda", None)
    mod, calls = _setup_module(monkeypatch)
    # Only the torch-free CPU kernel library (tests/kernels/test_cpu.py builds it for real).
    assert calls and [e.name for e in calls[0]["ext_modules"]] == [mod.CPU_EXTENSION]
    # It uses no Python API: one cp310-abi3 wheel serves every Python version.
    assert calls[0]["ext_modules"][0].py_limited_api
    assert calls[0]["options"] == {"bdist_wheel": {"py_limited_api": "cp310"}}
    # Free-threaded CPython: setuptools refuses the limited API there before 3.15.
    import sysconfig

    real = sysconfig.get_config_var
    monkeypatch.setattr(sysconfig, "get_config_var",
                        lambda name: 1 if name == "Py_GIL_DISABLED" else real(name))
    mod_ft, calls_ft = _setup_module(monkeypatch)
    assert mod_ft.FREE_THREADED and calls_ft[0]["options"] == {}
    assert not calls_ft[0]["ext_modules"][0].py_limited_api
    assert "skipped" in capsys.readouterr().err
    monkeypatch.setenv("SPEEDTRONIC_CUDA", "0")
    monkeypatch.setenv("SPEEDTRONIC_CPU_KERNELS", "0")
    exts, cmdclass = mod.extension_modules()
    assert exts == [] and "CUDA" not in cmdclass["build_ext"].__name__


def test_setup_cuda_flag_validation(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    mod, _ = _setup_module(monkeypatch)
    monkeypatch.setenv("SPEEDTRONIC_CUDA", "yes")
    with pytest.raises(SystemExit, match="auto, 0 or 1"):
        mod.extension_modules()
    monkeypatch.setenv("SPEEDTRONIC_CUDA", "1")
    with pytest.raises(SystemExit, match="SPEEDTRONIC_CUDA=1 but torch"):
        mod.extension_modules()


def test_setup_caps_max_jobs_by_free_ram(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    mod, _ = _setup_module(monkeypatch)
    monkeypatch.delenv("MAX_JOBS", raising=False)
    monkeypatch.setattr(mod, "_free_ram_gib", lambda: 3.0)
    mod._cap_max_jobs()
    assert int(__import__("os").environ["MAX_JOBS"]) == 1


def test_load_before_ops_import_waits_for_the_schemas(tmp_path):
    """kernels is a leaf: called before kernels.ops exists it neither imports ops nor the
    binary (whose CUDA impls would attach to undefined ops), and caches nothing; importing ops
    then makes the real decision."""
    import subprocess
    import sys

    so = tmp_path / "_C.so"
    so.write_bytes(b"")
    info = {"torch_version": torch.__version__}
    (tmp_path / kernels.BUILD_INFO_NAME).write_text(json.dumps(info))
    code = (
        "import torch, sys\n"
        "torch.version.cuda = '13.0'\n"
        "import speedtronic.kernels.extension as k\n"
        f"k._find_extension = lambda: __import__('pathlib').Path({str(so)!r})\n"
        "st = k.load()\n"
        "assert 'speedtronic.kernels.ops' not in sys.modules\n"
        "assert 'speedtronic._C' not in sys.modules\n"
        "assert not st.active and st.reason == k.NOT_LOADED, st\n"
        "assert k._status is None\n"
        "import speedtronic.kernels.ops\n"
        "print(k.status().reason)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "importing speedtronic._C failed" in out.stdout


def test_a_binary_without_the_devices_arch_is_turned_down_after_import_and_left_unused(
        monkeypatch, tmp_path):
    """No arch list in the build JSON (a plain `pip install .`): the check before the import
    cannot decide, so the binary's own arches are checked after it. An sm_80/sm_90 binary once
    reported "loaded" on an sm_75 device; its registered kernels must then stay unused."""
    from speedtronic.kernels import ops

    _fake_cuda_build(monkeypatch, tmp_path, "", (7, 5))
    monkeypatch.setattr(kernels.importlib, "import_module", lambda name: None)
    monkeypatch.setattr(kernels, "_so_arches", lambda path, info: ("sm_80", "sm_90"))
    monkeypatch.setattr(kernels, "registered_cuda_ops", lambda: kernels.expected_ops())
    try:
        st = kernels.load(force=True)
        assert not st.active and st.device_arch == "sm_75"
        assert "binary has sm_80,sm_90" in st.reason and "TORCH_CUDA_ARCH_LIST=7.5" in st.reason
        # the kernels the import registered are not what a CUDA step gets
        assert ops.kernel_or_fallback("cautious_mask_", torch.device("cuda"), [torch.float32]) \
            is ops._PYTORCH_IMPLS["cautious_mask_"]
        assert ops.kernel_or_fallback("newton_schulz", torch.device("cuda"), []) \
            is ops.newton_schulz  # no CUDA kernel of its own: the op, as before
        # a newer device than the binary's newest SASS runs its PTX (torch embeds it when no
        # arch list was given): that binary is kept
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
        assert kernels.load(force=True).active
    finally:
        monkeypatch.undo()
        kernels.load(force=True)  # the real decision again for the tests after this one
