"""The ``speedtronic`` command: bad configs exit 2 with one line naming the key, train/validate/
env/plot work, torch is not imported for validate, README command 2 is what CI runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _engine_fixtures import one_thread, tiny_raw  # noqa: F401

from speedtronic.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _write(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


BAD_CONFIGS = {
    # case: (file contents, a substring the one-line message must contain)
    "unknown_key": ({"optimizer": {"lrr": 0.1}}, "optimizer.lrr"),
    "unknown_section": ({"optimiser": {"lr": 0.1}}, "optimiser"),
    "wrong_type": ({"checkpoint": {"enabled": "false"}}, "checkpoint.enabled"),
    "wrong_type_number": ({"run": {"max_steps": "ten"}}, "run.max_steps"),
    "out_of_range": ({"optimizer": {"lr": -1.0}}, "optimizer.lr"),
    "out_of_range_batch": ({"data": {"micro_batch_size": 4, "target_batch_size": 6}},
                           "data.target_batch_size"),
    "conflicting_shorthands": ({"name": "a", "run": {"name": "b"}}, "run.name"),
    "conflicting_sources": ({"data": {"synthetic": True, "text_path": __file__}}, "data"),
    "missing_text_file": ({"data": {"text_path": "/nonexistent/corpus.txt"}}, "data.text_path"),
}


@pytest.mark.parametrize("command", ["train", "validate"])
@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_exits_2_with_one_line_naming_the_key(tmp_path, capsys, case, command):
    raw, needle = BAD_CONFIGS[case]
    cfg = _write(tmp_path / "bad.yaml", raw)
    assert main([command, "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("speedtronic: error: ") and needle in err[0], err[0]


def test_missing_config_file(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope.yaml" in err and "not found" in err


def test_malformed_yaml_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  name: x\n  max_steps: [1, 2\n")
    assert main(["validate", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.yaml" in err and re.search(r"line \d+", err)


def test_bad_set_override_names_the_key(tmp_path, capsys):
    cfg = _write(tmp_path / "ok.yaml", {})
    assert main(["validate", "--config", str(cfg), "--set", "scheduler.warmup=3"]) == 2
    assert "scheduler.warmup" in capsys.readouterr().err


def test_process_exit_code_and_no_traceback_then_debug_shows_it(tmp_path):
    cfg = _write(tmp_path / "bad.yaml", {"optimizer": {"lrr": 0.1}})
    cmd = [sys.executable, "-m", "speedtronic", "validate", "--config", str(cfg)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "speedtronic: error: unknown config key 'optimizer.lrr'; did you mean 'optimizer.lr'?"]
    debug = subprocess.run([sys.executable, "-m", "speedtronic", "--debug", *cmd[3:]],
                           capture_output=True, text=True, timeout=120)
    assert debug.returncode != 0 and "Traceback" in debug.stderr
    # --debug after the subcommand works too (it used to be "unrecognized arguments").
    after = subprocess.run([*cmd, "--debug"], capture_output=True, text=True, timeout=120)
    assert after.returncode != 0 and "Traceback" in after.stderr


@pytest.mark.parametrize("data", ["bundled", "token_file"])
def test_importing_the_cli_and_validate_do_not_import_torch(tmp_path, data):
    """validate runs train's checks (model, sizes, data files) without torch."""
    raw: dict = {"optimizer": "muon"}
    if data == "token_file":
        import numpy as np

        np.arange(1000, dtype=np.uint16).tofile(tmp_path / "t.bin")
        raw.update(data={"tokens_path": str(tmp_path / "t.bin")}, model={"vocab_size": 1000})
    cfg = _write(tmp_path / "ok.yaml", raw)
    code = ("import sys; from speedtronic.cli import main; rc = main(['validate', '--config', "
            f"{str(cfg)!r}]); sys.stdout.flush(); print('TORCH', 'torch' in sys.modules); "
            "sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("TORCH False")


def test_validate_prints_resolved_redacted_config(tmp_path, capsys):
    cfg = _write(tmp_path / "ok.yaml", {"distributed": {"store": "hf://user:tok123@org/repo"}})
    assert main(["validate", "--config", str(cfg), "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["data"]["block_size"] == out["model"]["max_seq_len"]
    assert "tok123" not in json.dumps(out)


def test_validate_json_is_strict_json_that_reads_back(tmp_path, capsys):
    # distributed.start_timeout: .inf means "no limit"; JSON has no Infinity token.
    cfg = _write(tmp_path / "inf.yaml", {"distributed": {"start_timeout": float("inf")}})
    assert main(["validate", "--config", str(cfg), "--format", "json"]) == 0
    text = capsys.readouterr().out
    out = json.loads(text, parse_constant=lambda name: pytest.fail(f"non-JSON token {name}"))
    assert out["distributed"]["start_timeout"] == float("inf")
    again = tmp_path / "again.json"
    again.write_text(text)
    assert main(["validate", "--config", str(again)]) == 0
    assert "start_timeout: .inf" in capsys.readouterr().out


def test_train_end_to_end_leaves_metrics_config_and_plot(tmp_path, capsys):
    cfg = _write(tmp_path / "tiny.yaml", tiny_raw(tmp_path / "ignored", name="cli"))
    out_dir = tmp_path / "runs"
    rc = main(["train", "--config", str(cfg), "--max-steps", "4", "--output-dir", str(out_dir),
               "--device", "cpu", "--set", "optimizer.lr=1e-3"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "done: steps=4" in out
    assert "host malloc: " in out  # the allocator decision is logged (train.host_memory)
    run = out_dir / "cli"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["run"]["max_steps"] == 4 and saved["optimizer"]["lr"] == 1e-3
    assert saved["run"]["output_dir"] == str(out_dir)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    events = [json.loads(line)["event"] for line in lines]
    assert events[0] == "train_start" and "train_step" in events and events[-1] == "train_end"
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A resumed run continues to a larger target; a second fresh run moves the old one aside.
    assert main(["train", "--config", str(cfg), "--max-steps", "6", "--output-dir", str(out_dir),
                 "--resume"]) == 0
    assert "done: steps=6" in capsys.readouterr().out
    assert main(["train", "--config", str(cfg), "--max-steps", "2", "--output-dir",
                 str(out_dir)]) == 0
    assert len(list(out_dir.glob("cli.old-*"))) == 1


def test_unavailable_device_is_a_user_error(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    cfg = _write(tmp_path / "tiny.yaml", tiny_raw(tmp_path))
    assert main(["train", "--config", str(cfg), "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_env_json_is_json_alone_in_a_fresh_process():
    # A fresh process loads the kernels while collecting, and their loader logs a line.
    import subprocess

    out = subprocess.run([sys.executable, "-m", "speedtronic", "env", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "kernels" in json.loads(out.stdout)


def test_a_reader_that_goes_away_ends_the_cli_quietly(tmp_path):
    import subprocess

    cfg = _write(tmp_path / "ok.yaml", {"run": {"name": "x"}})
    code = ("import sys; from speedtronic.cli import main; "
            f"sys.exit(main(['validate', '--config', {str(cfg)!r}]))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # like `| head` exiting before the config is printed
    err = proc.stderr.read().decode()
    assert proc.wait() == 141 and "Traceback" not in err and "error" not in err


def test_train_carries_on_quietly_when_its_console_reader_goes_away(tmp_path):
    import subprocess

    cfg = _write(tmp_path / "run.yaml", tiny_raw(tmp_path / "runs", name="piped",
                                                 run={"max_steps": 3, "eval_every": 0}))
    code = ("import sys; from speedtronic.cli import main; "
            f"sys.exit(main(['train', '--config', {str(cfg)!r}]))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    proc.stdout.close()  # `speedtronic train ... | head -0`
    err = proc.stderr.read().decode()
    proc.wait(timeout=300)
    assert "Logging error" not in err and "Traceback" not in err
    rows = (tmp_path / "runs" / "piped" / "metrics.jsonl").read_text()
    assert '"train_end"' in rows  # the run finished and recorded everything


def test_env_and_plot_commands(tmp_path, capsys):
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"torch", "python", "cuda_available", "torch_threads"} <= info.keys()
    assert main(["plot", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err



def test_env_text_keeps_its_colons_in_one_column(capsys):
    """Keys longer than 16 characters (kernels.built_with_torch) once pushed their colon out."""
    assert main(["env"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if " : " in ln]
    assert len(lines) > 10
    assert len({ln.index(" : ") for ln in lines}) == 1
    assert any(ln.startswith("kernels.built_with_torch ") for ln in lines)


def _readme_command_2() -> str:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S)
    return blocks[1].strip()


def test_ci_runs_readme_command_2_exactly():
    """.ci/run extracts command 2 from the README at run time; check the extraction agrees."""
    proc = subprocess.run(["bash", str(ROOT / ".ci" / "run"), "--print-command-2"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == _readme_command_2()
    assert "\n" not in _readme_command_2(), "command 2 must be a single line"


def test_console_script_imports_user_modules_from_the_working_directory(tmp_path):
    """`data.dataset: mymodule:make` works from the console script as with `python -m`."""
    script = Path(sys.executable).parent / "speedtronic"
    if not script.is_file():
        pytest.skip("no speedtronic console script next to this interpreter")
    (tmp_path / "my_tokens_ds.py").write_text(
        "import torch\n\ndef make(cfg):\n"
        "    return [torch.randint(0, 256, (33,)) for _ in range(32)]\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"run: {{name: cwd, output_dir: {tmp_path / 'runs'}, max_steps: 1, eval_every: 0, "
        "eval_batches: 1, device: cpu}\n"
        "model: {n_layer: 1, d_model: 32, n_head: 2, max_seq_len: 32}\n"
        "data: {dataset: 'my_tokens_ds:make', micro_batch_size: 2}\n"
        "checkpoint: {enabled: false}\n")
    out = subprocess.run([str(script), "train", "--config", str(cfg)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "done: steps=1" in out.stdout
    missing = cfg.read_text().replace("my_tokens_ds:make", "not_a_module_here:make")
    cfg.write_text(missing)
    bad = subprocess.run([str(script), "train", "--config", str(cfg)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "working directory, or on PYTHONPATH" in bad.stderr


@pytest.mark.usefixtures("one_thread")
def test_an_unwritable_checkpoint_folder_stops_the_run_before_its_first_step(tmp_path, capsys):
    # a file where the checkpoint folder's parent should be
    raw = tiny_raw(tmp_path / "out", checkpoint={"every_steps": 3,
                                                "directory": "blocker/ckpt"})
    cfg = _write(tmp_path / "run.yaml", raw)
    (tmp_path / "out" / "t").mkdir(parents=True)
    (tmp_path / "out" / "t" / "blocker").write_text("a file")
    assert main(["train", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not writable" in err[0] and "blocker" in err[0], err
    metrics = tmp_path / "out" / "t" / "metrics.jsonl"
    assert not metrics.exists() or '"train_step"' not in metrics.read_text()
    # a checkpoint folder under one of the run's own files is a config error
    raw["checkpoint"]["directory"] = "config.yaml/ckpt"
    assert main(["train", "--config", str(_write(tmp_path / "run2.yaml", raw))]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.directory: must not be inside config.yaml" in err


def test_env_lists_the_optional_packages_by_installed_version():
    from importlib import metadata

    from speedtronic.cli.env import collect_env

    info = collect_env()
    for dist in ("tokenizers", "datasets", "transformers", "huggingface_hub", "s3fs"):
        try:
            expected = metadata.version(dist)
        except metadata.PackageNotFoundError:
            expected = None
        assert info[dist] == expected


def test_env_has_the_kernel_loader_decide_before_it_reports():
    """env imported the loader alone, which then had decided nothing where an extension is
    built: its kernels line said "not loaded yet" and every optional kernel family read
    unavailable. The ops module is what makes the loader decide (a fresh process: in this one
    the ops are imported already)."""
    code = ("import sys; from speedtronic.cli.env import _kernel_status; _kernel_status(); "
            "print('speedtronic.kernels.ops' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr[-2000:]
