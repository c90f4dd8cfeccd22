"""``validate`` runs every check ``train`` makes before touching a device (it once returned 0
for configs ``train`` refused at once), and still imports no torch."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import yaml

from speedtronic.cli import main

BASE = {"run": {"name": "v", "max_steps": 2}, "model": {"d_model": 32, "n_layer": 1,
                                                        "n_head": 2, "max_seq_len": 32}}


def _cfg(tmp_path: Path, **sections) -> Path:
    raw = {k: dict(v) for k, v in BASE.items()}
    raw["run"]["output_dir"] = str(tmp_path / "runs")
    for sec, values in sections.items():
        if isinstance(values, dict):
            raw.setdefault(sec, {}).update(values)
        else:  # a root key
            raw[sec] = values
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize(("sections", "message"), [
    ({"data": {"tokens_path": "/no/such/tokens.bin"}}, "data.tokens_path: no such file"),
    ({"model": {"name": "no_such_model"}}, "model.name: unknown model 'no_such_model'"),
    ({"model": {"name": "no_such_pkg_xyz.mod:make"}}, "cannot import module 'no_such_pkg_xyz.mod'"),
    ({"model": {"n_layer": 10_000, "d_model": 1024, "n_head": 16}}, "parameters need at least"),
    ({"model": {"d_model": 4_000_000, "n_head": 1, "n_kv_head": 1}}, "beyond any single-machine"),
    ({"run": {"seed": 2**64}}, "run.seed: must fit in 64 bits"),
    *([({"logging": {"tensorboard": True}}, "logging.tensorboard: true needs TensorBoard")]
      if importlib.util.find_spec("tensorboard") is None else []),
    ({"data": {"tokenizer": "/no/such/tokenizer.json", "text_path": "/no/such/texts"}},
     "data.tokenizer: file not found"),
    # the default data, the stdlib's source: validate said "ok" without building its split
    ({"data": {"stdlib_max_bytes": 2000}}, "stdlib corpus too small to split"),
    # combinations FSDP2 cannot run: refused only at torchrun start-up before
    ({"data_parallel": {"fsdp": True, "zero1": True}},
     "data_parallel.fsdp: true with data_parallel.zero1: true"),
    ({"data_parallel": {"fsdp": True}, "ooo_backprop": True},
     "data_parallel.fsdp: true with ooo_backprop: true"),
    # validate said ok to each of these; train refused them at once
    ({"model": {"init_from": "/no/such/run"}}, "model.init_from: '/no/such/run' does not exist"),
    ({"model": {"name": "hf", "hf_config": "/no/such/folder"}},
     "model.hf_config: '/no/such/folder' has no config.json"),
    ({"data": {"dataset": "no_such_pkg_xyz:make"}},
     "data.dataset: cannot import "),
    *[({"distributed": {"enabled": True, "store": url}}, "distributed.store: ")
      for url in ("s3://", "s3:///", "hf://", "hf://a/b/c/d", "file://", "file://relative/path",
                  "s3://[bad/p", "hf://user/repo?revision=x")],
    ({"optimizer": {"name": "muon", "muon_ns_steps": 100}},
     "optimizer.muon_ns_steps: must be in [1, 100)"),
])
def test_validate_refuses_what_train_refuses(tmp_path, capsys, sections, message):
    cfg = _cfg(tmp_path, **sections)
    assert main(["validate", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    # train refuses the same config with the same line, before it writes anything
    assert main(["train", "--config", str(cfg)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "runs" / "v").exists()


def test_validate_checks_token_ids_against_the_vocabulary(tmp_path, capsys):
    tokens = tmp_path / "t.bin"
    np.full(1000, 300, np.uint16).tofile(tokens)
    cfg = _cfg(tmp_path, data={"tokens_path": str(tokens)}, model={"vocab_size": 256})
    assert main(["validate", "--config", str(cfg)]) == 2
    assert "model.vocab_size: 256 is too small" in capsys.readouterr().err


def test_validate_reports_its_checks_on_stderr_and_the_config_alone_on_stdout(tmp_path,
                                                                           capsys):
    assert main(["validate", "--config", str(_cfg(tmp_path))]) == 0
    captured = capsys.readouterr()
    assert yaml.safe_load(captured.out)["run"]["name"] == "v"
    assert "ok: model reference_transformer: about" in captured.err
    assert "ok: run directory:" in captured.err


def test_validate_refuses_a_run_directory_a_live_run_holds(tmp_path, capsys):
    """train refuses it first thing; validate said "writable" and exit 0."""
    from speedtronic.train.run_lock import RunLock

    cfg = _cfg(tmp_path)
    with RunLock(tmp_path / "runs" / "v"):
        assert main(["validate", "--config", str(cfg)]) == 2
        assert f"is in use by pid {os.getpid()}" in capsys.readouterr().err
    assert main(["validate", "--config", str(cfg)]) == 0  # released: fine again


def test_a_warning_during_validate_goes_to_stderr_and_the_json_on_stdout_parses(tmp_path, capsys):
    """A warning (uint32 ids in a uint16 file) once led validate --format json's stdout."""
    import json

    tokens = tmp_path / "tok32.bin"
    np.arange(1000, dtype=np.int32).tofile(tokens)
    cfg = _cfg(tmp_path, data={"tokens_path": str(tokens)}, model={"vocab_size": 70_000})
    assert main(["validate", "--config", str(cfg), "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["data"]["tokens_path"] == str(tokens)
    assert "looks like uint32" in err and "looks like uint32" not in out


def test_validate_refuses_training_files_that_are_all_eval_files(tmp_path, capsys):
    """The rule lived in build_data only: validate passed a config train then refused."""
    val = tmp_path / "val.bin"
    np.arange(600, dtype=np.uint16).tofile(val)
    cfg = _cfg(tmp_path, data={"tokens_path": str(val), "eval_tokens_path": str(val)},
               model={"vocab_size": 1000})
    for command in ("validate", "train"):
        assert main([command, "--config", str(cfg)]) == 2
        err = capsys.readouterr().err
        assert "every file it names is also in data.eval_tokens_path" in err, err


def test_an_existing_run_directory_that_is_not_writable_is_named_as_such(tmp_path, monkeypatch):
    """It was reported as one that "cannot be created". (Root writes anywhere, so the
    permission answer is stubbed.)"""
    import speedtronic.train.preflight as preflight
    from speedtronic.config import ConfigError

    run = tmp_path / "runs" / "v"
    run.mkdir(parents=True)
    monkeypatch.setattr(preflight.os, "access", lambda path, mode: Path(path) != run)
    with pytest.raises(ConfigError, match=f"run directory {run} is not writable"):
        preflight.check_run_dir(run)
    with pytest.raises(ConfigError, match=f"cannot be created: {run} is not writable"):
        preflight.check_run_dir(run / "sub")


def test_a_resumed_config_does_not_need_its_init_from_weights(tmp_path, capsys):
    """init_from only starts a fresh run; a resume loads its checkpoint instead."""
    cfg = _cfg(tmp_path, model={"init_from": "/no/such/run"}, checkpoint={"resume": True})
    assert main(["validate", "--config", str(cfg)]) == 0


def test_a_device_this_machine_lacks_is_refused_as_train_refuses_it(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    # validate returned 0 for a cuda config on a CPU machine; train refused it at once
    assert main(["validate", "--config", str(_cfg(tmp_path, run={"device": "cuda"}))]) == 2
    assert "device 'cuda' requested but CUDA is not available" in capsys.readouterr().err


def test_json_output_by_bundled_name_is_json_alone(tmp_path, capsys, monkeypatch):
    import json

    monkeypatch.chdir(tmp_path)  # no quickstart.yaml here: the bundled one is read
    assert main(["validate", "--config", "quickstart", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["name"] == "quickstart"
