"""Out-of-order backprop: bitwise gradient parity on the CPU queue, fallbacks, cleanup."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from _ooo_fixtures import _FixedLMData, _force_cpu_queue, _lm_batches
from torch import nn

from speedtronic.config import load_config
from speedtronic.models import build_model
from speedtronic.ooo.scheduler import OOOScheduler, build_ooo_scheduler, find_deferrable_linears

OOO_LOGGER = "speedtronic.ooo"


class TiedLM(nn.Module):
    """Reference-like LM *without* stage names, so the tied lm_head is deferred too."""

    def __init__(self, vocab: int = 37, d: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.up_proj = nn.Linear(d, 2 * d)
        self.down_proj = nn.Linear(2 * d, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)  # (B, T, d)
        h = h + self.o_proj(torch.tanh(self.q_proj(h)))
        h = h + self.down_proj(F.gelu(self.up_proj(h)))
        return F.cross_entropy(self.lm_head(h).flatten(0, 1), y.flatten())


class Branchy(nn.Module):
    """Independent branches (with biases, 2-D and 4-D inputs) joined at the end."""

    def __init__(self, d: int = 20) -> None:
        super().__init__()
        self.branches = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, d)) for _ in range(3))
        self.head4d = nn.Linear(d, 6)
        self.skip = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = sum(b(x) for b in self.branches) + self.skip(x)  # (N, d)
        four = self.head4d(h.view(2, -1, 1, h.shape[-1]))  # (2, N/2, 1, 6)
        return F.mse_loss(four.flatten(), y) + h.pow(2).mean()


def _tiny_reference(**model: object) -> nn.Module:
    cfg = load_config({"model": {"vocab_size": 61, "d_model": 32, "n_head": 4, "n_kv_head": 2,
                                 "n_layer": 2, "max_seq_len": 16, **model}})
    torch.manual_seed(0)
    return build_model(cfg.model)


def _branchy_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 20, generator=g), torch.randn(48, generator=g)) for _ in range(n)]


def _pair(model: nn.Module) -> tuple[nn.Module, nn.Module, OOOScheduler]:
    ooo_model = copy.deepcopy(model)
    return model, ooo_model, OOOScheduler(ooo_model, "cpu")


def _assert_grads_equal(a: nn.Module, b: nn.Module) -> None:
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert (pa.grad is None) == (pb.grad is None), name
        if pa.grad is not None:
            assert pa.grad.dtype == pb.grad.dtype, name
            assert torch.equal(pa.grad, pb.grad), (name, (pa.grad - pb.grad).abs().max())


def _run(model: nn.Module, batches: list, sched: OOOScheduler | None = None) -> None:
    for x, y in batches:  # gradient accumulation: no zero_grad between micro-batches
        model(x, y).backward()
    if sched is not None:
        sched.flush()


@pytest.mark.parametrize("make, batches", [
    (lambda: _tiny_reference(), lambda: _lm_batches(3, 61)),
    (lambda: _tiny_reference(tie_weights=False), lambda: _lm_batches(2, 61)),
    (lambda: TiedLM(), lambda: _lm_batches(3, 37)),
    (lambda: Branchy(), lambda: _branchy_batches(3)),
], ids=["reference", "reference-untied", "tied-lm-head", "branchy"])
def test_grads_bitwise_equal_with_accumulation(make, batches) -> None:
    torch.manual_seed(0)
    ref, ooo, sched = _pair(make())
    data = batches()
    _run(ref, data)
    _run(ooo, data, sched)
    _assert_grads_equal(ref, ooo)
    assert sched.deferred_total > 0


def test_tied_lm_head_is_deferred_and_accumulates_into_shared_grad() -> None:
    ref, ooo, sched = _pair(TiedLM())
    names = [n for n, _ in find_deferrable_linears(ooo)]
    assert "lm_head" in names and ooo.lm_head.weight is ooo.embed.weight
    data = _lm_batches(2, 37)
    _run(ref, data)
    _run(ooo, data, sched)
    assert ooo.embed.weight.grad is ooo.lm_head.weight.grad
    assert torch.equal(ref.embed.weight.grad, ooo.embed.weight.grad)


def test_reference_model_uses_its_stage_names() -> None:
    model = _tiny_reference()
    names = [n for n, _ in find_deferrable_linears(model)]
    assert len(names) == 2 * 7 and all(n.startswith("blocks.") for n in names)
    assert "lm_head" not in names  # outside the model's declared stages


def test_training_steps_with_clipping_and_zeroed_grads_match() -> None:
    ref, ooo, sched = _pair(_tiny_reference())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ooo)]
    for step, batch in enumerate(_lm_batches(6, 61)):
        for model, opt, s in ((ref, opts[0], None), (ooo, opts[1], sched)):
            model(*batch).backward()
            if s is not None:
                s.flush()
            if step % 2 == 1:  # two micro-batches per optimizer step
                norm = nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                model._last_norm = norm
                opt.step()
                opt.zero_grad(set_to_none=step % 4 == 1)  # both set_to_none modes
        if step % 2 == 1:
            assert torch.equal(ref._last_norm, ooo._last_norm)
    for pa, pb in zip(ref.parameters(), ooo.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_gradient_checkpointing_and_autocast_parity() -> None:
    model = _tiny_reference()
    model.set_gradient_checkpointing(True)
    ref, ooo, sched = _pair(model)
    data = _lm_batches(2, 61)
    for m in (ref, ooo):
        for x, y in data:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = m(x, y)
            loss.backward()
    sched.flush()
    _assert_grads_equal(ref, ooo)
    assert ooo.blocks[0].attn.q_proj.weight.grad.dtype == torch.float32


def test_autograd_grad_and_backward_inputs_keep_their_semantics() -> None:
    ref, ooo, sched = _pair(TiedLM())
    x, y = _lm_batches(1, 37)[0]
    w_ref, w_ooo = ref.up_proj.weight, ooo.up_proj.weight
    (g_ref,) = torch.autograd.grad(ref(x, y), [w_ref])
    (g_ooo,) = torch.autograd.grad(ooo(x, y), [w_ooo])
    assert torch.equal(g_ref, g_ooo) and w_ooo.grad is None  # returned, not accumulated
    ooo(x, y).backward(inputs=[ooo.down_proj.bias])
    sched.flush()
    assert ooo.down_proj.bias.grad is not None and w_ooo.grad is None


def _penalized_grads(m: nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: bool,
                     mode: str, sched: OOOScheduler | None) -> list[torch.Tensor]:
    """Gradients of ``loss + penalty``: the penalty is on the input gradient (``autograd.grad``
    with create_graph) or on the parameters' ``.grad`` (``backward(create_graph=True)``)."""
    xi = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = m(xi, y)
    if mode == "autograd.grad":
        (gx,) = torch.autograd.grad(loss, [xi], create_graph=True)
        (loss + gx.float().pow(2).sum()).backward()
    else:
        loss.backward(create_graph=True)
        first = [p.grad for p in m.parameters()]
        for p in m.parameters():
            p.grad = None
        sum(g.float().pow(2).sum() for g in first).backward()
    if sched is not None:
        sched.flush()
    grads = [p.grad.detach().clone() for p in m.parameters()]
    for p in m.parameters():
        p.grad = None
    return grads


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("mode", ["autograd.grad", "backward(create_graph=True)"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
def test_gradient_penalty_double_backward_matches_standard(autocast: bool, mode: str) -> None:
    # A create_graph pass through deferred layers returns dW to autograd with its graph (the
    # weight recast under autocast), so a penalty reaches the weights as in the standard backward.
    torch.manual_seed(0)
    ref, ooo, sched = _pair(Branchy())
    x, y = _branchy_batches(1)[0]
    want = _penalized_grads(ref, x, y, autocast, mode, None)
    got = _penalized_grads(ooo, x, y, autocast, mode, sched)
    # bf16: the second-order terms round in another order than autograd's: up to 1.2% of a
    # tensor's largest entry over seeds 0-5; without the weight's recast some are off by more.
    scale = 3e-2 if autocast else 1e-5
    for (name, _), a, b in zip(ref.named_parameters(), want, got, strict=True):
        assert (b - a).abs().max() <= scale * a.abs().max(), (name, (b - a).abs().max())
    # The penalty mattered: plain first-order gradients are not what was compared above.
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ooo(x, y).backward()
    sched.flush()
    assert not torch.allclose(ooo.skip.weight.grad, got[-1], rtol=0.1, atol=1e-3)


def test_create_graph_under_autocast_uses_forward_time_weight_values() -> None:
    # A weight changed in place after the forward: autograd's own cast saved the forward-time
    # values, and so does the deferred layer (its recast only adds the graph).
    ref, ooo, sched = _pair(Branchy())
    x, y = _branchy_batches(1)[0]
    grads = []
    for m in (ref, ooo):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(xi, y)
        with torch.no_grad():
            m.skip.weight.mul_(3.0)
        grads.append(torch.autograd.grad(loss, [xi], create_graph=True)[0])
    sched.flush()
    # bf16 rounding differs by ~1% of the largest entry; the live weight would be off by >100%.
    assert (grads[1] - grads[0]).abs().max() <= 3e-2 * grads[0].abs().max()


def test_torch_func_transforms_run_the_standard_path() -> None:
    ref, ooo, sched = _pair(Branchy())
    x, y = _branchy_batches(1)[0]
    grads = []
    for m in (ref, ooo):
        params = {k: v.detach() for k, v in m.named_parameters()}
        grads.append(torch.func.grad(
            lambda p, m=m: torch.func.functional_call(m, p, (x, y)))(params))
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-6, atol=1e-7, msg=name)
    assert all(p.grad is None for p in ooo.parameters())  # nothing deferred, nothing folded
    sched.flush()


def test_no_grad_forward_uses_standard_path_and_close_restores() -> None:
    model = Branchy()
    sched = OOOScheduler(model, "cpu")
    assert "forward" in model.skip.__dict__
    with torch.no_grad():
        model(*_branchy_batches(1)[0])
    assert not sched._batches
    with sched.paused():
        model(*_branchy_batches(1)[0]).backward()  # standard backward while paused
    assert sched.deferred_total == 0 and model.skip.weight.grad is not None
    sched.close()
    sched.close()  # idempotent
    assert all("forward" not in m.__dict__ for m in model.modules())
    copy.deepcopy(model)  # a plain module again


def test_backward_that_raises_leaves_no_queued_work(caplog) -> None:
    model = Branchy()
    sched = OOOScheduler(model, "cpu")
    x, y = _branchy_batches(1)[0]
    model(x, y).backward()
    sched.flush()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}

    def boom(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in backward")

    h = model.skip(x)
    h.register_hook(boom)  # fires after the head's backward, before skip's
    loss = (model.head4d(h) * 2).sum() + model.branches[0](x).sum()
    with pytest.raises(RuntimeError, match="boom"):
        loss.backward()
    assert sched._batches  # the head's dW was queued when the backward died
    with caplog.at_level(logging.WARNING, logger=OOO_LOGGER):
        sched.flush()
    assert not sched._batches and "discarded deferred gradients" in caplog.text
    for n, p in model.named_parameters():
        if n.startswith("head4d"):
            assert torch.equal(p.grad, before[n]), n  # restored, nothing landed later
    model(x, y).backward()  # the next backward works normally
    sched.flush()
    assert sched.deferred_total > 0


def test_stale_work_is_dropped_at_the_next_forward(caplog) -> None:
    model = Branchy()
    sched = OOOScheduler(model, "cpu")
    x, y = _branchy_batches(1)[0]
    h = model.skip(x)
    h.register_hook(lambda g: (_ for _ in ()).throw(ValueError("late")))
    with pytest.raises(ValueError, match="late"):
        model.head4d(h).sum().backward()
    assert sched._batches and model.head4d.weight.grad is None
    with caplog.at_level(logging.WARNING, logger=OOO_LOGGER):
        model(x, y)  # no flush in between: the next forward drops the stale work
    assert not sched._batches and "discarded" in caplog.text
    assert model.head4d.weight.grad is None


# ----------------------------------------------------------------------------- fallbacks
def _cfg(**root: object):
    return load_config({"ooo_backprop": True, **root})


def _reason(caplog, model: nn.Module, cfg, device: str, **kw: object) -> str:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=OOO_LOGGER):
        assert build_ooo_scheduler(model, cfg, device, **kw) is None
    lines = [r.getMessage() for r in caplog.records if r.name == OOO_LOGGER]
    assert len(lines) == 1, lines  # one line per decision
    assert lines[0].startswith("ooo backprop: off (")
    return lines[0]


