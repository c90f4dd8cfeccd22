"""route_parameters: every trainable tensor in exactly one branch, on real and odd models."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from speedtronic.config import ModelConfig, OptimizerConfig
from speedtronic.optim import Muon, build_optimizer, route_parameters
from speedtronic.optim.routing import trainable_parameters


def _check_partition(model: nn.Module):
    routes = route_parameters(model)
    ids = [id(p) for _, p in routes.muon + routes.adamw]
    assert len(ids) == len(set(ids)), "a tensor is in two branches"
    assert set(ids) == {id(p) for p in trainable_parameters(model)}
    return routes


def _names(items):
    return sorted(n for n, _ in items)


def test_reference_model_routing() -> None:
    from speedtronic.models import build_model

    model = build_model(ModelConfig(n_layer=2, d_model=64, n_head=4, vocab_size=64,
                                    max_seq_len=16))
    routes = _check_partition(model)
    assert all(p.ndim == 2 for _, p in routes.muon)
    assert len(routes.muon) == 2 * 7  # q, k, v, o, gate, up, down per block
    adamw = _names(routes.adamw)
    assert "embed.weight" in adamw  # tied with lm_head: seen once, on AdamW
    assert not any("proj" in n for n in adamw)
    # Embedding and norm gains do not decay by default.
    assert routes.adamw_decay == []


def test_untied_reference_model_keeps_head_on_adamw() -> None:
    from speedtronic.models import build_model

    model = build_model(ModelConfig(n_layer=1, d_model=64, n_head=4, vocab_size=64,
                                    max_seq_len=16, tie_weights=False))
    routes = _check_partition(model)
    assert {"embed.weight", "lm_head.weight"} <= set(_names(routes.adamw))


class GPTLike(nn.Module):
    """Untagged GPT-ish model: the router must find the embedding and heads by itself."""

    def __init__(self, vocab=50, width=32, tie=True, head_name="lm_head"):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleDict({
            "attn": nn.ModuleDict({"qkv": nn.Linear(width, 3 * width),
                                   "out": nn.Linear(width, width)}),
            "mlp": nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width)),
            "ln": nn.LayerNorm(width),
        })
        setattr(self, head_name, nn.Linear(width, vocab, bias=False))
        if tie:
            getattr(self, head_name).weight = self.wte.weight


def test_untagged_gpt_with_tied_head() -> None:
    routes = _check_partition(GPTLike(tie=True))
    assert _names(routes.muon) == ["blocks.attn.out.weight", "blocks.attn.qkv.weight",
                                   "blocks.mlp.0.weight", "blocks.mlp.2.weight"]
    assert "wte.weight" in _names(routes.adamw_no_decay)


def test_untied_head_found_by_name_and_by_vocab_as_last_resort() -> None:
    routes = _check_partition(GPTLike(tie=False))
    assert "lm_head.weight" in _names(routes.adamw)
    # A head with an unhelpful name: out_features == vocab (non-square) is the last resort.
    routes = _check_partition(GPTLike(tie=False, head_name="proj_final"))
    assert "proj_final.weight" in _names(routes.adamw)
    assert "proj_final.weight" not in _names(routes.muon)


def test_square_hidden_matrix_is_not_mistaken_for_a_head_when_vocab_equals_width() -> None:
    model = GPTLike(vocab=32, width=32, tie=True)
    routes = _check_partition(model)
    assert "blocks.attn.out.weight" in _names(routes.muon)


def test_role_override_both_ways_and_invalid_role() -> None:
    model = GPTLike(tie=False)
    model.blocks["attn"]["out"]._speedtronic_optimizer_role = "adamw"
    model.lm_head._speedtronic_optimizer_role = "muon"
    model.blocks["mlp"]._speedtronic_optimizer_role = "adamw"  # applies to children
    routes = _check_partition(model)
    assert "blocks.attn.out.weight" in _names(routes.adamw_decay)
    assert "lm_head.weight" in _names(routes.muon)
    assert "blocks.mlp.0.weight" in _names(routes.adamw)
    assert "blocks.attn.out.bias" in _names(routes.adamw)  # "muon"/"adamw" never move biases
    model.blocks["ln"]._speedtronic_optimizer_role = "sgd"
    with pytest.raises(ValueError, match="_speedtronic_optimizer_role.*'muon', 'adamw'"):
        route_parameters(model)


def test_frozen_params_are_in_neither_branch() -> None:
    model = GPTLike()
    model.blocks["attn"]["qkv"].weight.requires_grad_(False)
    routes = _check_partition(model)
    assert routes.frozen == ["blocks.attn.qkv.weight"]


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.conv = nn.Conv2d(3, 4, 3)
        self.bias_only = nn.Parameter(torch.zeros(8))
        self.raw = nn.Parameter(torch.randn(8, 8))
        self.nested = nn.ModuleDict({"a": nn.ModuleDict({"b": nn.Linear(8, 16, bias=False)})})
        self.alias = self.shared  # the same Linear registered twice
        self.stack = nn.Parameter(torch.randn(2, 8, 8))

    def forward(self, x):  # the shared Linear is used twice
        return self.nested["a"]["b"](self.alias(self.shared(x)) + self.bias_only + x @ self.raw)


def test_odd_model_partition() -> None:
    model = Odd()
    routes = _check_partition(model)
    assert _names(routes.muon) == ["nested.a.b.weight", "shared.weight"]
    reasons = routes.reasons
    assert reasons["conv.weight"].startswith("adamw: input conv")  # 3 channels: reads pixels
    assert "(decay)" in reasons["conv.weight"]
    assert "no decay" in reasons["bias_only"] and "no decay" in reasons["conv.bias"]
    assert reasons["raw"].startswith("adamw: 2-D tensor not owned by nn.Linear")
    assert "stack" in _names(routes.adamw_decay)


def test_bias_only_and_linear_free_models() -> None:
    m = nn.Module()
    m.b = nn.Parameter(torch.zeros(3))
    routes = _check_partition(m)
    assert routes.muon == [] and _names(routes.adamw_no_decay) == ["b"]
    routes = _check_partition(nn.Sequential(nn.Conv1d(2, 2, 3), nn.BatchNorm1d(2)))
    assert routes.muon == []


def test_unpacking_and_decay_flags() -> None:
    model = GPTLike(tie=False)
    muon, adamw = route_parameters(model)
    assert len(muon) == 4 and len(muon) + len(adamw) == len(trainable_parameters(model))
    routes = route_parameters(model, decay_embeddings=True, decay_norms_and_biases=True)
    assert routes.adamw_no_decay == []
    assert "muon 4 tensors" in routes.summary()


# ------------------------------------------------------------------ beyond nn.Linear
class Conv1D(torch.nn.Module):
    """The Hugging Face GPT-2 projection: weight stored (in, out), y = x @ W + b."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = torch.nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = torch.nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return x @ self.weight + self.bias


