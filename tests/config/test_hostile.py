"""Hostile configs: alias bombs, deep nesting, huge values and credentials in messages are each
one bounded, masked line (exit 2), never a traceback, a minute of work or a leak."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from speedtronic.cli import main
from speedtronic.config import load_config
from speedtronic.errors import brief, mask_secrets

LAUGHS = "\n".join(
    ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    + [f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]" for p, n in zip("abcdefgh", "bcdefghi",
                                                                   strict=True)]
    + ["run: {name: *i}"])


def test_a_billion_laughs_file_is_refused_in_bounded_time_and_memory(tmp_path):
    """573 bytes of nested aliases once took validate a minute and 2.3 GB, then a MemoryError
    traceback. A real process: peak memory and time are its own."""
    path = tmp_path / "laughs.yaml"
    path.write_text(LAUGHS)
    start = time.perf_counter()
    # VmHWM, the child's own peak: ru_maxrss in a child starts from the parent's peak at the
    # fork (pytest with the CUDA build of torch 2.11 imported: ~0.96 GB, failing the bound)
    child = ("import re, resource, sys\n"
             "from speedtronic.cli import main\n"
             "code = main(sys.argv[1:])\n"
             "try:\n"
             "    with open('/proc/self/status') as f:\n"
             "        print(re.search(r'VmHWM:\\s+(\\d+) kB', f.read()).group(1))\n"
             "except (OSError, AttributeError):  # not Linux\n"
             "    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
             "sys.exit(code)\n")
    proc = subprocess.run([sys.executable, "-c", child, "validate", "--config", str(path)],
                          capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "through YAML aliases" in proc.stderr
    peak_kib = int(proc.stdout.split()[-1])
    assert peak_kib < 1_000_000 and elapsed < 60  # bounds a minute / 2.3 GB cannot meet


def test_ordinary_anchors_and_merge_keys_still_work(tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text("run: {max_steps: &steps 7}\nscheduler: {max_steps: *steps}\n"
                    "logging: {<<: {every_steps: 3}}\n")
    cfg = load_config(path)
    assert (cfg.run.max_steps, cfg.scheduler.max_steps, cfg.logging.every_steps) == (7, 7, 3)


@pytest.mark.parametrize("text", ["run: " + "[" * 5000 + "]" * 5000,
                                  "run: " + "{a: " * 300 + "1" + "}" * 300])
def test_deep_nesting_is_one_line_not_a_recursion_error(tmp_path, capsys, text):
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    assert main(["validate", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "nesting deeper than" in err and "Traceback" not in err and len(err) < 400


def test_deep_nesting_in_a_set_override_too(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run: {name: a}\n")
    assert main(["validate", "--config", str(path), "--set",
                 "data.dataset=" + "[" * 3000 + "]" * 3000]) == 2
    assert "nesting deeper than" in capsys.readouterr().err


def test_a_huge_value_is_echoed_bounded(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run: {name: " + "x" * 1_000_000 + "/y}\n")
    assert main(["validate", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "run.name" in err and len(err) < 500


@pytest.mark.parametrize("override", [
    "data.tokenizer={token: hf_abcdefghijklmnopqrstuvwxyz0123}",
    "data.tokenizer={password: hunter2hunter2}",
    "run.name=s3://AKIAABCDEFGHIJKLMNOP:wJalr/XUtnFEMI@minio/b",
])
def test_credentials_never_reach_the_console(capsys, tmp_path, override):
    path = tmp_path / "c.yaml"
    path.write_text("run: {max_steps: 2}\n")
    assert main(["validate", "--config", str(path), "--set", override]) == 2
    err = capsys.readouterr().err
    for secret in ("hf_abcdefghijklmnopqrstuvwxyz0123", "hunter2hunter2", "wJalr",
                   "AKIAABCDEFGHIJKLMNOP"):
        assert secret not in err
    assert "<redacted>" in err


def test_brief_and_mask_secrets_bound_and_mask():
    nested: list = [1]
    for _ in range(40):
        nested = [nested] * 10
    assert len(brief(nested)) <= 160
    assert mask_secrets("s3://KEY:SECRET@host/x") == "s3://<redacted>@host/x"
    assert mask_secrets("num_tokens: 1000") == "num_tokens: 1000"  # not a credential key
