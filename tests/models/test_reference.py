"""The reference transformer (models/reference.py): shapes, loss, causality, GQA, SDPA, init,
checkpointing, compile (CPU, tiny shapes).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _model_fixtures import batch, tiny

from speedtronic.config import load_config
from speedtronic.models import build_model
from speedtronic.models import reference as ref


def test_forward_shapes_and_backward_reaches_every_parameter():
    torch.manual_seed(0)
    cfg = tiny()
    model = build_model(cfg)
    x, y = batch(cfg)
    logits = model(x)
    assert logits.shape == (3, 12, cfg.vocab_size)
    loss = model(x, y)
    assert loss.shape == () and torch.isfinite(loss)
    # Small init: the first loss is close to uniform guessing.
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.5
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_loss_is_unshifted_mean_cross_entropy_with_ignore_index():
    torch.manual_seed(0)
    cfg = tiny()
    model = build_model(cfg).eval()
    x, y = batch(cfg)
    y[0, :5] = -100
    logits = model(x)
    expected = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1),
                               ignore_index=-100)
    torch.testing.assert_close(model(x, y), expected)
    all_ignored = model(x, torch.full_like(y, -100))
    assert all_ignored.item() == 0.0
    with pytest.raises(ValueError, match="already shifted"):
        model(x, y[:, 1:])


def test_causal_future_tokens_do_not_change_earlier_logits():
    torch.manual_seed(0)
    cfg = tiny()
    model = build_model(cfg).eval()
    x, _ = batch(cfg)
    x2 = x.clone()
    x2[:, 7:] = (x2[:, 7:] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(x), model(x2)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def _naive_attention(attn: ref.Attention, x, cos, sin):
    """Explicit K/V expansion + dense causal softmax, written independently of the module."""
    B, T, _ = x.shape
    H, KV, hd = attn.n_head, attn.n_kv_head, attn.head_dim
    q = ref.apply_rope(attn.q_proj(x).view(B, T, H, hd).transpose(1, 2), cos, sin)
    k = ref.apply_rope(attn.k_proj(x).view(B, T, KV, hd).transpose(1, 2), cos, sin)
    v = attn.v_proj(x).view(B, T, KV, hd).transpose(1, 2)
    k = k.repeat_interleave(H // KV, dim=1)  # (B, H, T, hd)
    v = v.repeat_interleave(H // KV, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    y = scores.softmax(-1) @ v
    return attn.o_proj(y.transpose(1, 2).reshape(B, T, H * hd))


@pytest.mark.parametrize("use_gqa_kernel", [True, False])
def test_gqa_matches_explicit_expand_reference(monkeypatch, use_gqa_kernel):
    if use_gqa_kernel and not ref._SDPA_GQA:
        pytest.skip("this torch has no SDPA enable_gqa")
    monkeypatch.setattr(ref, "_SDPA_GQA", use_gqa_kernel)
    torch.manual_seed(0)
    cfg = tiny(n_head=8, n_kv_head=2, d_model=64)
    attn = ref.Attention(cfg)
    x = torch.randn(2, 10, 64)
    cos, sin = ref.rope_tables(8, 16, cfg.rope_base)
    got = attn(x, *ref._full_tables(cos[:10], sin[:10]))  # the model passes full-width tables
    torch.testing.assert_close(got, _naive_attention(attn, x, cos[:10], sin[:10]),
                               atol=1e-5, rtol=1e-4)


def test_gqa_kernel_choice():
    q = torch.zeros(1, 4, 8, 16)
    assert ref._use_sdpa_gqa(q) is ref._SDPA_GQA  # CPU: the native GQA path when available
    assert ref._use_sdpa_gqa(q.to("meta")) is False  # unknown devices: expand K/V


def test_attention_uses_is_causal_without_a_mask_tensor(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((len(args), kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(ref.F, "scaled_dot_product_attention", spy)
    cfg = tiny()
    model = build_model(cfg)
    x, y = batch(cfg)
    model(x, y)
    assert len(calls) == cfg.n_layer
    for n_args, kwargs in calls:
        assert n_args == 3  # q, k, v: no positional mask
        assert kwargs.get("attn_mask") is None and kwargs["is_causal"] is True


def test_tied_and_untied_weights():
    model = build_model(tiny())
    assert model.lm_head.weight is model.embed.weight
    n_tied = sum(p.numel() for p in model.parameters())
    untied = build_model(tiny(tie_weights=False))
    assert untied.lm_head.weight is not untied.embed.weight
    assert sum(p.numel() for p in untied.parameters()) == n_tied + 61 * 32
    for m in (model.embed, model.lm_head):
        assert m._speedtronic_optimizer_role == "adamw"


def test_gradient_checkpointing_recomputes_each_block_only_when_training(monkeypatch):
    """Identical gradients alone also hold with checkpointing switched off: count the blocks
    that go through torch.utils.checkpoint (one per layer in training, none in eval)."""
    import speedtronic.models.reference as reference

    calls = []
    real = reference.checkpoint
    monkeypatch.setattr(reference, "checkpoint",
                        lambda fn, *a, **kw: calls.append(fn) or real(fn, *a, **kw))
    cfg = tiny()
    model = build_model(cfg)
    x, y = batch(cfg)
    model(x, y).backward()
    assert calls == []
    model.set_gradient_checkpointing(True)
    model(x, y).backward()
    assert calls == list(model.blocks)
    calls.clear()
    model.eval()
    with torch.no_grad():
        model(x, y)
    assert calls == []


def test_gradient_checkpointing_gives_identical_grads():
    cfg = tiny()
    torch.manual_seed(0)
    plain = build_model(cfg)
    torch.manual_seed(0)
    ckpt = build_model(cfg)
    ckpt.set_gradient_checkpointing(True)
    x, y = batch(cfg)
    plain(x, y).backward()
    ckpt(x, y).backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=0, rtol=0, msg=name)
    # The root switch reaches the model through build_model.
    root = load_config({"model": {"vocab_size": 61, "max_seq_len": 16, "n_layer": 1,
                                  "n_head": 4, "d_model": 32}, "gradient_checkpointing": True})
    assert build_model(root).gradient_checkpointing is True


def test_init_scales_residual_projections_and_rope_buffers_are_not_saved():
    torch.manual_seed(0)
    cfg = tiny(n_layer=8, d_model=128, vocab_size=64)
    model = build_model(cfg)
    q_std = model.blocks[0].attn.q_proj.weight.std().item()
    o_std = model.blocks[0].attn.o_proj.weight.std().item()
    assert abs(q_std - 0.02) < 0.002
    assert abs(o_std - 0.02 / math.sqrt(16)) < 0.001
    assert not any("rope" in k for k in model.state_dict())
    assert model.rope_cos.shape == (cfg.max_seq_len, model.head_dim // 2)


def test_rejects_too_long_sequence():
    model = build_model(tiny())
    with pytest.raises(ValueError, match="max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_contract_attributes_for_ooo_and_shapes():
    cfg = tiny()
    model = build_model(cfg)
    assert model.ooo_stage_names == ["blocks.0", "blocks.1"]
    for name in model.ooo_stage_names:
        model.get_submodule(name)
    meta = model.speedtronic_shape_metadata()
    assert meta["head_dim"] == 8 and meta["n_head"] == 4 and meta["n_kv_head"] == 2
    assert meta["vocab_size"] == 61 and meta["seq_len"] == 16
    assert meta["d_ff"] == model.blocks[0].mlp.up_proj.out_features == 128


def test_compiles_without_graph_breaks():
    cfg = tiny()
    model = build_model(cfg)
    x, y = batch(cfg)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(x, y)
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_apply_rope_rotates_each_half_split_pair_by_its_angle():
    """The three-pass form equals the textbook rotation of (x[i], x[i + hd/2]) by pos * freq_i."""
    torch.manual_seed(0)
    hd, T = 8, 6
    x = torch.randn(2, 3, T, hd, dtype=torch.float64)
    cos, sin = ref.rope_tables(hd, T, 10_000.0)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    c, s = cos.double(), sin.double()
    textbook = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    torch.testing.assert_close(ref.apply_rope(x, cos.double(), sin.double()), textbook)
    # A rotation keeps each pair's length (and position 0 is the identity).
    got = ref.apply_rope(x, cos.double(), sin.double())
    torch.testing.assert_close((got[..., :4] ** 2 + got[..., 4:] ** 2), x1 ** 2 + x2 ** 2)
    torch.testing.assert_close(got[:, :, 0], x[:, :, 0])


def test_cpu_rmsnorm_matches_the_composite_definition_and_its_gradients(monkeypatch):
    # The torch-ops path (used when the fused C++ kernels of speedtronic.kernels.cpu are not
    # built or not usable; tests/kernels/test_cpu.py covers those).
    monkeypatch.setattr(ref.cpu_kernels, "usable", lambda *t, **kw: False)
    torch.manual_seed(0)
    norm = ref.RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 16, requires_grad=True)
    y = norm(x)
    assert y.grad_fn is not None and "RMSNormCPU" in type(y.grad_fn).__name__  # the CPU path
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, norm.weight), g)
    x_ref = x.detach().clone().requires_grad_()
    w_ref = norm.weight.detach().clone().requires_grad_()
    y_ref = x_ref * torch.rsqrt(x_ref.pow(2).mean(-1, keepdim=True) + 1e-5) * w_ref
    gx_ref, gw_ref = torch.autograd.grad(y_ref, (x_ref, w_ref), g)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(gx, gx_ref)
    torch.testing.assert_close(gw, gw_ref)
    # float64 checks of the hand-written backward itself, double backward included (gradient
    # penalties), and torch.func's transforms.
    xd = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    wd = torch.randn(6, dtype=torch.float64, requires_grad=True)

    def fn(a, b):
        return ref._RMSNormCPU.apply(a, b, 1e-5)[0]

    assert torch.autograd.gradcheck(fn, (xd, wd))
    assert torch.autograd.gradgradcheck(fn, (xd, wd))
    composite = lambda a: a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-5) * wd  # noqa: E731
    torch.testing.assert_close(torch.func.grad(lambda a: fn(a, wd).sin().sum())(xd.detach()),
                               torch.func.grad(lambda a: composite(a).sin().sum())(xd.detach()))
    torch.testing.assert_close(torch.func.vmap(lambda a: fn(a, wd))(xd.detach()),
                               composite(xd.detach()))
    # Non-fp32 inputs keep the general path.
    assert "RMSNormCPU" not in type(norm.double()(x.detach().double()).grad_fn).__name__


def test_reference_model_compiles_as_one_graph_and_matches_eager():
    """Under torch.compile the CPU-only RMSNorm Function steps aside (F.rms_norm, which the
    compiler fuses): one graph, no breaks, the eager loss and gradients."""
    torch.manual_seed(0)
    cfg = tiny(n_head=4, n_kv_head=2, d_model=32)
    model = ref.ReferenceTransformer(cfg)
    x, y = batch(cfg)
    loss = model(x, y)
    loss.backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    compiled = torch.compile(model, backend=recording_backend, fullgraph=True)
    loss_c = compiled(x, y)
    loss_c.backward()
    assert len(graphs) == 1
    targets = [str(node.target) for node in graphs[0].graph.nodes]
    assert any("rms_norm" in t for t in targets) and not any("RMSNormCPU" in t for t in targets)
    torch.testing.assert_close(loss_c, loss, atol=1e-5, rtol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager[n], atol=1e-5, rtol=1e-4, msg=n)
