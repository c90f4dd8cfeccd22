"""Every config under configs/ loads and validates (a renamed key would otherwise only surface
when a user runs it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from speedtronic.config import ConfigError, bundled, load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_there_are_shipped_configs():
    assert {p.name for p in CONFIGS} >= {"quickstart.yaml", "gpt2_small_gpu.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_validates(path):
    cfg = load_config(path)
    assert cfg.run.max_steps > 0


# --- bundled by name: `--config quickstart` without a clone (speedtronic/config/bundled.py) ----

ROOT = Path(__file__).resolve().parents[2]


def test_a_bundled_config_is_named_alone_and_a_file_of_that_name_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here: only the package can answer
    shipped = load_config(ROOT / "configs" / "quickstart.yaml").to_dict()
    assert load_config("quickstart").to_dict() == shipped
    assert load_config("quickstart.yaml").to_dict() == shipped
    (tmp_path / "quickstart.yaml").write_text("run:\n  max_steps: 7\n")
    assert load_config("quickstart.yaml").run.max_steps == 7  # the user's own file
    assert load_config("quickstart").run.max_steps == 7       # named alone too
    with pytest.raises(ConfigError, match=r"not found: 'quickstrt' \(did you mean the bundled "
                                          r"'quickstart'\? bundled examples, named alone: .*"
                                          r"gpt2_small_gpu, quickstart\)"):
        load_config("quickstrt")
    with pytest.raises(ConfigError, match=r"not found: 'sub/quickstart'$"):
        load_config("sub/quickstart")  # a path is a path, never a bundled name


def test_a_wheel_reads_its_own_copy_and_never_a_stray_configs_folder(tmp_path, monkeypatch):
    """In site-packages the folder beside the package is anybody's: only a checkout's counts."""
    wheel = tmp_path / "site-packages" / "speedtronic" / "configs"
    wheel.mkdir(parents=True)
    (wheel / "tiny.yaml").write_text("run:\n  max_steps: 3\n")
    stray = tmp_path / "site-packages" / "configs"
    stray.mkdir()
    (stray / "other.yaml").write_text("run:\n  max_steps: 4\n")
    monkeypatch.setattr(bundled, "_PACKAGE", wheel.parent)
    monkeypatch.setattr(bundled, "_IN_WHEEL", wheel)
    monkeypatch.setattr(bundled, "_CHECKOUT", stray)
    assert bundled.bundled_config_names() == ["tiny"]
    assert bundled.bundled_config("other") is None
    assert load_config("tiny").run.max_steps == 3


def test_setup_copies_the_configs_into_the_built_package(tmp_path):
    env = {**os.environ, "SPEEDTRONIC_CUDA": "0", "SPEEDTRONIC_CPU_KERNELS": "0"}
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib",
                    str(tmp_path / "lib")], cwd=ROOT, env=env, check=True,
                   capture_output=True)
    built = tmp_path / "lib" / "speedtronic"
    assert (built / "config" / "bundled.py").is_file()
    assert sorted(p.name for p in (built / "configs").glob("*.yaml")) == \
        sorted(p.name for p in CONFIGS)