def test_transformer_encoder_routes_every_hidden_matrix_to_muon():
    from speedtronic.optim import describe_routing

    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64,
                                             batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    routes = route_parameters(model)
    muon = dict(routes.muon)
    assert {n for n in muon if n.endswith("in_proj_weight")} == {
        "layers.0.self_attn.in_proj_weight", "layers.1.self_attn.in_proj_weight"}
    assert routes.layouts["layers.0.self_attn.in_proj_weight"] == "split:3"
    assert routes.layouts["layers.0.self_attn.out_proj.weight"] == "matrix"
    assert "layers.0.linear1.weight" in muon and "layers.1.linear2.weight" in muon
    assert not routes.hidden_unrouted
    assert all(p.ndim < 2 for _, p in routes.adamw)
    table = describe_routing(model)
    assert "layers.0.self_attn.in_proj_weight" in table and "split:3" in table


def test_conv1d_goes_to_muon_with_the_logical_shape_for_the_lr_scale():
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), Conv1D(48, 16), Conv1D(16, 48))
    routes = route_parameters(model)
    assert routes.layouts == {"1.weight": "transposed", "2.weight": "transposed"}
    assert {n for n, _ in routes.adamw} == {"0.weight", "1.bias", "2.bias"}


def test_transposed_layout_equals_muon_on_the_transposed_matrix():
    torch.manual_seed(0)
    w = torch.randn(16, 48)  # stored (in, out) for out=48, in=16
    g = torch.randn(16, 48)
    a = torch.nn.Parameter(w.clone())
    b = torch.nn.Parameter(w.t().contiguous())  # the logical (out, in) matrix
    a.grad, b.grad = g.clone(), g.t().contiguous()
    Muon([{"params": [a], "layout": "transposed"}], lr=0.1, weight_decay=0.0,
         ns_dtype="fp32").step()
    Muon([b], lr=0.1, weight_decay=0.0, ns_dtype="fp32").step()
    torch.testing.assert_close(a.detach().t(), b.detach(), rtol=1e-5, atol=1e-6)


