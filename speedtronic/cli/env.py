"""Diagnostics for ``speedtronic env``: versions, devices, threads, optional components.

Each line is a fact a bug report needs; nothing here changes state.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import platform
import sys
from typing import Any


def _version(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return str(getattr(__import__(module), "__version__", "installed"))
    except Exception as exc:  # a broken optional install should be reported, not crash env
        return f"broken ({type(exc).__name__}: {exc})"


def _dist_version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def collect_env() -> dict[str, Any]:
    """A dict of environment facts (JSON-serializable)."""
    import torch

    from .. import __version__

    info: dict[str, Any] = {
        "speedtronic": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": [],
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["cuda_devices"].append({
                "index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                "memory_gib": round(p.total_memory / 2**30, 1),
                "bf16": bool(torch.cuda.is_bf16_supported()),
            })
    mps = getattr(torch.backends, "mps", None)
    info["mps_available"] = bool(mps is not None and mps.is_available())
    for pkg in ("numpy", "yaml", "safetensors", "tqdm", "matplotlib", "tensorboard", "wandb"):
        info[pkg] = _version(pkg)
    # Optional back ends, by their installed metadata: importing transformers or datasets
    # would cost seconds and is not needed to report a version.
    for dist in ("tokenizers", "datasets", "transformers", "huggingface_hub", "s3fs",
                 "torchft", "lightning", "accelerate"):
        info[dist] = _dist_version(dist)
    info["kernels"] = _kernel_status()
    info["cpu_kernels"] = _cpu_kernel_status()
    info["autotune"] = _autotune_table()
    info["ns_kernels"] = _optional_kernels()
    return info


def _optional_kernels() -> dict[str, str]:
    """Whether each optional Newton-Schulz kernel family may compete (kernels.choice)."""
    from ..kernels import newton_schulz_gemm as gemm

    out = {}
    for family in (gemm.POLY_LT, gemm.NS_STEP_LT, gemm.SYM_GEMM):
        if family.disabled is not None:
            state = f"off after an error: {family.disabled}"
        elif family.op() is not None:
            state = "candidate (checked, then timed per shape)"
        elif family.load() is None:
            state = "unavailable (the CUDA extension is not loaded)"
        else:
            state = f"off ({family.env}={'0' if family.default_on else '1'} to change)"
        out[family.label] = state
    return out


def _autotune_table() -> dict[str, Any]:
    """The per-shape choices measured on this GPU so far (see speedtronic.kernels.autotune)."""
    from ..kernels import autotune

    dispatch = autotune.active_dispatch()
    out: dict[str, Any] = {"enabled": dispatch.enabled, "table": str(dispatch.path)}
    for row in dispatch.table():
        times = ", ".join(f"{k} {v:.3f} ms" for k, v in row.get("ms", {}).items())
        out[row["key"]] = f"{row['choice']} ({times})"
    return out


def _cpu_kernel_status() -> dict[str, Any]:
    """The fused CPU kernels (speedtronic.kernels.cpu): loaded or why not, and which ISA copy."""
    from ..kernels import cpu as cpu_kernels

    report = cpu_kernels.status()
    return {"decision": report.line(), "library": report.path}


def _kernel_status() -> dict[str, Any]:
    """The kernel loader's decision, as plain values (importing ops makes the loader decide)."""
    from ..kernels import (
        extension,
        ops,  # noqa: F401  (defines the schemas, then has the loader decide)
    )

    report = extension.status()
    return {k: (list(v) if isinstance(v, tuple) else v)
            for k, v in dataclasses.asdict(report).items()}


def format_env(info: dict[str, Any]) -> str:
    """Human-readable ``key: value`` lines, the colons in one column."""
    rows: list[tuple[str, Any]] = []
    for key, value in info.items():
        if key == "cuda_devices":
            if not value:
                rows.append((key, "none"))
            for dev in value:
                rows.append((f"cuda:{dev['index']}", f"{dev['name']} (sm {dev['capability']}, "
                             f"{dev['memory_gib']} GiB, bf16={dev['bf16']})"))
        elif isinstance(value, dict):
            rows.extend((f"{key}.{k}", v) for k, v in value.items())
        else:
            missing = {"OMP_NUM_THREADS": "unset", "torch_cuda": "none (CPU-only torch)"}.get(
                key, "not installed")
            rows.append((key, missing if value is None else value))
    width = max((len(name) for name, _ in rows), default=0)
    lines = [f"{name:{width}s} : {value}" for name, value in rows]
    return "\n".join(lines)