def test_fallback_not_requested(caplog) -> None:
    assert "ooo_backprop: false" in _reason(caplog, Branchy(), load_config({}), "cpu")


def test_fallback_no_cuda(caplog, monkeypatch) -> None:
    assert "no CUDA" in _reason(caplog, Branchy(), _cfg(), "cpu")  # CPU needs force_cpu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA" in _reason(caplog, Branchy(), _cfg(), "cuda")


def test_fallback_compile(caplog) -> None:
    msg = _reason(caplog, Branchy(), _cfg(compile=True), "cpu", force_cpu=True)
    assert "compile: true" in msg and "mutually exclusive" in msg


def test_fallback_cuda_graph_capture(caplog, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert "CUDA graph capture" in _reason(caplog, Branchy(), _cfg(), "cuda")


def test_fallback_fewer_than_two_layers(caplog) -> None:
    one = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    frozen = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    frozen[1].weight.requires_grad_(False)
    for model in (one, frozen):
        assert "fewer than two" in _reason(caplog, model, _cfg(), "cpu", force_cpu=True)


def test_fallback_setup_error(caplog, monkeypatch) -> None:
    model = Branchy()
    model.ooo_stage_names = ["branches.0", "nope"]
    msg = _reason(caplog, model, _cfg(), "cpu", force_cpu=True)
    assert "setup error" in msg and "'nope'" in msg
    # A CUDA machine whose stream creation fails (here: no real GPU) -> setup error, no hooks.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    plain = Branchy()
    assert "setup error" in _reason(caplog, plain, _cfg(), "cuda")
    assert all("forward" not in m.__dict__ for m in plain.modules())


def test_forced_cpu_path_logs_on(caplog) -> None:
    with caplog.at_level(logging.INFO, logger=OOO_LOGGER):
        sched = build_ooo_scheduler(Branchy(), _cfg(ooo_streams=3), "cpu", force_cpu=True)
    assert sched is not None and sched.mode == "cpu-queue" and sched.num_layers == 8
    assert "ooo backprop: on (8 nn.Linear layers" in caplog.text
    assert sched.as_dict()["layers"] == 8
    sched.close()


# ----------------------------------------------------------------------------- trainer wiring
@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_trainer_run_with_forced_cpu_queue_matches_standard_run(tmp_path, monkeypatch,
                                                                 one_thread) -> None:
    """End to end: accumulation 2, clipping, AdamW; the trainer flushes and closes the scheduler.
    The config path falls back on CPU, so the builder is patched to force the CPU queue."""
    import json

    from speedtronic.train.runtime import build_trainer

    built = _force_cpu_queue(monkeypatch)
    finals = []
    for on in (False, True):
        cfg = load_config({
            "run": {"name": f"ooo{on}", "output_dir": str(tmp_path), "max_steps": 3,
                    "eval_every": 0, "eval_batches": 1, "seed": 3, "device": "cpu"},
            "model": {"vocab_size": 61, "d_model": 32, "n_head": 4, "n_layer": 2,
                      "max_seq_len": 16},
            "data": {"micro_batch_size": 3, "target_batch_size": 6},
            "optimizer": {"grad_clip": 0.1}, "precision": "fp32",
            "logging": {"progress_bar": False}, "checkpoint": {"enabled": False},
            "ooo_backprop": on, "ooo_trial_pairs": 0})  # deferral on every step, untimed
        data = _FixedLMData(_lm_batches(12, 61))
        trainer = build_trainer(cfg, data=data)
        trainer.fit()
        trainer.metrics.close()
        finals.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
        start = json.loads((cfg.run_dir / "metrics.jsonl").read_text().splitlines()[0])
        assert start["event"] == "train_start" and start["ooo_backprop"] is on
    assert len(built) == 1 and built[0].deferred_total > 0
    assert all("forward" not in m.__dict__ for m in trainer.model.modules())  # closed at end
    assert finals[0].keys() == finals[1].keys()
    for name in finals[0]:
        assert torch.equal(finals[0][name], finals[1][name]), name


def test_grad_scaler_unscales_deferred_grads_like_standard() -> None:
    ref, ooo, sched = _pair(TiedLM())
    params = []
    for model, s in ((ref, None), (ooo, sched)):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in _lm_batches(2, 37):
            scaler.scale(model(x, y)).backward()
        if s is not None:
            s.flush()  # before unscale_: the trainer's order
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        params.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*params, strict=True))


