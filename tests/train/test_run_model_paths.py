"""A run's relative ``data.tokenizer`` (relative to where ``train`` ran) is found by ``sample``
and ``export`` from any folder: from the run directory, up its own relative levels."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from speedtronic.config import load_config
from speedtronic.train.run_model import _rebase_tokenizer


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "project"
    (root / "tokdir").mkdir(parents=True)
    (root / "tok.json").write_text("{}")
    (root / "tokdir" / "tokenizer.json").write_text("{}")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    return root


def _rebased(run_dir: Path, tokenizer: str, **sections) -> str:
    raw = {"run": {"output_dir": "runs/exp", "name": "t"},
           "data": {"tokenizer": tokenizer, "text_path": "texts"}}
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value)
    cfg = load_config(raw)
    _rebase_tokenizer(run_dir, cfg)
    return cfg.data.tokenizer


@pytest.mark.parametrize("tokenizer", ["tok.json", "tokdir"])  # a file, or a folder holding one
def test_a_relative_tokenizer_is_found_from_another_folder(project, tokenizer):
    assert _rebased(project / "runs" / "exp" / "t", tokenizer) == str(project / tokenizer)


def test_a_symlinked_output_dir_climbs_to_the_folder_it_is_linked_from(project, tmp_path):
    (tmp_path / "big" / "exp" / "t").mkdir(parents=True)
    os.symlink(tmp_path / "big", project / "runs")  # runs/ lives on another disk
    assert _rebased(project / "runs" / "exp" / "t", "tok.json") == str(project / "tok.json")


def test_a_torchft_replica_groups_run_dir_counts_its_extra_level(project):
    run = project / "runs" / "exp" / "t" / "replica_group_0"
    got = _rebased(run, "tok.json", torchft={"mode": "ddp", "replica_group": 0,
                                             "lighthouse": "http://127.0.0.1:29510"})
    assert got == str(project / "tok.json")


def test_what_is_not_found_or_not_relative_is_left_alone(project):
    assert _rebased(project / "runs" / "exp" / "t", "missing.json") == "missing.json"
    assert _rebased(project / "runs" / "exp" / "t", "gpt2") == "gpt2"  # a Hub name
