"""Metrics fan-out: metrics.jsonl, console line, hooks that fail, optional adapters, plots."""

from __future__ import annotations

import importlib.util
import json
import logging

import pytest

from speedtronic.errors import SpeedtronicError
from speedtronic.train.metrics import MetricsLogger, TensorBoardHook, format_step_line, read_metrics
from speedtronic.train.plot import plot_runs

RECORD = {"step": 10, "loss": 2.5, "lr": 3e-4, "grad_norm": 0.75, "tokens_per_sec": 12345.0,
          "samples_per_sec": 96.4, "step_ms": 41.0, "memory_bytes": 3 * 2**29}


def test_step_line_has_every_metric():
    line = format_step_line(RECORD, 100)
    assert line == ("step 10/100 | loss 2.5000 | lr 3.00e-04 | gnorm 0.750 | 12.3k tok/s | "
                    "96.4 samples/s | 41 ms/step | mem 1.50 GiB | eta 4s")
    # the time left at this ms/step, and the group the lr is read from
    assert format_step_line({**RECORD, "step_ms": 2000.0, "lr_group": "muon"}, 2000).endswith(
        "ms/step | mem 1.50 GiB | eta 1h06m")
    assert "lr 3.00e-04 (muon)" in format_step_line({**RECORD, "lr_group": "muon"}, 100)
    assert "eta" not in format_step_line(RECORD, 10)  # the last step: nothing left


def test_jsonl_records_hooks_and_torn_last_line(tmp_path):
    seen = []
    m = MetricsLogger(tmp_path / "metrics.jsonl", max_steps=100,
                      hooks=[lambda e, p: seen.append(e)], progress_bar=False)
    m.emit("train_step", RECORD)
    m.emit("eval", {"step": 10, "eval_loss": float("nan")})
    m.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"event": "train_st')  # a crash mid-line
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["event"] for r in recs] == ["train_step", "eval"]
    assert recs[0]["loss"] == 2.5 and recs[1]["eval_loss"] == "nan"
    assert seen == ["train_step", "eval"]


def test_failing_hook_is_reported_once_and_training_goes_on(tmp_path, caplog):
    def broken(event, payload):
        raise RuntimeError("sink down")

    m = MetricsLogger(tmp_path / "m.jsonl", max_steps=5, hooks=[broken], progress_bar=False)
    with caplog.at_level(logging.WARNING, logger="speedtronic.metrics"):
        for _ in range(3):
            m.emit("train_step", RECORD)
    m.close()
    assert caplog.text.count("sink down") == 1
    assert len(read_metrics(tmp_path / "m.jsonl")) == 3


def test_progress_bar_only_when_asked(tmp_path, capsys, caplog):
    # lines follow logging's level with a bar too: INFO here, not whatever a test before left
    caplog.set_level(logging.INFO, logger="speedtronic.metrics")
    m = MetricsLogger(tmp_path / "m.jsonl", max_steps=4, progress_bar=True)
    m.line("hello")
    m.advance(2, {"loss": "1.0"})
    m.close()
    out = capsys.readouterr().out
    assert "hello" in out and "2/4" in out
    MetricsLogger(tmp_path / "n.jsonl", max_steps=4, progress_bar=None).close()  # not a TTY
    assert "/4" not in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None,
                    reason="tensorboard is installed")
def test_missing_tensorboard_is_a_clear_error(tmp_path):
    with pytest.raises(SpeedtronicError, match=r"speedtronic\[tensorboard\]"):
        TensorBoardHook(tmp_path)


def _fake_run(path, losses, evals):
    path.mkdir()
    with open(path / "metrics.jsonl", "w") as f:
        for i, loss in enumerate(losses, 1):
            f.write(json.dumps({"event": "train_step", "step": i, "loss": loss}) + "\n")
        for step, loss in evals:
            f.write(json.dumps({"event": "eval", "step": step, "eval_loss": loss}) + "\n")


def test_plot_compares_runs_in_one_png(tmp_path):
    pytest.importorskip("matplotlib")
    _fake_run(tmp_path / "a", [3.0, 2.5, 2.0], [(0, 3.2), (3, 2.1)])
    _fake_run(tmp_path / "b", [3.0, 2.8, 2.6], [(3, 2.7)])
    out = plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "cmp.png")
    assert out.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 10_000
    with pytest.raises(SpeedtronicError, match="no metrics.jsonl"):
        plot_runs([tmp_path / "missing"])


