"""The reference GPT-style decoder: RoPE, grouped-query attention, SwiGLU, RMSNorm, tied head.

Design choices that matter for speed (each one fixes a slow path of the v2.0 engine):

* attention always goes through ``F.scaled_dot_product_attention(..., is_causal=True)`` with no
  dense mask tensor, so SDPA can pick flash / memory-efficient kernels;
* grouped-query attention uses SDPA's ``enable_gqa`` (torch >= 2.5) where a fast kernel
  implements it (CPU; CUDA flash) instead of materialising repeated K/V; elsewhere K/V are
  expanded through a broadcast view (one copy, never ``repeat_interleave``);
* RoPE cos/sin tables are precomputed non-persistent buffers: no mutable Python cache, so
  ``torch.compile`` sees a static graph with no guards on cache length;
* the model never shifts labels: the data pipeline already gives ``labels[t] = input_ids[t+1]``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import ConfigError, ModelConfig
from ..kernels import cpu as cpu_kernels
from .builtin import swiglu_hidden

__all__ = ["ReferenceTransformer", "RMSNorm", "apply_rope", "rope_tables", "swiglu_hidden"]


def _sdpa_supports_gqa() -> bool:
    """True when ``F.scaled_dot_product_attention`` accepts ``enable_gqa`` (torch >= 2.5)."""
    return "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


_SDPA_GQA = _sdpa_supports_gqa()
_HAS_RMS_NORM = hasattr(F, "rms_norm")


def _use_sdpa_gqa(q: torch.Tensor) -> bool:
    """Whether to pass grouped K/V to SDPA with ``enable_gqa`` (else expand K/V first).

    CPU: enable_gqa measured 18% faster fwd+bwd than expanded K/V (B=16, H=8, KV=2, T=128,
    hd=32, 1 thread: 152 vs 185 ms per 10 iterations). CUDA: only the flash backend implements
    enable_gqa; inputs flash cannot take (fp32, head_dim > 256, pre-sm80) would fall back to
    the O(T^2)-memory math kernel, while expanded K/V keeps the memory-efficient kernel.
    Everything here is static per (device, dtype, shape), so torch.compile folds it.
    """
    if not _SDPA_GQA:
        return False
    if q.device.type == "cpu":
        return True
    if q.device.type != "cuda":
        return False
    return (q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
            and torch.cuda.get_device_properties(q.device).major >= 8)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain (no bias, no mean subtraction)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., C) -> (..., C)
        if cpu_kernels.usable(x, self.weight):  # one fused pass each way (cpu_kernels.py)
            return cpu_kernels.fused_rms_norm(x, self.weight, self.eps)
        if (x.device.type == "cpu" and x.dtype == torch.float32
                and self.weight.dtype == torch.float32 and not torch.compiler.is_compiling()):
            return _RMSNormCPU.apply(x, self.weight, self.eps)[0]
        if _HAS_RMS_NORM:  # CUDA: one fused kernel; under torch.compile: inductor fuses it
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return cpu_kernels.rms_norm_torch(x, self.weight, self.eps)


class _RMSNormCPU(torch.autograd.Function):
    """fp32 RMSNorm with a hand-written backward, for eager CPU runs.

    On CPU, torch 2.13's ``F.rms_norm`` is composite (pow, mean, add, rsqrt, two muls, and
    autograd through each of them); this does one reduction for the mean square and computes
    ``dx = rstd * (g*w - xhat * mean(g*w * xhat))`` directly: 909 -> 536 us forward + backward at
    (8, 128, 128) on one thread (``benchmarks/results/cpu_layers.md``), nine norms per step of
    the reference model. The fused kernel of :mod:`speedtronic.kernels.cpu` (258 us) replaces
    it where that is built and usable; this is the path otherwise. Returns ``(y, xhat, rstd)``;
    the last two are non-differentiable outputs, so that the ``setup_context`` form (which
    ``torch.func`` needs) can save them. With ``create_graph=True`` the backward recomputes
    ``rstd`` from ``x`` with differentiable ops, so gradient penalties (double backward) stay
    exact.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mean_square = torch.linalg.vector_norm(x, dim=-1, keepdim=True).pow(2) / x.shape[-1]
        rstd = torch.rsqrt(mean_square + eps)  # (..., 1)
        xhat = x * rstd  # (..., C)
        return xhat * weight, xhat, rstd

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        x, weight, eps = inputs
        _, xhat, rstd = output
        ctx.eps = eps
        ctx.mark_non_differentiable(xhat, rstd)
        ctx.save_for_backward(x, xhat, rstd, weight)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, _grad_xhat: Any,
                 _grad_rstd: Any) -> tuple[torch.Tensor | None, ...]:
        x, xhat, rstd, weight = ctx.saved_tensors
        if torch.is_grad_enabled():  # backward(create_graph=True): the saved rstd / xhat have
            # no graph back to x, so the differentiable form rebuilds them
            return (*cpu_kernels.rms_norm_backward_torch(grad_out, x, weight, ctx.eps), None)
        grad_x = grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad_out * xhat).reshape(-1, x.shape[-1]).sum(0)  # (C,)
        if ctx.needs_input_grad[0]:
            grad_xhat = grad_out * weight  # (..., C)
            projection = (grad_xhat * xhat).mean(-1, keepdim=True)  # (..., 1)
            # in place: grad_xhat is a temporary no graph keeps
            grad_x = grad_xhat.sub_(xhat * projection).mul_(rstd)
        return grad_x, grad_w, None


