"""Build/load the CPU CUDA emulator (tests/kernels/cuda_emulation/emu_build.py) from any test."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_BUILD = Path(__file__).resolve().parent / "kernels" / "cuda_emulation" / "emu_build.py"


def load_emulator():
    """The compiled emulation module (built once per source hash by emu_build)."""
    spec = importlib.util.spec_from_file_location("emu_build", _BUILD)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.load()
