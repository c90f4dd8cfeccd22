"""A GPT-2-style toy model for the DiLoCo ladder, next to our reference one.

The ladder's recipe names "a 2-layer pre-norm transformer, d=128, 4 heads, context 64 - 470,528
parameters": that count is exactly a GPT-2-style block stack (learned positions, LayerNorm,
biased linears, 4x GELU MLP) with an untied, bias-free head, which is what this file builds.
Our bundled reference model (RoPE, RMSNorm, SwiGLU, tied head) learns much faster per step on
the same text (DP 1 worker 1.66 vs 2.06 for this model), which changes how much a 4x larger batch is
worth and so how hard the "DiLoCo within 3% of DP 4x batch" gate is; the ladder runs on both.

Registered as ``diloco_recipe_gpt`` when this module is imported (benchmarks only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from speedtronic.config import ModelConfig
from speedtronic.models import register_model


class _Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)  # (B, T, C) each
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in (q, k, v))  # (B, H, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class RecipeGPT(nn.Module):
    """GPT-2-style byte model: ``model(x, y)`` -> mean cross-entropy, like the reference model."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.tok = nn.Embedding(cfg.vocab_size, d)
        self.pos = nn.Embedding(cfg.max_seq_len, d)
        self.blocks = nn.ModuleList(_Block(d, cfg.n_head) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)
        for m in self.modules():  # GPT-2 init: N(0, 0.02) weights, zero biases
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


register_model("diloco_recipe_gpt", RecipeGPT)
