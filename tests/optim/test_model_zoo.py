"""Routing and training on the models people train, built offline from tiny configs (no
downloads): Hugging Face GPT-2 (Conv1D), Llama, BERT and ViT. For each: every hidden matrix on
Muon with the right layout, a few hybrid-Muon steps reduce the loss, and the optimizer state
round-trips through state_dict (tests/_zoo_fixtures.py). torch.nn models are in
test_model_zoo_torch.py, timm's in test_model_zoo_timm.py."""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _zoo_fixtures import check_zoo_model  # noqa: E402

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


# model -> (builder, Muon tensors per layout)
ZOO = {
    # per layer: c_attn (Q, K, V column blocks), attn c_proj, c_fc, mlp c_proj
    "gpt2": (_gpt2, {"transposed_split:3": 2, "transposed": 6}),
    "llama": (_llama, {"matrix": 14}),   # q, k, v, o, gate, up, down per layer
    "bert": (_bert, {"matrix": 13}),     # q, k, v, o, intermediate, output per layer + pooler
    "vit": (_vit, {"matrix": 12}),       # q, k, v, o, intermediate, output per layer
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
    build, layouts = ZOO[name]
    kind = build()[1]
    check_zoo_model(lambda: build()[0], lambda m, seed: _loss(m, kind, seed), layouts)