# ----------------------------------------------------------------------------- CUDA path logic
class _FakeStream:
    """Stands in for torch.cuda.Stream on CPU: records the synchronisation calls made on it."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: _FakeStream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: _FakeEvent) -> None:
        self.log.append(("wait_event", self.name, event.stream))


class _FakeEvent:
    def __init__(self) -> None:
        self.stream = None

    def record(self, stream: _FakeStream) -> None:
        self.stream = stream.name


def test_cuda_stream_path_logic_with_fake_streams(monkeypatch) -> None:
    """Runs the CUDA branch (immediate side-stream launch, record_stream, fold after waiting)
    on CPU tensors with recorded fake streams: same gradients, every side stream waited for."""
    import contextlib

    log: list = []
    ambient = _FakeStream("ambient", log)
    side = [_FakeStream(f"side{i}", log) for i in range(2)]
    recorded: list[str] = []
    current = [ambient]

    @contextlib.contextmanager
    def use(stream):
        before, current[0] = current[0], stream
        try:
            yield
        finally:
            current[0] = before

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "stream", use)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, s: recorded.append(s.name), raising=False)
    real_empty_like = torch.empty_like

    def logged_empty_like(*args, **kwargs):
        log.append(("empty_like", current[0].name))
        return real_empty_like(*args, **kwargs)

    ref, ooo, sched = _pair(TiedLM())
    monkeypatch.setattr(torch, "empty_like", logged_empty_like)
    sched.mode, sched.streams = "cuda-streams", side
    for i, layer in enumerate(sched._layers):
        for slot in (layer.weight, layer.bias):
            if slot is not None:
                slot.stream = side[i % 2]
    data = _lm_batches(2, 37)
    _run(ref, data)
    _run(ooo, data, sched)
    _assert_grads_equal(ref, ooo)
    launches = 2 * sched.num_layers  # one per deferred layer per backward
    # Each launch waits for the ambient stream once, and only X and dY are recorded on the side
    # stream (the results come from the ambient pool, so they need no record_stream).
    assert sum(1 for e in log if e[0] == "wait_stream" and e[2] == "ambient") == launches
    assert len(recorded) == 2 * launches and "ambient" not in recorded
    assert not [e for e in log if e[0] == "wait_event"]
    # The result buffers are allocated on the ambient stream, right BEFORE the side stream waits
    # for it (their earlier users are then ordered before the side stream's writes).
    assert {e[1] for e in log if e[0] == "empty_like"} == {"ambient"}
    for i, e in enumerate(log):
        if e[0] == "wait_stream" and e[2] == "ambient":
            assert log[i - 1] == ("empty_like", "ambient"), log[i - 3:i + 1]
    # Each backward's fold makes the ambient stream wait for both side streams it used.
    folds = [e for e in log if e[0] == "wait_stream" and e[1] == "ambient"]
    assert {e[2] for e in folds} == {"side0", "side1"} and len(folds) >= 2 * 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_streams_match_standard_backward() -> None:
    """On a real GPU: config path builds side streams; fp32 grads match, bf16 grads close."""
    torch.manual_seed(0)
    base = _tiny_reference().cuda()
    for autocast in (False, True):
        ref = copy.deepcopy(base)
        ooo = copy.deepcopy(base)
        sched = build_ooo_scheduler(ooo, _cfg(ooo_streams=3), "cuda")
        assert sched is not None and len(sched.streams) == 3
        for m in (ref, ooo):
            for x, y in _lm_batches(3, 61):
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    loss = m(x.cuda(), y.cuda())
                loss.backward()
        sched.flush()
        for (name, pa), (_, pb) in zip(ref.named_parameters(), ooo.named_parameters(),
                                       strict=True):
            tol = 1e-2 if autocast else 1e-6  # another stream may pick another cuBLAS kernel
            torch.testing.assert_close(pb.grad, pa.grad, rtol=tol, atol=tol, msg=name)
        sched.close()
