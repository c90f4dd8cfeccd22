"""Sampling from a trained model: ``speedtronic sample`` and :func:`generate`.

No KV cache: each new token runs the model over the last ``max_seq_len`` tokens again. For the
models this engine trains on one GPU or a CPU (context 128-1024) that is simple and exact, and it
works for any model the trainer accepts (``model(input_ids) -> logits``); a cached decoder would
be the reference model's own forward with cache tensors, left for when sampling speed matters.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["generate"]


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], max_new_tokens: int, *,
             temperature: float = 1.0, top_k: int | None = None, max_seq_len: int,
             seed: int = 0, device: torch.device | str = "cpu",
             stop_id: int | None = None) -> list[int]:
    """``prompt`` continued by up to ``max_new_tokens`` ids (the prompt not included).

    ``temperature`` 0 is greedy (argmax); otherwise ids are drawn from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely, with a generator
    seeded by ``seed``, so a seed gives the same text on the same device and dtype. Generation
    stops early at ``stop_id`` (the tokenizer's end-of-text), which is not returned.
    """
    if not prompt:
        raise ValueError("prompt must hold at least one token")
    was_training = model.training
    model.eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([prompt], dtype=torch.long, device=device)  # (1, T)
    out: list[int] = []
    # A temperature that is 0 in float32 (5e-324) is greedy: the logits are float32 (no float64
    # on every device, MPS has none), and 0/0 at the best token was NaN.
    greedy = temperature <= 0 or torch.tensor(temperature, dtype=torch.float32).item() == 0.0
    try:
        for _ in range(max_new_tokens):
            window = ids[:, -max_seq_len:]  # (1, <=max_seq_len)
            logits = model(window)[:, -1, :].float()  # (1, V)
            if greedy:
                nxt = logits.argmax(dim=-1, keepdim=True)  # (1, 1)
            else:
                # max first: the best token scores 0, so a tiny temperature (1e-45) sends the
                # rest to -inf instead of every logit to +-inf and softmax to NaN
                logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
                if top_k is not None and top_k < logits.shape[-1]:
                    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (1, 1)
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
            token = int(nxt)
            if stop_id is not None and token == stop_id:
                break
            out.append(token)
            ids = torch.cat([ids, nxt], dim=1)
    finally:
        model.train(was_training)
    return out
