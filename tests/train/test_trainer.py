"""Trainer behaviour: every parameter trains, accumulation, schedule, precision, compile
fallback, no per-micro-batch host sync, callbacks, hooks, eval."""

from __future__ import annotations

import json
import logging
import math
import sys

import pytest
import torch
from _engine_fixtures import FixedData, TinyLM, one_thread, tiny_config  # noqa: F401

from speedtronic.train.precision import resolve_precision
from speedtronic.train.runtime import build_scheduler, build_trainer, lr_factor, train_from_config
from speedtronic.train.trainer import TrainerCallback, loss_from_output


def _optimizer_names() -> list[str]:
    return ["adamw", "muon"]


@pytest.mark.parametrize("opt", _optimizer_names())
def test_every_trainable_parameter_changes_after_one_step(tmp_path, opt):
    cfg = tiny_config(tmp_path, optimizer={"name": opt}, run={"max_steps": 1},
                      scheduler={"warmup_steps": 0}, checkpoint={"enabled": False})
    trainer = build_trainer(cfg)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.fit()
    trainer.metrics.close()
    unchanged = [n for n, p in trainer.model.named_parameters()
                 if p.requires_grad and torch.equal(p.detach(), before[n])]
    assert not unchanged, f"{opt}: parameters not updated by one step: {unchanged}"


@pytest.mark.parametrize("out", ["tensor", "dict", "tuple"])
def test_model_output_forms_are_normalized(out):
    model = TinyLM(out=out)
    x, y = FixedData().batches[0]
    loss = loss_from_output(model(x, y))
    assert loss.ndim == 0 and loss.requires_grad


def test_non_scalar_loss_is_a_clear_error():
    from speedtronic.errors import SpeedtronicError

    with pytest.raises(SpeedtronicError, match="scalar"):
        loss_from_output(torch.ones(2, 3))
    with pytest.raises(SpeedtronicError, match="loss"):
        loss_from_output({"logits": torch.ones(2)})


