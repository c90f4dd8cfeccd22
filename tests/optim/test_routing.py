"""route_parameters: every trainable tensor in exactly one branch, on real and odd models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from speedtronic.config import ModelConfig
from speedtronic.optim import route_parameters
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
    assert reasons["conv.weight"].startswith("adamw: 4-D") and "(decay)" in reasons["conv.weight"]
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