def rope_tables(head_dim: int, max_seq_len: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin tables, each ``(max_seq_len, head_dim // 2)``, for the half-split RoPE form."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, H, T, hd) by position: pairs are (x[i], x[i + hd/2]).

    ``cos``/``sin`` are (T, hd/2) (from :func:`rope_tables`) and broadcast over batch and heads.
    """
    cos_full, sin_signed = _full_tables(cos.to(x.dtype), sin.to(x.dtype))
    return _rotate(x, cos_full, sin_signed)


def _full_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, hd/2) cos/sin -> (T, hd) ``[cos, cos]`` and ``[-sin, sin]`` for :func:`_rotate`."""
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def _rotate(x: torch.Tensor, cos_full: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x * [cos, cos] + [x2, x1] * [-sin, sin]``: the half-split rotation in three passes.

    ``cos_full``/``sin_signed`` are the (T, hd) tables of :func:`_full_tables`, in ``x``'s dtype.
    ``[x2, x1]`` is ``roll(x, hd/2)``, whose backward is one more roll; a ``cat`` of two slices
    costs a zero-fill and a copy per slice in the backward. Forward + backward for q at
    (8, 4, 128, 32) on one CPU thread: textbook form (four half-width muls, a sub, an add and a
    cat) 555 us, three passes with a cat swap 466 us, with roll 377 us
    (``benchmarks/results/cpu_layers.md``); on a GPU it is 3 kernels instead of 7.
    """
    swapped = torch.roll(x, x.shape[-1] // 2, dims=-1)  # (B, H, T, hd): [x2, x1]
    return torch.addcmul(x * cos_full, swapped, sin_signed)


class Attention(nn.Module):
    """Causal multi-head attention with grouped K/V heads and rotary positions (bias-free)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.n_kv_head = cfg.n_kv_head or cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.dropout = cfg.dropout
        self.q_proj = nn.Linear(cfg.d_model, self.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, self.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, self.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos_full: torch.Tensor,
                sin_signed: torch.Tensor) -> torch.Tensor:
        """``x`` (B, T, C); ``cos_full``/``sin_signed``: (T, hd) tables from ``_full_tables``."""
        B, T, _ = x.shape
        H, KV, hd = self.n_head, self.n_kv_head, self.head_dim
        if cos_full.shape[-1] != hd:
            raise ValueError(f"RoPE tables must be (T, head_dim={hd}) from _full_tables, got "
                             f"{tuple(cos_full.shape)}")
        q = self.q_proj(x).view(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(x).view(B, T, KV, hd).transpose(1, 2)  # (B, KV, T, hd)
        v = self.v_proj(x).view(B, T, KV, hd).transpose(1, 2)  # (B, KV, T, hd)
        cos_full, sin_signed = cos_full.to(q.dtype), sin_signed.to(q.dtype)  # once for q and k
        q = _rotate(q, cos_full, sin_signed)
        k = _rotate(k, cos_full, sin_signed)
        p = self.dropout if self.training else 0.0
        if KV == H:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        elif _use_sdpa_gqa(q):
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                               enable_gqa=True)
        else:
            # Query head h uses K/V head h // (H // KV): broadcast view, then one reshape copy.
            k = k[:, :, None].expand(B, KV, H // KV, T, hd).reshape(B, H, T, hd)
            v = v[:, :, None].expand(B, KV, H // KV, T, hd).reshape(B, H, T, hd)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, H * hd)  # (B, T, H*hd)
        return self.o_proj(y)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, bias-free."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        gate, up = self.gate_proj(x), self.up_proj(x)  # (B, T, hidden) each
        if not torch.jit.is_scripting():  # TorchScript compiles only the torch-ops line
            # fp32 eager CPU, large enough: one fused pass each way (speedtronic.kernels.cpu)
            if cpu_kernels.usable(gate, up, min_numel=cpu_kernels.SWIGLU_MIN_NUMEL):
                return self.down_proj(cpu_kernels.fused_swiglu(gate, up))
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.mlp = SwiGLU(cfg.d_model, swiglu_hidden(cfg.d_model, cfg.d_ff))
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.resid_dropout(self.attn(self.attn_norm(x), cos, sin))
        return x + self.resid_dropout(self.mlp(self.mlp_norm(x)))


class ReferenceTransformer(nn.Module):
    """GPT-style decoder over token ids.

    ``forward(input_ids, labels=None)``: with labels (already shifted, ``-100`` = ignored) it
    returns the scalar mean cross-entropy; without, the logits ``(B, T, vocab_size)``.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        if cfg.vocab_size is None:
            raise ConfigError("model.vocab_size is not set; None means 'from the data', which "
                              "train_from_config resolves before building the model: set it "
                              "when building the model yourself")
        self.vocab_size = cfg.vocab_size
        self.max_seq_len = cfg.max_seq_len
        self.n_kv_head = cfg.n_kv_head or cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.gradient_checkpointing = False

        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.final_norm = RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.ooo_stage_names: list[str] = [f"blocks.{i}" for i in range(cfg.n_layer)]
        """Qualified names of the blocks in forward order: stages for out-of-order backprop."""
        if cfg.tie_weights:
            self.lm_head.weight = self.embed.weight
        # The optimizer router sends these to AdamW even though their weights are 2-D.
        self.embed._speedtronic_optimizer_role = "adamw"
        self.lm_head._speedtronic_optimizer_role = "adamw"

        cos, sin = rope_tables(self.head_dim, cfg.max_seq_len, cfg.rope_base)
        # Non-persistent: derived from the config, so not part of checkpoints.
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, hd/2) fp32
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()
        if cfg.gradient_checkpointing:
            self.set_gradient_checkpointing(True)

    # -- contracts with other components ---------------------------------------------------
    def speedtronic_shape_metadata(self) -> dict[str, Any]:
        """GEMM-relevant sizes for the startup shape-alignment table."""
        cfg = self.config
        return {
            "vocab_size": cfg.vocab_size,
            "d_model": cfg.d_model,
            "n_layer": cfg.n_layer,
            "n_head": cfg.n_head,
            "n_kv_head": self.n_kv_head,
            "head_dim": self.head_dim,
            "d_ff": swiglu_hidden(cfg.d_model, cfg.d_ff),
            "seq_len": cfg.max_seq_len,
        }

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (PaLM's ``6 N + 12 L d T``, see :mod:`speedtronic.train.mfu`):
        ``N`` counts every linear weight, the output head included even when tied."""
        n = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return 6.0 * n + 12.0 * len(self.blocks) * self.embed.embedding_dim * seq_len

    def set_gradient_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each block's activations during backward (saves memory, costs ~1 forward)."""
        self.gradient_checkpointing = bool(enabled)

    # -- init ------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """N(0, 0.02) everywhere; residual output projections scaled by 1/sqrt(2 * n_layer).

        The scaling keeps the residual stream's variance roughly independent of depth (GPT-2).
        With tied weights the shared matrix is initialised once (as the embedding).
        """
        std = 0.02
        resid_std = std / math.sqrt(2 * max(1, len(self.blocks)))
        nn.init.normal_(self.embed.weight, 0.0, std)
        if self.lm_head.weight is not self.embed.weight:
            nn.init.normal_(self.lm_head.weight, 0.0, std)
        for block in self.blocks:
            for lin in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj,
                        block.mlp.gate_proj, block.mlp.up_proj):
                nn.init.normal_(lin.weight, 0.0, std)
            nn.init.normal_(block.attn.o_proj.weight, 0.0, resid_std)
            nn.init.normal_(block.mlp.down_proj.weight, 0.0, resid_std)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    # -- forward ---------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids``: (B, T) int64, T <= ``max_seq_len``. With ``labels`` (B, T, already
        shifted, ``-100`` = ignored): the scalar mean cross-entropy over the labelled positions (0
        when there are none); without: the logits (B, T, vocab_size). Other shapes: ValueError."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq_len), got shape "
                             f"{tuple(input_ids.shape)}")
        T = input_ids.shape[1]
        if T > self.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds model.max_seq_len={self.max_seq_len}")
        cos, sin = _full_tables(self.rope_cos[:T], self.rope_sin[:T])  # (T, hd) each
        x = self.embed_dropout(self.embed(input_ids))  # (B, T, C)
        use_ckpt = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            if use_ckpt:
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        logits = self.lm_head(self.final_norm(x))  # (B, T, V)
        if labels is None:
            return logits
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels must have the shape of input_ids {tuple(input_ids.shape)} "
                             f"(already shifted by the data), got {tuple(labels.shape)}")
        # Sum / count instead of reduction="mean": an all-ignored batch gives 0, not NaN,
        # and the count stays on the device (no host sync).
        loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                   ignore_index=-100, reduction="sum")
        count = (labels != -100).sum().clamp_min(1)
        return loss_sum / count


def build_reference_transformer(cfg: ModelConfig) -> ReferenceTransformer:
    """Factory of the built-in reference GPT (``model.name``: ``reference_transformer`` or ``gpt``;
    the registry names it by import string, so this module imports nothing from the registry)."""
    return ReferenceTransformer(cfg)
