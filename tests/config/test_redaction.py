"""Secrets never reach disk (config/redaction.py): secret-named keys and URL credentials."""

from __future__ import annotations

import pytest

from speedtronic.config import load_config
from speedtronic.config.redaction import REDACTED, redact


@pytest.mark.parametrize("url, kept", [
    ("s3://AKIAEXAMPLE:abc/def+ghi@bucket/prefix", "@bucket/prefix"),  # AWS secrets hold '/'
    ("s3://AKIAEXAMPLE:plain@bucket/prefix", "@bucket/prefix"),
    ("https://user:p@ss/w@host/x", "@host/x"),  # the userinfo ends at the last '@'
])
def test_url_credentials_are_redacted_even_with_slashes(url, kept):
    out = redact(url)
    assert out == f"{url.split('://')[0]}://{REDACTED}{kept}"
    assert "abc" not in out and "plain" not in out and "p@ss" not in out


@pytest.mark.parametrize("url", ["s3://bucket/prefix", "hf://user/repo", "file:///tmp/store"])
def test_urls_without_credentials_are_unchanged(url):
    assert redact(url) == url


def test_two_urls_in_one_string_are_both_redacted():
    out = redact("from s3://k:s/1@a/p to http://u:p@b/q")
    assert out == f"from s3://{REDACTED}@a/p to http://{REDACTED}@b/q"


def test_secret_named_keys_are_redacted_at_any_depth_but_counts_are_not():
    out = redact({"hf_token": "hf_x", "nested": [{"api_key": "k", "num_tokens": 5}],
                  "password": "", "access_key": None})
    assert out == {"hf_token": REDACTED, "nested": [{"api_key": REDACTED, "num_tokens": 5}],
                   "password": "", "access_key": None}


def test_saved_config_holds_no_credential(tmp_path):
    cfg = load_config({"logging": {"wandb_project": "s3://AKIA:se/cret@bucket/x"}})
    cfg.save(tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    assert "se/cret" not in text and REDACTED in text
    assert cfg.to_dict(redact=False)["logging"]["wandb_project"].endswith("se/cret@bucket/x")


def test_a_secret_with_slashes_and_ats_reaches_no_file_and_no_log_line(tmp_path, caplog):
    """config.yaml, checkpoints and metrics.jsonl of a real run, and every log line."""
    from speedtronic.train.runtime import train_from_config

    secret = "s3cr/et@with/odd+chars"
    cfg = load_config({
        "run": {"name": "s", "output_dir": str(tmp_path), "max_steps": 2, "eval_every": 0,
                "device": "cpu"},
        "model": {"n_layer": 1, "d_model": 32, "n_head": 2, "max_seq_len": 16},
        "data": {"micro_batch_size": 2, "stdlib_max_bytes": 100_000},
        "checkpoint": {"every_steps": 1}, "logging": {"progress_bar": False},
        "distributed": {"store": f"s3://AKIAEXAMPLE:{secret}@bucket/prefix"}})
    with caplog.at_level("DEBUG", logger="speedtronic"):
        train_from_config(cfg, plot=False)
    for path in (tmp_path / "s").rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
            assert b"s3cr/et" not in path.read_bytes(), path
    assert "s3cr/et" not in caplog.text