def test_lr_schedule_warmup_cosine_and_constant():
    assert lr_factor(0, 4, 10, "cosine", 0.1) == pytest.approx(0.25)
    assert lr_factor(3, 4, 10, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_factor(4, 4, 10, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_factor(7, 4, 10, "cosine", 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(
        math.pi * 0.5)))
    assert lr_factor(10, 4, 10, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(50, 4, 10, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(9, 4, 10, "constant", 0.1) == 1.0


def test_scheduler_keeps_the_ratio_between_param_groups(tmp_path):
    cfg = tiny_config(tmp_path, scheduler={"warmup_steps": 3})
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([{"params": [a], "lr": 0.02}, {"params": [b], "lr": 3e-4}])
    sched = build_scheduler(opt, cfg)
    for _ in range(5):
        lrs = [g["lr"] for g in opt.param_groups]
        assert lrs[0] / lrs[1] == pytest.approx(0.02 / 3e-4)
        opt.step()
        sched.step()


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    """2 micro-batches of 4 accumulate to the gradient of one batch of 8."""
    data = FixedData(B=8)
    halves = FixedData(B=8)
    halves.batches = [(x[i:i + 4], y[i:i + 4]) for x, y in data.batches for i in (0, 4)]
    halves.train.batches = halves.batches
    results = []
    for micro, target, d in ((8, 8, data), (4, 8, halves)):
        torch.manual_seed(0)
        model = TinyLM()
        cfg = tiny_config(tmp_path, name=f"acc{micro}", run={"max_steps": 3},
                          data={"micro_batch_size": micro, "target_batch_size": target},
                          optimizer={"grad_clip": None}, checkpoint={"enabled": False})
        train_from_config(cfg, model=model, data=d, plot=False)
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)


def _count_host_syncs(monkeypatch, tmp_path, accumulation: int) -> int:
    """Count device->host reads issued by the training loop (the optimizer's CPU step counters
    and the model are not the loop's business): ``item``, ``tolist`` and the Python number and
    truth conversions of a tensor."""
    calls = {"n": 0}
    reals = {name: getattr(torch.Tensor, name)
             for name in ("item", "tolist", "__float__", "__int__", "__bool__")}

    def from_speedtronic() -> bool:
        path = sys._getframe(2).f_code.co_filename.replace("\\", "/")
        return path.endswith(tuple(f"speedtronic/train/{name}.py" for name in
                                   ("trainer", "step", "step_log", "step_boundary",
                                    "trainer_features", "metrics")))

    def counting(name):
        def wrapper(self, *args):
            calls["n"] += from_speedtronic()
            return reals[name](self, *args)
        return wrapper

    cfg = tiny_config(tmp_path, name=f"sync{accumulation}", run={"max_steps": 6, "eval_every": 0},
                      logging={"every_steps": 3}, checkpoint={"enabled": False},
                      data={"micro_batch_size": 4, "target_batch_size": 4 * accumulation})
    trainer = build_trainer(cfg, model=TinyLM(), data=FixedData())
    for name in reals:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    trainer.fit()
    monkeypatch.undo()
    trainer.metrics.close()
    return calls["n"]


def test_no_host_sync_per_micro_batch(monkeypatch, tmp_path):
    one = _count_host_syncs(monkeypatch, tmp_path, 1)
    four = _count_host_syncs(monkeypatch, tmp_path, 4)
    # 2 log steps x one read of (loss, grad norm) + the final eval (eval_every: 0 skips the
    # baseline), whatever the number of micro-batches: one host sync per log interval.
    assert one == four == 3


def test_precision_resolution_on_cpu(caplog):
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu).mode == "fp32"
    assert resolve_precision("bf16", cpu).mode == "bf16"
    with caplog.at_level(logging.WARNING, logger="speedtronic.precision"):
        plan = resolve_precision("fp16", cpu)
    assert plan.mode == "fp32" and not plan.use_scaler
    assert "fp16 requested but unsupported on cpu" in caplog.text


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_bf16_autocast_training_runs_on_cpu(tmp_path, precision, dtype):
    """The forward's matmuls really run in bf16 under precision: bf16 (a run whose autocast
    was a no-op passed when only the step count and a finite loss were checked)."""
    cfg = tiny_config(tmp_path, precision=precision, run={"max_steps": 2},
                      checkpoint={"enabled": False})
    model, seen = TinyLM(), []
    model.hidden.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    result = train_from_config(cfg, model=model, data=FixedData(), plot=False)
    assert result.steps == 2 and math.isfinite(result.final_loss)
    assert seen and set(seen) == {dtype}
    assert model.hidden.weight.dtype == torch.float32  # master weights stay fp32


class _CompileFailure(Exception):
    pass


def test_compile_falls_back_to_eager_on_compiler_error(tmp_path, monkeypatch, caplog):
    from torch._dynamo.exc import TorchDynamoException

    class Boom(TorchDynamoException):
        pass

    def fake_compile(model, **kw):
        def broken(*a, **k):
            raise Boom("backend exploded")
        return broken

    monkeypatch.setattr(torch, "compile", fake_compile)
    cfg = tiny_config(tmp_path, compile=True, run={"max_steps": 2}, checkpoint={"enabled": False})
    with caplog.at_level(logging.INFO, logger="speedtronic"):
        result = train_from_config(cfg, model=TinyLM(), data=FixedData(), plot=False)
    assert result.steps == 2
    assert "torch.compile: off (compiler failed, running eager: Boom: backend exploded)" \
        in caplog.text
    events = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    (off,) = [e for e in events if e["event"] == "compile_off"]  # train_start said true
    assert off["step"] == 0 and off["reason"] == "Boom: backend exploded"


def test_compile_fallback_does_not_hide_model_bugs(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda model, **kw: model)

    class Buggy(TinyLM):
        def forward(self, x, y):
            raise IndexError("bug in the model")

    cfg = tiny_config(tmp_path, compile=True, run={"max_steps": 2, "eval_every": 0},
                      checkpoint={"enabled": False})
    trainer = build_trainer(cfg, model=Buggy(), data=FixedData())
    trainer._eval_cache = []  # skip the baseline eval so the training forward raises first
    with pytest.raises(IndexError, match="bug in the model"):
        trainer.fit()
    trainer.metrics.close()


def test_gradient_checkpointing_uses_the_model_hook(tmp_path):
    model = TinyLM()
    cfg = tiny_config(tmp_path, gradient_checkpointing=True, checkpoint={"enabled": False})
    build_trainer(cfg, model=model, data=FixedData()).metrics.close()
    assert model.checkpointing


def test_reference_model_gradient_checkpointing_trains(tmp_path):
    cfg = tiny_config(tmp_path, gradient_checkpointing=True, run={"max_steps": 2},
                      checkpoint={"enabled": False})
    assert train_from_config(cfg, plot=False).steps == 2


class Recorder(TrainerCallback):
    name = "recorder"

    def __init__(self):
        self.events: list = []
        self.restored = None

    def on_train_start(self, trainer):
        self.events.append(("start", trainer.step))

    def after_optimizer_step(self, trainer, step):
        self.events.append(("step", step))

    def on_train_end(self, trainer):
        self.events.append(("end", trainer.step))

    def state_dict(self):
        return {"seen": len(self.events)}

    def load_state_dict(self, state):
        self.restored = state


def test_callbacks_hooks_and_metrics_file(tmp_path):
    from speedtronic.train.metrics import read_metrics

    events = []
    cb = Recorder()
    cfg = tiny_config(tmp_path, run={"max_steps": 4, "eval_every": 2})
    result = train_from_config(cfg, model=TinyLM(), data=FixedData(), callbacks=[cb],
                               hooks=[lambda e, p: events.append((e, p.get("step")))],
                               plot=False)
    assert cb.events == [("start", 0), ("step", 1), ("step", 2), ("step", 3), ("step", 4),
                         ("end", 4)]
    names = [e for e, _ in events]
    assert names[0] == "train_start" and names[-1] == "train_end"
    assert [s for e, s in events if e == "eval"] == [0, 2, 4]
    assert [s for e, s in events if e == "train_step"] == [2, 4]
    assert [s for e, s in events if e == "checkpoint"] == [3, 4]
    recs = [r for r in read_metrics(result.metrics_path) if r["event"] == "train_step"]
    for key in ("loss", "lr", "grad_norm", "tokens_per_sec", "samples_per_sec", "memory_bytes"):
        assert all(r[key] is not None for r in recs), key
    # eval_every: 0 evaluates only after the last step (no baseline, as the key's doc says).
    only_end = []
    cfg0 = tiny_config(tmp_path, name="only-end", run={"max_steps": 3, "eval_every": 0})
    train_from_config(cfg0, model=TinyLM(), data=FixedData(), plot=False,
                      hooks=[lambda e, p: only_end.append((e, p.get("step")))])
    assert [s for e, s in only_end if e == "eval"] == [3]
    # The callback state travels through the checkpoint.
    cb2 = Recorder()
    cfg2 = tiny_config(tmp_path, run={"max_steps": 5, "eval_every": 2})
    train_from_config(cfg2, model=TinyLM(), data=FixedData(), callbacks=[cb2], resume=True,
                      plot=False)
    assert cb2.restored == {"seen": 5}


def test_eval_uses_the_same_held_out_batches(tmp_path):
    cfg = tiny_config(tmp_path, checkpoint={"enabled": False})
    trainer = build_trainer(cfg)
    assert trainer.evaluate() == trainer.evaluate()
    trainer.metrics.close()


def test_weights_replaced_at_train_end_are_evaluated_and_checkpointed(tmp_path):
    """DiLoCo's final sync installs the last global in on_train_end, after the loop's last eval
    and checkpoint: the trainer evaluates and checkpoints those weights too."""
    from speedtronic.train.checkpoint import CheckpointManager
    from speedtronic.train.runtime import build_trainer

    class InstallAtEnd:
        name = "install"

        def on_train_end(self, trainer):
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.mul_(0.5)
            trainer.weights_replaced("a test global")

    cfg = tiny_config(tmp_path, name="replaced", run={"max_steps": 3, "eval_every": 0},
                      checkpoint={"enabled": True, "every_steps": 100})
    trainer = build_trainer(cfg, model=TinyLM(), data=FixedData(), callbacks=[InstallAtEnd()])
    result = trainer.fit()
    trainer.metrics.close()
    final = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with torch.no_grad():
        batches = FixedData().eval_batches(cfg.run.eval_batches)
        expected = sum(float(loss_from_output(trainer.model(x, y))) for x, y in batches)
    assert result.final_eval_loss == pytest.approx(expected / len(batches))
    manager = CheckpointManager(cfg.run_dir / cfg.checkpoint.directory, keep_last=None)
    state, _ = manager.load_latest()
    for k, v in final.items():
        assert torch.equal(state["model"][k], v), k
    events = [json.loads(line)["event"] for line in
              (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert events[-3:] == ["eval", "checkpoint", "train_end"]


def test_evaluation_and_checkpoint_time_is_not_charged_to_step_timing(tmp_path, monkeypatch):
    """An eval or checkpoint between two log steps leaves ms/step and tokens/s of the training
    steps alone (a fake clock: every read advances 1 ms, an eval or a save 1000 s)."""
    from types import SimpleNamespace

    import speedtronic.train.trainer as trainer_module
    from speedtronic.train.metrics import read_metrics

    clock = [0.0]

    def fake_perf_counter() -> float:
        clock[0] += 1e-3
        return clock[0]

    # The trainer's own clock only (its module global), not time.perf_counter everywhere.
    monkeypatch.setattr(trainer_module, "time", SimpleNamespace(perf_counter=fake_perf_counter))
    cfg = tiny_config(tmp_path, run={"max_steps": 6, "eval_every": 2},
                      logging={"every_steps": 2}, checkpoint={"every_steps": 3})
    trainer = build_trainer(cfg, model=TinyLM(), data=FixedData())
    for name in ("evaluate", "save_checkpoint"):
        original = getattr(trainer, name)

        def slow(*args, _original=original, **kwargs):
            clock[0] += 1000.0
            return _original(*args, **kwargs)

        monkeypatch.setattr(trainer, name, slow)
    trainer.fit()
    trainer.metrics.close()
    recs = [r for r in read_metrics(trainer.metrics.path) if r["event"] == "train_step"]
    assert [r["step"] for r in recs] == [2, 4, 6]
    assert [r["step"] for r in read_metrics(trainer.metrics.path)
            if r["event"] == "checkpoint"] == [3, 6]
    # Intervals 3-4 and 5-6 follow an eval (step 2, 4) and a checkpoint (step 3).
    assert all(r["step_ms"] < 1000.0 for r in recs), [r["step_ms"] for r in recs]


def test_the_log_reads_wait_for_queued_device_work_is_charged_to_its_interval(tmp_path,
                                                                              monkeypatch):
    """On CUDA the host runs ahead of the GPU until the log step's one read: the time that read
    waits is the interval's queued work and belongs in its ms/step and tokens/s (it fell
    between two intervals: rows read several times faster than the steps ran). A fake clock:
    the read stands in for 100 s of queued GPU work."""
    import sys
    from types import SimpleNamespace

    import speedtronic.train.trainer as trainer_module
    from speedtronic.train.metrics import read_metrics

    clock = [0.0]

    def fake_perf_counter() -> float:
        clock[0] += 1e-3
        return clock[0]

    real_tolist = torch.Tensor.tolist

    def waiting_tolist(self):
        if sys._getframe(1).f_code.co_name == "_log_record":
            clock[0] += 100.0
        return real_tolist(self)

    monkeypatch.setattr(trainer_module, "time", SimpleNamespace(perf_counter=fake_perf_counter))
    monkeypatch.setattr(torch.Tensor, "tolist", waiting_tolist)
    cfg = tiny_config(tmp_path, run={"max_steps": 4, "eval_every": 0},
                      logging={"every_steps": 2}, checkpoint={"enabled": False})
    trainer = build_trainer(cfg, model=TinyLM(), data=FixedData())
    trainer.fit()
    trainer.metrics.close()
    recs = [r for r in read_metrics(trainer.metrics.path) if r["event"] == "train_step"]
    assert [r["step"] for r in recs] == [2, 4]
    assert all(r["step_ms"] > 100_000.0 / 2 for r in recs), [r["step_ms"] for r in recs]


@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_step_dispatches_no_per_parameter_norm_and_no_division_by_one(tmp_path, clip):
    """The log step's gradient norm without clipping was one norm op per parameter (110 on
    GPT-2 small: ~110 CUDA launches), and at one micro-batch per step the loss was divided by
    1 (a div forward and one backward per step)."""
    from speedtronic.kernels.counting import DispatchCounter

    cfg = tiny_config(tmp_path, run={"max_steps": 3, "eval_every": 0},
                      logging={"every_steps": 1}, checkpoint={"enabled": False},
                      optimizer={"grad_clip": clip})
    model = TinyLM()
    assert len(list(model.parameters())) > 3
    trainer = build_trainer(cfg, model=model, data=FixedData())
    try:
        with DispatchCounter() as counter:
            trainer.fit()
    finally:
        trainer.release_run_lock()
    assert counter.by_name["linalg_vector_norm"] == 3  # one total norm per (log) step
    assert counter.by_name["div"] == 0


class _Batches:
    """Fixed (x, y) micro-batches, in order (resumable like the real data)."""

    def __init__(self, batches: list) -> None:
        self.train = _FixedCycle(batches)

    def eval_batches(self, n: int) -> list:
        return self.train.batches[:n]


class _FixedCycle:
    def __init__(self, batches: list) -> None:
        self.batches, self.pos = batches, 0

    def __iter__(self):
        return self

    def __next__(self):
        b = self.batches[self.pos % len(self.batches)]
        self.pos += 1
        return b

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


@pytest.mark.parametrize("clip", [None, 0.05, 100.0])
def test_accumulation_with_padding_equals_one_big_batch(tmp_path, clip):
    # 4 micro-batches of 2 x 8 with 16, 9, 3 and 12 counted tokens (-100 = padding): the
    # accumulated step must be the token mean of all 40, like one batch of 8. With clipping the
    # token factor rides on the clip's multiply (clip_scaled_grad_norm_): 0.05 clips, 100 not.
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 32, (8, 8), generator=g)
    y = torch.randint(0, 32, (8, 8), generator=g)
    for row, keep in zip(range(8), (8, 8, 5, 4, 3, 0, 6, 6), strict=True):
        y[row, keep:] = -100
    runs = {}
    for name, micro in (("accumulated", 2), ("one_batch", 8)):
        cfg = tiny_config(tmp_path, name=name, run={"max_steps": 1, "eval_every": 0},
                          optimizer={"grad_clip": clip}, checkpoint={"enabled": False},
                          logging={"every_steps": 1},
                          data={"micro_batch_size": micro, "target_batch_size": 8})
        torch.manual_seed(0)
        model = TinyLM()
        batches = [(x[i:i + micro], y[i:i + micro]) for i in range(0, 8, micro)]
        trainer = build_trainer(cfg, model=model, data=_Batches(batches))
        result = trainer.fit()
        trainer.metrics.close()
        rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
        (norm,) = [r["grad_norm"] for r in rows if r.get("event") == "train_step"]
        runs[name] = ({k: v.detach().clone() for k, v in model.state_dict().items()},
                      result.final_loss, norm)
    (acc, acc_loss, acc_norm), (one, one_loss, one_norm) = runs["accumulated"], runs["one_batch"]
    assert abs(acc_loss - one_loss) < 1e-5  # the logged loss is the token mean too
    assert acc_norm == pytest.approx(one_norm, rel=1e-5)  # the norm of the weighted gradients
    if clip == 0.05:
        assert one_norm > 4 * clip  # the clip acted
    for k in one:
        assert torch.allclose(acc[k], one[k], atol=1e-6, rtol=0), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_the_token_factor_folded_into_the_clip_is_torchs_clip_of_the_weighted_grads(max_norm,
                                                                                     dtype):
    from speedtronic.kernels.counting import DispatchCounter
    from speedtronic.train.step import clip_scaled_grad_norm_

    g = torch.Generator().manual_seed(0)
    shapes = [(16, 8), (8,), (4, 4, 3)]
    grads = [torch.randn(s, generator=g, dtype=dtype) for s in shapes]  # fp64 crashed once
    ours = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
    ref = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
    for p, q, gr in zip(ours, ref, grads, strict=True):
        p.grad, q.grad = gr.clone(), gr.clone()
    factor = 1.6
    with DispatchCounter() as folded:
        norm = clip_scaled_grad_norm_(ours, max_norm, factor)
    with DispatchCounter() as plain:
        torch._foreach_mul_([q.grad for q in ref], factor)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    assert float(norm) == pytest.approx(float(ref_norm), rel=1e-6)
    for p, q in zip(ours, ref, strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    # one multi-tensor multiply, not two, and no host read
    assert folded.by_name["_foreach_mul_"] == plain.by_name["_foreach_mul_"] - 1 == 1
    assert folded.host_syncs == 0


def test_the_lr_column_is_the_lr_the_step_used(tmp_path):
    seen = []
    cfg = tiny_config(tmp_path, name="lr", run={"max_steps": 6, "eval_every": 0},
                      logging={"every_steps": 1}, checkpoint={"enabled": False},
                      scheduler={"warmup_steps": 3, "name": "cosine", "min_lr_ratio": 0.2})
    trainer = build_trainer(cfg, model=TinyLM(), data=FixedData())
    trainer.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append(opt.param_groups[0]["lr"]))
    result = trainer.fit()
    trainer.metrics.close()
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    logged = [r["lr"] for r in rows if r.get("event") == "train_step"]
    assert logged == pytest.approx(seen) and len(seen) == 6
    assert logged[0] == pytest.approx(cfg.optimizer.lr / 3)  # the first warmup step's lr


def test_an_off_shape_check_is_one_decision_line(tmp_path, caplog):
    cfg = tiny_config(tmp_path, name="shape",
                      run={"max_steps": 1, "eval_every": 0, "device": "cpu"},
                      shape_validation={"enabled": True}, checkpoint={"enabled": False})
    trainer = build_trainer(cfg, model=TinyLM(), data=FixedData())
    with caplog.at_level(logging.INFO, logger="speedtronic"):
        trainer.fit()
    trainer.metrics.close()
    lines = [r.getMessage() for r in caplog.records if "shape check" in r.getMessage()]
    assert lines == ["shape check: off (cpu: not applicable (shape_validation.warn_on_cpu: true "
                     "previews it))"]
    assert all(r.levelno == logging.INFO for r in caplog.records if "shape" in r.getMessage())


class _ReusedBuffer:
    """Yields the same (x, y) tensors each time, refilled in place (a common loader trick)."""

    def __init__(self, batches: list) -> None:
        self.batches, self.pos = batches, 0
        self.x, self.y = batches[0][0].clone(), batches[0][1].clone()

    def __iter__(self):
        return self

    def __next__(self):
        x, y = self.batches[self.pos % len(self.batches)]
        self.pos += 1
        self.x.copy_(x)
        self.y.copy_(y)
        return self.x, self.y

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


def test_accumulation_uses_each_micro_batch_before_fetching_the_next(tmp_path):
    # A loader that refills one buffer must train like one that yields fresh tensors.
    data = FixedData()
    results = []
    for train in (_FixedCycle(data.batches), _ReusedBuffer(data.batches)):
        cfg = tiny_config(tmp_path, name=f"buf{len(results)}",
                          run={"max_steps": 2, "eval_every": 0}, checkpoint={"enabled": False},
                          data={"micro_batch_size": 4, "target_batch_size": 16})
        torch.manual_seed(0)
        model = TinyLM()
        bundle = _Batches(data.batches)
        bundle.train = train
        trainer = build_trainer(cfg, model=model, data=bundle)
        trainer.fit()
        trainer.metrics.close()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_labels_that_are_not_host_ids_train_unweighted(tmp_path):
    class SoftLM(TinyLM):
        def forward(self, x, y):  # y: float targets, as a distillation loss might take
            return ((self.head(self.emb(x)).softmax(-1) - y) ** 2).mean()

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 32, (2, 8), generator=g),
                torch.rand(2, 8, 32, generator=g).to(torch.bfloat16).float()) for _ in range(4)]
    cfg = tiny_config(tmp_path, name="soft", run={"max_steps": 1, "eval_every": 0},
                      checkpoint={"enabled": False},
                      data={"micro_batch_size": 2, "target_batch_size": 8})
    trainer = build_trainer(cfg, model=SoftLM(), data=_Batches(batches))
    assert trainer.fit().steps == 1
    trainer.metrics.close()


