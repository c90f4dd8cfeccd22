"""Build script: pure Python, plus two optional compiled parts.

* ``speedtronic._cpu_kernels``: fused fp32 CPU kernels (csrc/cpu/), a torch-free C++ library
  loaded with ctypes, so a plain ``pip install -e .`` builds it in about a second with the
  system C++ compiler. ``SPEEDTRONIC_CPU_KERNELS=0`` skips it; a failed compile prints one line
  and the install goes on (the pure-PyTorch path then runs).
* ``speedtronic._C``: the CUDA extension.

The CUDA extension is built only when torch has CUDA and nvcc is found. ``SPEEDTRONIC_CUDA``:
``auto`` (default) builds when possible and otherwise prints one line saying why not (a
failed nvcc or link included), ``0`` never builds, ``1`` fails loudly when it cannot build. An
install without CUDA never fails, and in ``auto`` neither does one whose CUDA build fails.
Build against the torch you run with: ``pip install --no-build-isolation .`` (README,
"CUDA kernels").
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import sysconfig

import setuptools
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

#: pyproject.toml's SPDX license string needs setuptools 77 (PEP 639). pip's isolated build
#: gets it from [build-system]; --no-build-isolation (the CUDA build) uses the venv's own, and
#: torch 2.11/2.12 leave a venv's bundled 65.x in place: one line instead of a schema error.
if int(setuptools.__version__.split(".")[0]) < 77:
    raise SystemExit(f"speedtronic: building needs setuptools>=77, this environment has "
                     f"{setuptools.__version__} (--no-build-isolation uses it): "
                     "pip install 'setuptools>=77' wheel")

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("csrc")
#: Without a visible GPU there is nothing to detect: Ampere and Hopper SASS, plus Hopper PTX so
#: newer GPUs can JIT it.
DEFAULT_ARCH_LIST = "8.0;9.0+PTX"
#: Compiled for sm_90a only (-gencode arch=compute_90a,code=sm_90a), outside the arch list.
SM90A_SOURCE = "sym_gemm_sm90.cu"
#: nvcc + cicc peak per job on the launcher files, measured here (~1.5 GiB; 2 GiB with headroom).
GIB_PER_JOB = 2.0


#: A free-threaded (no-GIL) interpreter: no limited-API (abi3) builds there.
FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
#: The torch-free CPU kernel library (speedtronic/kernels/cpu.py loads it with ctypes).
CPU_EXTENSION = "speedtronic._cpu_kernels"
CPU_SOURCE = os.path.join("csrc", "cpu", "fused_cpu.cpp")


def _say(msg: str) -> None:
    print(f"speedtronic: CUDA extension: {msg}", file=sys.stderr)


def _say_cpu(msg: str) -> None:
    print(f"speedtronic: CPU kernels: {msg}", file=sys.stderr)


def cpu_extension() -> list[Extension]:
    """The CPU kernel library as an Extension, or nothing (skipped, or the source is missing)."""
    value = os.environ.get("SPEEDTRONIC_CPU_KERNELS", "").strip().lower()
    if value in ("0", "false", "no", "off"):
        _say_cpu(f"skipped (SPEEDTRONIC_CPU_KERNELS={value})")
        return []
    if value not in ("", "1", "true", "yes", "on"):
        raise SystemExit(f"SPEEDTRONIC_CPU_KERNELS={value!r} is not valid; use 1 or 0")
    if not os.path.isfile(os.path.join(ROOT, CPU_SOURCE)):
        _say_cpu(f"skipped ({CPU_SOURCE} is missing; an incomplete sdist?)")
        return []
    # No -ffast-math: the kernels keep inf/nan semantics and a fixed summation order.
    # -std=c++17 pinned: torch's BuildExtension (the CUDA path) would otherwise add its own.
    # -fno-trapping-math lets GCC vectorize the kernels' selects in the AVX2 and baseline copies
    # (csrc/cpu/fused_cpu.cpp says what it measured); values are unchanged.
    flags = ([] if sys.platform == "win32"
             else ["-O3", "-std=c++17", "-fno-math-errno", "-fno-trapping-math",
                   "-fvisibility=hidden"])
    # py_limited_api: the library uses no Python API at all, so one binary (_cpu_kernels.abi3.so)
    # serves every Python version; see ABI3_WHEEL below. Not on free-threaded CPython, where
    # setuptools refuses the limited API before 3.15.
    # optional=True: an in-place (editable) build then skips the copy of a library that failed
    # to compile instead of failing the install.
    return [Extension(CPU_EXTENSION, sources=[CPU_SOURCE], language="c++",
                      extra_compile_args=flags, py_limited_api=not FREE_THREADED, optional=True)]


class _OptionalCpuKernels:
    """build_ext mixin: a failed CPU-kernel compile is reported, never fatal.

    The library is not a Python module (no PyInit: it is loaded with ctypes and includes no
    Python header, so no python3-dev is needed), hence no export list for it either.
    """

    def get_export_symbols(self, ext):  # noqa: D401 - setuptools hook
        if ext.name == CPU_EXTENSION:
            return []
        return super().get_export_symbols(ext)

    def build_extension(self, ext):  # noqa: D401 - setuptools hook
        if ext.name != CPU_EXTENSION:
            return super().build_extension(ext)
        try:
            build_ext.build_extension(self, ext)
        except Exception as exc:  # CompileError, LinkError, a missing compiler: never fatal
            _say_cpu(f"not built ({type(exc).__name__}: {exc}); the pure-PyTorch ops will run")


class BuildCpuKernels(_OptionalCpuKernels, build_ext):
    """build_ext for an install without the CUDA extension."""


def _free_ram_gib() -> float | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def _cap_max_jobs() -> None:
    """Parallel nvcc jobs: at most the cores, and at most free RAM / GIB_PER_JOB."""
    if os.environ.get("MAX_JOBS"):
        return
    jobs = os.cpu_count() or 1
    free = _free_ram_gib()
    if free is not None:
        jobs = max(1, min(jobs, int(free // GIB_PER_JOB)))
    os.environ["MAX_JOBS"] = str(jobs)


def _nvidia_include_dirs() -> list[str]:
    """Headers of the nvidia-* wheels (cusparse.h, cublas_v2.h, ...) that torch's CUDA headers
    include but a bare toolkit under /usr/local/cuda may lack."""
    dirs = []
    for base in sys.path:
        for sub in ("nvidia/cu13/include", "nvidia/cu12/include"):
            path = os.path.join(base, sub)
            if os.path.isdir(path):
                dirs.append(path)
    return list(dict.fromkeys(dirs))


def _why_not_cuda() -> str | None:
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return ("torch is not importable in the build environment "
                "(build with pip install --no-build-isolation .)")
    if torch.version.cuda is None:
        return f"torch {torch.__version__} has no CUDA"
    home = cpp_extension.CUDA_HOME
    nvcc = os.path.join(home, "bin", "nvcc") if home else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        return "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    if not os.path.isfile(os.path.join(ROOT, CSRC, "ops.cpp")):
        return f"the CUDA sources are missing ({os.path.join(ROOT, CSRC)}; an incomplete sdist?)"
    return None


def extension_modules() -> tuple[list, dict]:
    """Return (ext_modules, cmdclass) for setup(); empty when the extension is not built."""
    mode = os.environ.get("SPEEDTRONIC_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"SPEEDTRONIC_CUDA={mode!r} is not valid; use auto, 0 or 1")
    cpu_only = (cpu_extension(), {"build_ext": BuildCpuKernels})
    if mode == "0":
        _say("skipped (SPEEDTRONIC_CUDA=0)")
        return cpu_only
    reason = _why_not_cuda()
    if reason:
        if mode == "1":
            raise SystemExit(f"SPEEDTRONIC_CUDA=1 but {reason}")
        _say(f"skipped ({reason}); the pure-PyTorch ops will be used")
        return cpu_only

    import torch
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCH_LIST
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "(detected from the visible GPU)")
    _cap_max_jobs()
    _say(f"building for {arch_list} with MAX_JOBS={os.environ['MAX_JOBS']}")

    # csrc/sym_gemm_sm90.cu needs sm_90a (wgmma) and nothing else: compiled on its own by
    # BuildWithInfo below and linked in as an object, so the other files keep the arch list.
    sources = [os.path.join(CSRC, "ops.cpp")] + sorted(
        f for f in glob.glob(os.path.join(CSRC, "*.cu")) if os.path.basename(f) != SM90A_SOURCE)
    torch_version = torch.__version__
    ext = CUDAExtension(
        name="speedtronic._C",
        # optional in auto: setuptools (and an editable install) then copies no binary a
        # failed build did not make, instead of failing on it after the failure was reported
        optional=mode != "1",
        sources=sources,
        include_dirs=[os.path.join(ROOT, CSRC)] + _nvidia_include_dirs(),
        extra_compile_args={
            "cxx": ["-O3"],
            "nvcc": [
                "-O3", "-lineinfo",
                # A spill or local-memory use in a kernel is a performance bug: say so in the log
                # (CI turns these into errors, see .ci/run).
                "-Xptxas=-warn-spills,-warn-lmem-usage",
            ],
        },
    )

    class BuildWithInfo(_OptionalCpuKernels, BuildExtension):
        """Writes ``_C.build.json`` beside the binary; the loader reads it before importing."""

        built_cuda = False
        failed_cuda = False

        def build_extension(self, ext):  # noqa: D401 - setuptools hook
            if ext.name == CPU_EXTENSION:
                return super().build_extension(ext)
            try:
                ext.extra_objects = list(ext.extra_objects or []) + [self._compile_sm90a(ext)]
                super().build_extension(ext)
                self.built_cuda = True
            except Exception as exc:  # noqa: BLE001 - nvcc, the compiler or the linker
                if mode == "1":
                    raise
                self.failed_cuda = True
                # auto: the documented promise is "build when possible, otherwise say why"
                # (an nvcc failure, e.g. one too old for sm_90a, once failed the whole install)
                _say(f"not built ({type(exc).__name__}: {str(exc)[:300]}); the pure-PyTorch "
                     "ops will be used (SPEEDTRONIC_CUDA=1 makes this an error)")

        def _remove_stale_binary(self) -> None:
            """After a failed in-place (editable) rebuild, delete the previous ``_C`` and its
            build info from the source tree. setuptools copies nothing for an optional
            extension that failed, so the old binary would stay and load: compiled from older
            sources but for the same torch, it passes every check the loader can make."""
            name = os.path.basename(self.get_ext_filename(self.get_ext_fullname("speedtronic._C")))
            for stale in (name, "_C.build.json"):
                path = os.path.join(ROOT, "speedtronic", stale)
                if os.path.exists(path):
                    os.remove(path)
                    _say(f"removed the previous build's {os.path.relpath(path, ROOT)}")

        def _compile_sm90a(self, ext) -> str:
            """nvcc on SM90A_SOURCE for sm_90a alone (it includes no torch header)."""
            from torch.utils.cpp_extension import CUDA_HOME

            src = os.path.join(ROOT, CSRC, SM90A_SOURCE)
            os.makedirs(self.build_temp, exist_ok=True)
            obj = os.path.join(self.build_temp, "sym_gemm_sm90.sm_90a.o")
            deps = ([src] + glob.glob(os.path.join(ROOT, CSRC, "kernels", "*"))
                    + [os.path.join(ROOT, CSRC, "launch.h")])
            newest = max(os.path.getmtime(d) for d in deps)
            if os.path.exists(obj) and os.path.getmtime(obj) >= newest:
                return obj
            nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else "nvcc"
            cmd = [nvcc, "-std=c++17", "-O3", "-lineinfo", "-c", src, "-o", obj,
                   "-gencode", "arch=compute_90a,code=sm_90a", "-Xcompiler", "-fPIC",
                   f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                   "-Xptxas=-warn-spills,-warn-lmem-usage"]
            cmd += [f"-I{d}" for d in ext.include_dirs]
            _say("nvcc " + SM90A_SOURCE + " for sm_90a")
            import subprocess

            subprocess.run(cmd, check=True)
            return obj

        def run(self):  # noqa: D401 - setuptools hook
            super().run()
            if self.failed_cuda and self.inplace:
                self._remove_stale_binary()
            if not self.built_cuda:
                return
            info = {
                "torch_version": torch_version,
                "cuda_version": torch.version.cuda,
                "arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST", ""),
            }
            # Beside the binary in build_lib (so wheels carry it) and, for --inplace builds,
            # beside the copy in the source tree.
            folders = {os.path.join(self.build_lib, "speedtronic")}
            if self.inplace:
                folders.add(os.path.join(ROOT, "speedtronic"))
            for folder in folders:
                if os.path.isdir(folder):
                    with open(os.path.join(folder, "_C.build.json"), "w") as fh:
                        json.dump(info, fh, indent=1)

    use_ninja = shutil.which("ninja") is not None
    return cpu_only[0] + [ext], {"build_ext": BuildWithInfo.with_options(use_ninja=use_ninja)}


class BuildPyWithConfigs(build_py):
    """Also copies the repository's ``configs/*.yaml`` into the built package as
    ``speedtronic/configs/``, so a wheel install runs ``speedtronic train --config quickstart``
    (speedtronic/config/bundled.py). An editable install reads ``configs/`` in place."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = os.path.join(self.build_lib, "speedtronic", "configs")
        for source in sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))):
            self.mkpath(target)
            self.copy_file(source, os.path.join(target, os.path.basename(source)))


ext_modules, cmdclass = extension_modules()
cmdclass = {**cmdclass, "build_py": BuildPyWithConfigs}
#: With only the CPU library to build, the wheel is tagged cp310-abi3 (one wheel for every
#: Python >= 3.10 on the platform); the CUDA extension is tied to one Python version.
ABI3_WHEEL = (bool(ext_modules) and all(e.name == CPU_EXTENSION for e in ext_modules)
              and not FREE_THREADED)
setup(ext_modules=ext_modules, cmdclass=cmdclass,
      options={"bdist_wheel": {"py_limited_api": "cp310"}} if ABI3_WHEEL else {})
