"""runtime.py: the schedule warnings a user needs before a run wastes its steps."""

from __future__ import annotations

import logging

import pytest
import torch

from speedtronic.config import load_config
from speedtronic.train.runtime import build_scheduler


def _sched(**kw):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return build_scheduler(opt, load_config(kw))


def test_warmup_longer_than_the_run_names_both_numbers(caplog):
    with caplog.at_level(logging.WARNING, logger="speedtronic.schedule"):
        _sched(run={"max_steps": 60}, scheduler={"warmup_steps": 100})
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "warmup_steps=100 > run.max_steps=60" in msg and "ends at 60%" in msg
    assert "at most 60, e.g. 6" in msg


def test_warmup_equal_to_the_run_reaches_the_peak_and_is_not_warned(caplog):
    with caplog.at_level(logging.WARNING, logger="speedtronic.schedule"):
        sched = _sched(run={"max_steps": 4}, scheduler={"warmup_steps": 4, "name": "constant"})
    assert not caplog.records
    lrs = []
    for _ in range(4):
        lrs.append(sched.optimizer.param_groups[0]["lr"])
        sched.step()
    assert lrs[-1] == lrs[0] * 4  # the last step runs at the peak


def test_cosine_horizon_shorter_than_the_run_is_said(caplog):
    with caplog.at_level(logging.WARNING, logger="speedtronic.schedule"):
        _sched(run={"max_steps": 500}, scheduler={"name": "cosine", "warmup_steps": 10,
                                                   "max_steps": 300})
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "scheduler.max_steps=300" in msg and "run.max_steps=500" in msg
    assert "last 200 steps" in msg


@pytest.mark.parametrize("kw", [
    {"run": {"max_steps": 500}, "scheduler": {"warmup_steps": 50}},
    {"run": {"max_steps": 500}, "scheduler": {"name": "constant", "warmup_steps": 5,
                                              "max_steps": 100}},
])
def test_sound_schedules_say_nothing(caplog, kw):
    with caplog.at_level(logging.WARNING, logger="speedtronic.schedule"):
        _sched(**kw)
    assert not caplog.records


@pytest.mark.parametrize("setting, device, steps, ooo, expected, fragment", [
    ("auto", "cpu", 5000, False, False, "no CUDA"),
    ("auto", "cuda", 500, False, False, "shorter than the 2000-step threshold"),
    ("auto", "cuda", 5000, False, True, "5000-step CUDA run"),
    ("auto", "cuda", 5000, True, False, "ooo_backprop: true"),
    (True, "cpu", 10, False, True, "compile: true"),
    (False, "cuda", 10_000, False, False, "compile: false"),
])
def test_compile_auto_decides_by_device_length_and_ooo(setting, device, steps, ooo, expected,
                                                       fragment):
    from speedtronic.train.precision import decide_compile

    cfg = load_config({"compile": setting, "run": {"max_steps": steps}, "ooo_backprop": ooo})
    on, why = decide_compile(cfg, torch.device(device))
    assert on is expected and fragment in why


def test_compile_setting_is_strict():
    from speedtronic.config import ConfigError

    assert load_config({}).compile == "auto"
    with pytest.raises(ConfigError, match="compile"):
        load_config({"compile": "yes"})


def test_a_run_that_fails_leaves_no_plot_preload_thread_running(tmp_path, monkeypatch):
    """The matplotlib preload runs on a daemon thread; one still importing C++ extensions when
    the interpreter exits is aborted ("terminate called without an active exception", SIGABRT:
    seen at the end of short torchrun jobs). train_from_config waits for it, also when the run
    raises."""
    import threading

    from _engine_fixtures import FixedData, tiny_config

    from speedtronic.train import plot, runtime

    started, release = threading.Event(), threading.Event()

    def slow_preload() -> None:  # an import still running when the run ends
        started.set()
        release.wait(timeout=60)
        sum(i * i for i in range(2_000_000))  # ~0.1 s of work left after the run raised

    class FailAtFirstStep:
        name = "fail"

        def after_optimizer_step(self, trainer, step: int) -> None:
            assert started.wait(timeout=60)  # the preload is under way
            release.set()  # its last work starts now; only a join makes the caller wait
            raise RuntimeError("planted failure")

    monkeypatch.setattr(plot, "matplotlib_available", lambda: True)
    monkeypatch.setattr(plot, "preload", slow_preload)
    cfg = tiny_config(tmp_path, checkpoint={"enabled": False})
    with pytest.raises(RuntimeError, match="planted failure"):
        runtime.train_from_config(cfg, data=FixedData(), callbacks=[FailAtFirstStep()])
    assert not [t for t in threading.enumerate() if t.name == "speedtronic-plot-preload"]


def test_timing_waits_for_queued_work_on_cuda_and_mps_and_never_on_cpu(monkeypatch):
    """The clock excluded an eval or save only after a CUDA-only sync: MPS queues work too, and
    its training steps were counted as eval time (and compare timed only their dispatch)."""
    from speedtronic.train.precision import synchronize

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("cuda"))
    monkeypatch.setattr(torch.mps, "synchronize", lambda: calls.append("mps"))
    for device in ("cpu", "mps", "cuda:0"):
        synchronize(torch.device(device))
    assert calls == ["mps", "cuda"]


def test_the_trainer_and_compare_sync_the_device_before_excluding_eval_and_save(tmp_path,
                                                                               monkeypatch):
    """Both clocks must wait for queued training work before an eval or a save is excluded
    from them; they called torch.cuda.synchronize only, never MPS's."""
    from _engine_fixtures import tiny_raw

    from speedtronic.compare import recorder
    from speedtronic.config import load_config
    from speedtronic.train import trainer
    from speedtronic.train.runtime import train_from_config

    synced: list[str] = []
    monkeypatch.setattr(trainer, "synchronize", lambda device: synced.append(device.type))
    raw = tiny_raw(tmp_path, "sync", run={"max_steps": 4, "eval_every": 2},
                   checkpoint={"every_steps": 4})
    train_from_config(load_config(raw), plot=False)
    assert synced == ["cpu", "cpu"]  # the eval at step 2, the eval + save at step 4
    monkeypatch.setattr(recorder, "synchronize", lambda device: synced.append(device.type))
    rec = object.__new__(recorder.CompareRecorder)
    rec._device, rec._pending_events = torch.device("mps"), []
    rec.state = {"optimizer_step_s": []}
    rec._pre_step(None, (), {})
    rec._post_step(None, (), {})
    assert synced[2:] == ["mps", "mps"]  # an MPS optimizer step is timed queue to queue
    assert len(rec.state["optimizer_step_s"]) == 1