def test_a_step_of_only_padding_updates_nothing_and_logs_no_loss(tmp_path):
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, 32, (8, 8), generator=g)
    y = torch.randint(0, 32, (8, 8), generator=g)
    padded = y.clone().fill_(-100)
    # step 1: both micro-batches all padding; step 2: real labels
    batches = [(x[:4], padded[:4]), (x[4:], padded[4:]), (x[:4], y[:4]), (x[4:], y[4:])]
    cfg = tiny_config(tmp_path, name="pad", run={"max_steps": 2, "eval_every": 0},
                      logging={"every_steps": 1}, checkpoint={"enabled": False},
                      data={"micro_batch_size": 4, "target_batch_size": 8})
    torch.manual_seed(0)
    model = TinyLM()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = build_trainer(cfg, model=model, data=_Batches(batches))
    trainer.scaler = torch.amp.GradScaler("cpu")  # the fp16 path: it needs gradients to step
    updates = []
    trainer.optimizer.register_step_post_hook(lambda opt, a, kw: updates.append(trainer.step))
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = trainer.fit()
    trainer.metrics.close()
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if r.get("event") == "train_step"}
    assert str(losses[1]).lower() == "nan" and math.isfinite(losses[2])  # JSON has no NaN
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert updates == [1]  # only the second step updated the weights
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_an_all_padding_batch_without_accumulation_is_skipped_not_a_nan(tmp_path):
    """Labels were counted only when accumulating: at one micro-batch per step an all-padding
    batch reached the loss as NaN and stopped the run (train.on_nonfinite: stop)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 32, (3, 4, 8), generator=g)
    y = torch.randint(0, 32, (3, 4, 8), generator=g)
    y[1] = -100
    batches = [(x[i], y[i]) for i in range(3)]
    cfg = tiny_config(tmp_path, name="pad1", run={"max_steps": 3, "eval_every": 0},
                      logging={"every_steps": 1}, checkpoint={"enabled": False},
                      data={"micro_batch_size": 4, "target_batch_size": 4},
                      train={"on_nonfinite": "stop"})
    trainer = build_trainer(cfg, model=TinyLM(), data=_Batches(batches))
    updates, counted = [], []
    trainer.optimizer.register_step_post_hook(lambda opt, a, kw: updates.append(trainer.step))
    from speedtronic.train.mfu import MfuMeter

    original = MfuMeter.count
    MfuMeter.count = lambda self, batch: (counted.append(batch), original(self, batch))[1]
    try:
        result = trainer.fit()
    finally:
        MfuMeter.count = original
    trainer.metrics.close()
    assert result.steps == 3 and updates == [0, 2] and trainer.skipped_steps == 0
    assert [b.data_ptr() for b in counted] == [x[0].data_ptr(), x[2].data_ptr()]
    # tokens count every batch read (as under torchrun, where every rank runs them all); the
    # model FLOPs only the ones that ran (tests/train/test_mfu.py)
    assert result.tokens == 3 * 4 * 8 and trainer.samples == 3 * 4


def test_a_failed_build_leaves_no_log_handler(tmp_path):
    from speedtronic.errors import SpeedtronicError

    root = logging.getLogger("speedtronic")
    before = list(root.handlers)
    for _ in range(2):
        cfg = tiny_config(tmp_path, name="fail", logging={"file": str(tmp_path / "run.log")},
                          model={"name": "no_such_model"})
        with pytest.raises((SpeedtronicError, ValueError)):
            build_trainer(cfg)
    assert root.handlers == before


def test_a_failed_build_keeps_another_runs_log_file(tmp_path):
    # A built trainer's log file keeps logging when another build fails in the same process.
    cfg = tiny_config(tmp_path, name="ok", run={"max_steps": 2, "eval_every": 0},
                      logging={"file": str(tmp_path / "ok.log")}, checkpoint={"enabled": False})
    trainer = build_trainer(cfg, model=TinyLM(), data=FixedData())
    bad = tiny_config(tmp_path, name="bad", model={"name": "no_such_model"},
                      logging={"file": str(tmp_path / "bad.log")})
    with pytest.raises(Exception):  # noqa: B017 - any build error
        build_trainer(bad)
    trainer.fit()
    trainer.metrics.close()
    for h in trainer.log_handlers:
        logging.getLogger("speedtronic").removeHandler(h)
        h.close()
    assert "step 2/2" in (tmp_path / "ok.log").read_text()


def test_step_weights_make_an_accumulated_step_a_mean_over_its_tokens():
    """The weights times each micro-batch's mean, scaled by the factor, equal the token mean."""
    from speedtronic.train.accumulation import StepWeights, counted_tokens

    labels = [torch.tensor([[1, 2, -100, -100]]), torch.tensor([[3, -100, -100, -100]]),
              torch.tensor([[4, 5, 6, 7]])]
    counts = [counted_tokens(y) for y in labels]
    assert counts == [2, 1, 4]
    token_losses = [torch.tensor([1.0, 3.0]), torch.tensor([5.0]), torch.tensor([2.0, 2, 4, 4])]
    weights = StepWeights(3)
    # what backward sees: mean loss * rel / k per micro-batch, then the factor on the sum
    summed = sum(loss.mean() * weights.weight(n) / 3
                 for loss, n in zip(token_losses, counts, strict=True))
    assert weights.gradient_factor() * summed == pytest.approx(torch.cat(token_losses).mean())
    equal = StepWeights(2)
    assert [equal.weight(5), equal.weight(5)] == [1.0, 1.0] and equal.gradient_factor() == 1.0
    assert counted_tokens(torch.zeros(2, 3)) is None  # float targets are not ids: plain mean


