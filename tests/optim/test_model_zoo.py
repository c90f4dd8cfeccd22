"""Routing and training on the models people train, built offline from tiny configs (no
downloads): Hugging Face GPT-2 (Conv1D), Llama, BERT and ViT; torch.nn.TransformerEncoder is in
test_routing.py. For each: every hidden matrix on Muon with the right layout, a few hybrid-Muon
steps reduce the loss, and the optimizer state round-trips through state_dict."""

from __future__ import annotations

import io
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from speedtronic.config import OptimizerConfig  # noqa: E402
from speedtronic.optim import build_optimizer, route_parameters  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)
T = transformers
SMALL = dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, hidden_size=32)


def _gpt2():
    cfg = T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=32,
                       bos_token_id=0, eos_token_id=0)
    return T.GPT2LMHeadModel(cfg), "lm"


def _llama():
    cfg = T.LlamaConfig(**SMALL, num_key_value_heads=2, vocab_size=100,
                        max_position_embeddings=32)
    return T.LlamaForCausalLM(cfg), "lm"


def _bert():
    return T.BertForMaskedLM(T.BertConfig(**SMALL, vocab_size=100,
                                          max_position_embeddings=32)), "lm"


def _vit():
    cfg = T.ViTConfig(**SMALL, image_size=16, patch_size=4, num_labels=3)
    return T.ViTForImageClassification(cfg), "image"


# model -> (builder, hidden matrices expected on Muon, their layout)
ZOO = {
    "gpt2": (_gpt2, 8, "transposed"),   # c_attn, attn c_proj, c_fc, mlp c_proj per layer
    "llama": (_llama, 14, "matrix"),    # q, k, v, o, gate, up, down per layer
    "bert": (_bert, 13, "matrix"),      # q, k, v, o, intermediate, output per layer + pooler
    "vit": (_vit, 12, "matrix"),        # q, k, v, o, intermediate, output per layer
}


def _loss(model, kind: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "image":
        pixels = torch.randn(4, 3, 16, 16, generator=g)
        return model(pixel_values=pixels, labels=torch.tensor([0, 1, 2, 0])).loss
    ids = torch.randint(0, 100, (4, 16), generator=g)
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("name", sorted(ZOO))
def test_routing_is_complete_and_training_reduces_the_loss(name):
    build, n_muon, layout = ZOO[name]
    torch.manual_seed(0)
    model, kind = build()
    model.eval()  # no dropout: the round trip below compares two models bit for bit
    routes = route_parameters(model)
    assert len(routes.muon) == n_muon, routes.reasons
    assert set(routes.layouts.values()) == {layout}
    assert not routes.hidden_unrouted, routes.hidden_unrouted
    opt = build_optimizer(model, OptimizerConfig(name="muon", lr=3e-3, muon_lr=0.02))
    first = _loss(model, kind).item()
    for _ in range(8):
        opt.zero_grad()
        _loss(model, kind).backward()
        opt.step()
    assert _loss(model, kind).item() < first

    # state_dict round trip: a fresh optimizer loaded from bytes steps exactly like the original
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    twin, _ = build()
    twin.eval()
    twin.load_state_dict(model.state_dict())
    opt2 = build_optimizer(twin, OptimizerConfig(name="muon", lr=3e-3, muon_lr=0.02))
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    for m, o in ((model, opt), (twin, opt2)):
        o.zero_grad()
        _loss(m, kind, seed=1).backward()
        o.step()
    for (k, a), (_, b) in zip(model.state_dict().items(), twin.state_dict().items(),
                              strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)