def test_split_layout_equals_three_separate_matrices():
    torch.manual_seed(0)
    w, g = torch.randn(3 * 16, 16), torch.randn(3 * 16, 16)
    fused = torch.nn.Parameter(w.clone())
    fused.grad = g.clone()
    parts = [torch.nn.Parameter(w[i * 16:(i + 1) * 16].clone()) for i in range(3)]
    for i, p in enumerate(parts):
        p.grad = g[i * 16:(i + 1) * 16].clone()
    opt = Muon([{"params": [fused], "layout": "split:3"}], lr=0.1, weight_decay=0.01,
               ns_dtype="fp32")
    for _ in range(2):
        opt.step()
    ref = Muon(parts, lr=0.1, weight_decay=0.01, ns_dtype="fp32")
    for _ in range(2):
        ref.step()
    torch.testing.assert_close(fused.detach(), torch.cat([p.detach() for p in parts]),
                               rtol=1e-5, atol=1e-6)
    assert opt.state[fused]["momentum_buffer"].shape == (48, 16)


def test_transposed_split_equals_three_separate_logical_matrices():
    """GPT-2's c_attn: (in, 3 out) stored; Q, K, V are its column blocks."""
    torch.manual_seed(0)
    w, g = torch.randn(16, 3 * 8), torch.randn(16, 3 * 8)  # (in, K * out)
    fused = torch.nn.Parameter(w.clone())
    fused.grad = g.clone()
    parts = [torch.nn.Parameter(w[:, i * 8:(i + 1) * 8].t().contiguous()) for i in range(3)]
    for i, p in enumerate(parts):
        p.grad = g[:, i * 8:(i + 1) * 8].t().contiguous()  # (out, in)
    opt = Muon([{"params": [fused], "layout": "transposed_split:3"}], lr=0.1,
               weight_decay=0.01, ns_dtype="fp32")
    ref = Muon(parts, lr=0.1, weight_decay=0.01, ns_dtype="fp32")
    for _ in range(2):
        opt.step()
        ref.step()
    torch.testing.assert_close(fused.detach(), torch.cat([p.detach().t() for p in parts], 1),
                               rtol=1e-5, atol=1e-6)
    assert opt.state[fused]["momentum_buffer"].shape == (24, 16)  # logical (K * out, in)


def test_gpt2_style_c_attn_is_recognized_and_declared_conv1d_splits_work():
    from speedtronic.optim import SPLIT_ATTRIBUTE

    class GPT2Attention(torch.nn.Module):  # named as in transformers, but defined here
        def __init__(self):
            super().__init__()
            self.c_attn = Conv1D(48, 16)
            self.c_proj = Conv1D(16, 16)

    model = torch.nn.Sequential(GPT2Attention())
    assert route_parameters(model).layouts["0.c_attn.weight"] == "transposed"  # not transformers'
    setattr(model[0].c_attn, SPLIT_ATTRIBUTE, 3)
    routes = route_parameters(model)
    assert routes.layouts == {"0.c_attn.weight": "transposed_split:3",
                              "0.c_proj.weight": "transposed"}
    setattr(model[0].c_attn, SPLIT_ATTRIBUTE, 5)
    with pytest.raises(ValueError, match="equal column blocks"):
        route_parameters(model)


def test_declared_fused_projection_and_bad_declarations():
    from speedtronic.optim import SPLIT_ATTRIBUTE

    qkv = torch.nn.Linear(16, 48)
    setattr(qkv, SPLIT_ATTRIBUTE, 3)
    routes = route_parameters(torch.nn.Sequential(qkv))
    assert routes.layouts["0.weight"] == "split:3"
    setattr(qkv, SPLIT_ATTRIBUTE, 5)
    with pytest.raises(ValueError, match="equal row blocks"):
        route_parameters(torch.nn.Sequential(qkv))
    with pytest.raises(ValueError, match="layout 'diagonal' is not valid"):
        Muon([{"params": [torch.nn.Parameter(torch.randn(4, 4))], "layout": "diagonal"}])


def test_a_muon_run_that_trains_most_matrices_with_adamw_says_so(caplog):
    class Raw(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.small = torch.nn.Linear(8, 8)
            self.big = torch.nn.Parameter(torch.randn(64, 64))  # a raw matrix, not a Linear

    with caplog.at_level(logging.WARNING, logger="speedtronic.optim"):
        build_optimizer(Raw(), OptimizerConfig(name="muon"))
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "only 2% of the hidden-matrix parameters are on Muon" in msg and "big 64x64" in msg