def test_resumed_logger_starts_a_fresh_line_after_a_torn_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    torn = b'{"event": "train_step", "step": 1, "loss": 3.0}\n{"event": "train_st'
    path.write_bytes(torn)
    m = MetricsLogger(path, max_steps=10, progress_bar=False)
    assert path.read_bytes() == torn  # building a logger writes nothing
    m.emit("train_step", {"step": 2, "loss": 2.5})
    m.emit("train_step", {"step": 3, "loss": 2.0})
    m.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    # the torn half record is gone, so later reads have nothing to report as damaged
    assert b"train_st\n" not in path.read_bytes() and len(path.read_bytes().splitlines()) == 3
    whole = tmp_path / "whole.jsonl"  # a file that ends cleanly gets no blank line
    whole.write_bytes(b'{"event": "eval", "step": 1}\n')
    m = MetricsLogger(whole, max_steps=10, progress_bar=False)
    m.emit("eval", {"step": 2})
    m.close()
    assert whole.read_bytes().count(b"\n") == 2 and b"\n\n" not in whole.read_bytes()


def test_read_metrics_skips_and_flags_lines_that_are_not_json_objects(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"event": "train_step", "step": 1, "loss": 3.0}\n[1, 2]\n"text"\n'
                     b'\xff\xfe\n{"event": "train_step", "step": 2, "loss": 2.5}\n'
                     b'{"event": "eval", "name": "\xc3')  # torn inside a 2-byte character
    with caplog.at_level(logging.WARNING, logger="speedtronic.metrics"):
        records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"{path}: skipped 3 damaged line(s)")
    assert "line 2: a JSON list" in warning and "line 3: a JSON str" in warning
    assert "line 4: not UTF-8" in warning and "line 6" not in warning  # torn tail: expected


def test_a_torn_last_line_alone_is_skipped_quietly(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"event": "eval", "step": 1}\n{"event": "ev')
    with caplog.at_level(logging.WARNING, logger="speedtronic.metrics"):
        assert read_metrics(path) == [{"event": "eval", "step": 1}]
    assert not caplog.records


def test_a_whole_last_record_without_its_newline_is_kept(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"event": "train_step", "step": 1, "loss": 3.0}\n'
                     b'{"event": "train_step", "step": 2, "loss": 2.0}')
    m = MetricsLogger(path, max_steps=10, progress_bar=False)
    m.emit("train_step", {"step": 3, "loss": 1.0})
    m.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]


def test_heartbeat_prints_when_nothing_was_printed_for_a_while():
    """A long first step or eval looked like a hang: 4 minutes of silence on a 2-core CPU."""
    import threading
    import time as _time
    from types import SimpleNamespace

    from speedtronic.train.metrics import Heartbeat

    said: list[str] = []
    printed = threading.Event()

    def line(text: str) -> None:
        said.append(text)
        fake.last_line = _time.monotonic()
        printed.set()

    fake = SimpleNamespace(last_line=_time.monotonic() - 100.0, doing="step 1/300", line=line)
    with Heartbeat(fake, every=0.2):
        assert printed.wait(timeout=30)
    assert said and said[0].startswith("... step 1/300: still running")
    with Heartbeat(fake, every=0) as off:  # logging.heartbeat_seconds: 0
        assert off._thread is None


def test_a_full_disk_under_metrics_jsonl_is_one_line_naming_the_file(tmp_path, monkeypatch,
                                                                      capsys):
    """The CLI said only "[Errno 28] No space left on device": not which file or folder."""
    import errno

    import yaml
    from _engine_fixtures import tiny_raw

    from speedtronic.cli import main

    class Full:
        """A file on a disk that fills after its first line."""

        def __init__(self, f):
            self.f, self.lines = f, 0

        def write(self, text: str) -> int:
            self.lines += 1
            if self.lines > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(text)

        def __getattr__(self, name):
            return getattr(self.f, name)

    original = MetricsLogger._open
    monkeypatch.setattr(MetricsLogger, "_open", lambda self: Full(original(self)))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_raw(tmp_path, "full", run={"max_steps": 4})))
    assert main(["train", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl" in err and "ENOSPC" in err and "Traceback" not in err