def test_a_failing_final_eval_keeps_the_final_checkpoint(tmp_path, monkeypatch):
    """A step that needs both saves first: the eval that raises cannot cost the checkpoint."""
    from speedtronic.train.checkpoint import CheckpointManager
    from speedtronic.train.trainer import Trainer

    real = Trainer.evaluate

    def flaky(self):
        if self.step == 6:
            raise RuntimeError("eval blew up")
        return real(self)

    monkeypatch.setattr(Trainer, "evaluate", flaky)
    cfg = tiny_config(tmp_path)
    with pytest.raises(RuntimeError, match="eval blew up"):
        train_from_config(cfg, model=TinyLM(), data=FixedData(), plot=False)
    steps = [step for step, _ in CheckpointManager(tmp_path / "t" / "checkpoints").list()]
    assert steps and steps[0] == 6, steps


def test_callbacks_keep_their_own_checkpoint_state(tmp_path):
    """TrainerCallback's default name was the key of every subclass that kept it: two of them
    shared "callback" in the checkpoint and on resume one got the other's state."""
    from speedtronic.errors import SpeedtronicError
    from speedtronic.train import TrainerCallback

    class A(TrainerCallback):
        def state_dict(self):
            return {"who": "A"}

        def load_state_dict(self, state):
            self.loaded = state

    class B(A):
        def state_dict(self):
            return {"who": "B"}

    cfg = tiny_config(tmp_path, name="cb", run={"max_steps": 2, "eval_every": 0})
    trainer = build_trainer(cfg, model=TinyLM(), data=FixedData(), callbacks=[A(), B()])
    trainer.fit()
    trainer.release_run_lock()
    trainer.metrics.close()
    state = torch.load(trainer.checkpoints.list()[0][1], weights_only=True)
    assert state["callbacks"] == {"A": {"who": "A"}, "B": {"who": "B"}}
    a, b = A(), B()
    again = build_trainer(cfg, model=TinyLM(), data=FixedData(), callbacks=[a, b], resume=True)
    again.release_run_lock()
    again.metrics.close()
    assert (a.loaded, b.loaded) == ({"who": "A"}, {"who": "B"})
    twin = B()
    twin.name = "A"  # a chosen name that collides: refused, not overwritten
    with pytest.raises(SpeedtronicError, match="both save their state under 'A'"):
        build_trainer(tiny_config(tmp_path, name="cb2"), model=TinyLM(), data=FixedData(),
                      callbacks=[A(), twin])
    fine = build_trainer(tiny_config(tmp_path, name="cb2"), model=TinyLM(), data=FixedData())
    fine.release_run_lock()  # the refused build left no lock behind
    fine.metrics.close()


