"""benchmarks/gpu_check.sh reports every failed step in its exit status.

The script is the one call a lent GPU gets (15 device-minutes a session), so it never runs in
CI. Here a stand-in interpreter plays a machine with a GPU on which every command succeeds
except the named benchmark: the out-of-order and trainer benchmarks once failed with exit 0
("0 all passed"), their statuses never reached the summary's verdict.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Every python call succeeds, except a command line naming $FAIL_STEP; not an sm_90 GPU (the
# Hopper step is skipped, as on an A100).
_FAKE_PYTHON = """#!/usr/bin/env bash
case "$*" in
  *get_device_capability*) exit 1 ;;
esac
if [[ -n "${FAIL_STEP:-}" && "$*" == *"$FAIL_STEP"* ]]; then echo "failing $FAIL_STEP"; exit 7; fi
exit 0
"""


def _run(tmp_path: Path, fail: str | None) -> subprocess.CompletedProcess:
    fake = tmp_path / "python"
    fake.write_text(_FAKE_PYTHON)
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "RESULTS_DIR": str(tmp_path / "out"),
           "COMPUTE_SANITIZER": str(tmp_path / "no-sanitizer")}
    env.pop("FAIL_STEP", None)
    if fail is not None:
        env["FAIL_STEP"] = fail
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                    reason="needs bash and coreutils timeout")
@pytest.mark.parametrize("fail", [None, "bench_ooo.py", "bench_kernels_gpu.py",
                                  "bench_trainer.py", "gpt2_small_gpu.yaml"])
def test_every_failed_step_fails_the_check(tmp_path, fail):
    proc = _run(tmp_path, fail)
    assert "== gpu_check summary" in proc.stdout, proc.stderr[-2000:]
    if fail is None:
        assert proc.returncode == 0, proc.stdout[-2000:]
        assert "FAILED" not in proc.stdout
    else:
        assert proc.returncode == 1, proc.stdout[-2000:]
        assert "FAILED (exit 7)" in proc.stdout
