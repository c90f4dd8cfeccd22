"""Build (once, cached) and load the CPU emulation of the CUDA kernels.

The single translation unit ``binding.cpp`` compiles csrc's real launchers and kernel headers
with g++ through ``stemu.h`` into a shared library that registers the ``speedtronic_emu`` ops
(CPU kernels). The cache key hashes every source file, the compiler flags and the torch
version, so an edit anywhere in csrc/ or here triggers one rebuild; otherwise loading takes
milliseconds. No ninja is needed: one g++ call.

Cache folder: ``$SPEEDTRONIC_EMU_CACHE`` or ``<repo>/.speedtronic/emu-build`` (git-ignored).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
CSRC = REPO / "csrc"
# -O1: the emulated kernels run fast enough (the mma emulation dominates) and the build is
# ~25% quicker than -O2 here; -g1 keeps file:line in sanitizer/abort reports.
FLAGS = ["-std=c++20", "-O1", "-g1", "-shared", "-fPIC", "-fvisibility=hidden", "-w"]


def _sources() -> list[Path]:
    files = [HERE / "binding.cpp", HERE / "stemu.h", CSRC / "ops_impl.h", CSRC / "launch.h"]
    files += sorted(CSRC.glob("*.cu")) + sorted((CSRC / "kernels").glob("*"))
    return [f for f in files if f.is_file()]


def _cache_dir() -> Path:
    return Path(os.environ.get("SPEEDTRONIC_EMU_CACHE", REPO / ".speedtronic" / "emu-build"))


def build(verbose: bool = False) -> Path:
    """Return the path of the built library, compiling it if the sources changed."""
    import torch
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd_flags = FLAGS + [f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    h = hashlib.sha256()
    for f in _sources():
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update(" ".join(cmd_flags).encode())
    h.update(torch.__version__.encode())
    key = h.hexdigest()[:16]
    out_dir = _cache_dir()
    target = out_dir / f"speedtronic_emu_{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    cxx = os.environ.get("CXX", shutil.which("g++") or "c++")
    libdirs = library_paths()
    cmd = [cxx, *cmd_flags]
    cmd += [f"-I{p}" for p in include_paths()] + [f"-I{CSRC}"]
    with tempfile.NamedTemporaryFile(dir=out_dir, suffix=".so", delete=False) as tmp:
        tmp_path = Path(tmp.name)
    cmd += [str(HERE / "binding.cpp"), "-o", str(tmp_path)]
    cmd += [f"-L{d}" for d in libdirs] + ["-lc10", "-ltorch_cpu", "-ltorch"]
    cmd += [f"-Wl,-rpath,{d}" for d in libdirs]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp_path.unlink(missing_ok=True)
        raise RuntimeError("building the CUDA emulation failed:\n" + " ".join(cmd) + "\n"
                           + proc.stderr[-8000:])
    os.replace(tmp_path, target)  # atomic: concurrent builders never see a partial file
    if verbose:
        print(f"built {target.name} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return target


_loaded: Path | None = None


def load():
    """Build if needed and load; returns ``torch.ops.speedtronic_emu``."""
    global _loaded
    import torch

    if _loaded is None:
        path = build()
        torch.ops.load_library(str(path))
        _loaded = path
    return torch.ops.speedtronic_emu


if __name__ == "__main__":
    print(build(verbose=True))