def test_a_hook_that_cannot_close_neither_fails_the_run_nor_keeps_it_locked(tmp_path, caplog):
    """A hook whose close() raised (wandb.finish, a full disk) ended a finished run with that
    error, skipped the plot and left the run directory locked for the process's lifetime."""
    from speedtronic.train.runtime import train_from_config

    class Sink:
        def __call__(self, event, payload):
            pass

        def close(self):
            raise RuntimeError("close boom")

    cfg = tiny_config(tmp_path, name="hookclose", run={"max_steps": 2, "eval_every": 0},
                      checkpoint={"enabled": False})
    with caplog.at_level(logging.WARNING, logger="speedtronic.metrics"):
        result = train_from_config(cfg, model=TinyLM(), data=FixedData(), hooks=[Sink()],
                                   plot=False)
    assert result.steps == 2 and "close boom" in caplog.text
    again = build_trainer(cfg, model=TinyLM(), data=FixedData())  # not "in use by pid ..."
    again.release_run_lock()
    again.metrics.close()



def test_eval_is_a_mean_over_label_tokens_and_an_all_padding_batch_counts_for_nothing(tmp_path):
    """Eval averaged each batch's mean loss: an all-padding eval batch (a NaN mean) made every
    eval_loss of the run NaN, and a half-padded batch weighed as much as a full one."""
    data = FixedData(n=4)
    x0, y0 = data.batches[0]
    half = y0.clone()
    half[:, 4:] = -100
    data.batches[1] = (data.batches[1][0], half)
    data.batches[2] = (data.batches[2][0], torch.full_like(y0, -100))
    cfg = tiny_config(tmp_path, name="evalpad", run={"max_steps": 1, "eval_every": 1,
                                                      "eval_batches": 3},
                      checkpoint={"enabled": False})
    trainer = build_trainer(cfg, model=TinyLM(), data=data)
    value = trainer.evaluate()
    trainer.release_run_lock()
    trainer.metrics.close()
    xs = torch.cat([x for x, _ in data.batches[:3]])
    ys = torch.cat([y for _, y in data.batches[:3]])
    trainer.model.eval()
    with torch.no_grad():  # one mean over every label token of the three batches
        expected = trainer.model(xs, ys).item()
    assert math.isfinite(value) and value == pytest.approx(expected, rel=1e-5)


def test_the_first_compiled_step_is_kept_out_of_step_timing(tmp_path, monkeypatch):
    """A 17 s compile read as 17353 ms/step and a wrong eta on the first log line; the first
    compiled forward + backward is now left out of the interval as evals and saves are (a
    fake clock: every read advances 1 ms, the first compiled micro-step 1000 s)."""
    from types import SimpleNamespace

    import speedtronic.train.step as step_module
    import speedtronic.train.trainer as trainer_module
    from speedtronic.train.metrics import read_metrics

    clock = [0.0]

    def fake_perf_counter() -> float:
        clock[0] += 1e-3
        return clock[0]

    for module in (trainer_module, step_module):
        monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=fake_perf_counter))
    cfg = tiny_config(tmp_path, run={"max_steps": 4, "eval_every": 0},
                      logging={"every_steps": 2}, checkpoint={"enabled": False})
    trainer = build_trainer(cfg, model=TinyLM(), data=FixedData())
    trainer._compile_pending = True  # as after compile: true (the model itself stays eager)
    original = trainer._micro_step

    def compiling(*args, **kwargs):
        if not trainer._compile_pending and not getattr(compiling, "done", False):
            compiling.done = True
            clock[0] += 1000.0  # the compile
        return original(*args, **kwargs)

    monkeypatch.setattr(trainer, "_micro_step", compiling)
    trainer.fit()
    trainer.metrics.close()
    recs = [r for r in read_metrics(trainer.metrics.path) if r["event"] == "train_step"]
    assert [r["step"] for r in recs] == [2, 4]
    assert all(r["step_ms"] < 1000.0 for r in recs), [r["step_ms"] for r in recs]


@pytest.mark.parametrize("compiled", [True, False])
def test_the_compile_step_time_is_totalled_for_readers(tmp_path, monkeypatch, compiled):
    """trainer.compile_seconds: the first compiled micro-step's time (compare keeps it out of
    its training time), 0 for an eager run."""
    monkeypatch.setattr(torch, "compile", lambda model, **kw: model)
    cfg = tiny_config(tmp_path, compile=compiled, run={"max_steps": 3, "eval_every": 0},
                      checkpoint={"enabled": False})
    trainer = build_trainer(cfg, model=TinyLM(), data=FixedData())
    trainer.fit()
    trainer.metrics.close()
    assert (trainer.compile_seconds > 0) == compiled
