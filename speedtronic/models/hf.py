"""Hugging Face causal LMs through the engine: ``model.name: hf`` and user factories.

The trainer calls ``model(input_ids, labels)`` with labels our data has **already shifted**
(``labels[t] = input_ids[t + 1]``, ``-100`` ignored). A Hugging Face causal LM called as
``hf(input_ids=x, labels=y)`` shifts them once more, so the obvious wrapper trains every token to
predict the one two ahead (eval 2.758 against 2.497 correctly wrapped, GPT-2 small at 600 steps,
measured in the issue that asked for this). :class:`HFCausalLM` calls the model with keywords,
takes its logits and computes the loss itself, exactly as the reference model does: the sum of
token cross-entropies over the count of unignored labels.

``model.hf_config`` is a local folder holding ``config.json`` (never downloaded), or a mapping
``{model_type: llama, hidden_size: 64, ...}`` built with ``transformers.AutoConfig.for_model``.
The weights are freshly initialised by transformers (``model.init_from`` loads trained ones).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError, ModelConfig
from ..errors import first_line

__all__ = ["HFCausalLM", "adapt_model", "build_hf_model", "check_forward", "is_hf_model"]

IGNORE_INDEX = -100
# Keys of a Hugging Face config that bound the sequence length, by model family.
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length")


def is_hf_model(model: nn.Module) -> bool:
    """A ``transformers.PreTrainedModel`` (checked without importing transformers)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
               for c in type(model).__mro__)


class HFCausalLM(nn.Module):
    """``forward(input_ids, labels=None)`` around a Hugging Face causal LM (see module doc).

    Attributes:
        hf: the wrapped ``PreTrainedModel`` (its state dict keys are prefixed ``hf.``).
    """

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf
        out = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
        inp = hf.get_input_embeddings() if hasattr(hf, "get_input_embeddings") else None
        for module in (out, inp):  # the router sends embeddings and the head to AdamW
            if module is not None:
                module._speedtronic_optimizer_role = "adamw"

    def forward(self, input_ids: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.hf(input_ids=input_ids, use_cache=False).logits  # (B, T, V)
        if labels is None:
            return logits
        # Sum / count, fp32: the reference model's definition (an all-ignored batch gives 0).
        loss_sum = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                   labels.reshape(-1), ignore_index=IGNORE_INDEX,
                                   reduction="sum")
        return loss_sum / (labels != IGNORE_INDEX).sum().clamp_min(1)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, PaLM's ``6 N + 12 L d T`` as for the reference model:
        ``N`` the non-embedding parameters plus the output head (tied or not)."""
        c = self.hf.config
        n = self.hf.num_parameters(exclude_embeddings=True)
        head = self.hf.get_output_embeddings()
        if head is not None and head.weight is self.hf.get_input_embeddings().weight:
            n += head.weight.numel()  # tied: excluded above, yet a GEMM every token
        layers = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", 0)
        width = getattr(c, "hidden_size", None) or getattr(c, "n_embd", 0)
        return 6.0 * n + 12.0 * layers * width * seq_len

    def set_gradient_checkpointing(self, enabled: bool = True) -> None:
        """Hugging Face's own activation checkpointing."""
        if enabled:
            self.hf.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.hf.gradient_checkpointing_disable()


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError("model.name: hf needs the 'transformers' package: pip install "
                          "transformers") from None
    return transformers


def build_hf_model(cfg: ModelConfig) -> HFCausalLM:
    """``model.name: hf``: a freshly initialised causal LM from ``model.hf_config``."""
    transformers = _transformers()
    spec = cfg.hf_config
    if spec is None:
        raise ConfigError("model.hf_config: required with model.name: hf (a folder holding "
                          "config.json, or a mapping with model_type and its sizes)")
    try:
        if isinstance(spec, str):
            folder = Path(spec).expanduser()
            if not (folder / "config.json").is_file():
                raise ConfigError(f"model.hf_config: {spec!r} has no config.json (give a local "
                                  "folder; nothing is downloaded)")
            hf_cfg = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
        elif isinstance(spec, dict) and isinstance(spec.get("model_type"), str):
            extra = {k: v for k, v in spec.items() if k != "model_type"}
            hf_cfg = transformers.AutoConfig.for_model(spec["model_type"], **extra)
        else:
            raise ConfigError("model.hf_config: expected a folder path or a mapping with a "
                              f"model_type string, got {type(spec).__name__}")
    except ConfigError:
        raise
    except (ValueError, KeyError, OSError, TypeError) as exc:
        first = first_line(exc)
        raise ConfigError(f"model.hf_config: transformers cannot build a config from it: "
                          f"{first[:300]}") from None
    explicit = isinstance(spec, dict) and "vocab_size" in spec
    if cfg.vocab_size is not None and not explicit:
        hf_cfg.vocab_size = cfg.vocab_size  # the data's vocabulary (model.vocab_size)
        # special ids of the family's own tokenizer (GPT-2's 50256) beyond it: transformers
        # warned on every load of the run's export ("must be within the vocabulary")
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(hf_cfg, key, None)
            if isinstance(value, int) and value >= cfg.vocab_size:
                setattr(hf_cfg, key, None)
    elif cfg.vocab_size is not None and int(hf_cfg.vocab_size) < cfg.vocab_size:
        # ids up to vocab_size - 1 would index past the embedding: an IndexError traceback at
        # the first step, after the run directory had changed
        raise ConfigError(f"model.hf_config.vocab_size: {hf_cfg.vocab_size} is smaller than the "
                          f"data's vocabulary (model.vocab_size {cfg.vocab_size}); raise it, or "
                          "leave it out to take the data's")
    for key in _POSITION_KEYS:
        limit = getattr(hf_cfg, key, None)
        if isinstance(limit, int) and limit < cfg.max_seq_len:
            raise ConfigError(f"model.max_seq_len: {cfg.max_seq_len} exceeds the Hugging Face "
                              f"config's {key}={limit}; lower it or raise {key}")
    # A causal LM must not see the tokens it predicts: an encoder family (bert, roberta) built
    # as AutoModelForCausalLM attends both ways unless is_decoder (position 0's logits moved
    # with token 5); decoder-only configs ignore the flag
    hf_cfg.is_decoder = True
    try:
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    except ValueError as exc:
        raise ConfigError(f"model.hf_config: {hf_cfg.model_type!r} is not a causal LM "
                          f"transformers can build ({str(exc).splitlines()[0][:200]})") from None
    return HFCausalLM(hf)


def adapt_model(model: nn.Module) -> nn.Module:
    """What a factory returned, made callable as ``model(input_ids, labels) -> loss``: a
    Hugging Face model is wrapped, anything else returned as is."""
    return HFCausalLM(model) if is_hf_model(model) else model


def check_forward(model: nn.Module, name: str) -> None:
    """Refuse, before training, a model whose forward cannot take ``(input_ids, labels)``,
    naming the accepted forms (the trainer's call would end in a TypeError traceback)."""
    if isinstance(model, HFCausalLM):
        return
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # a C-implemented forward: leave it to the call
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    variadic = any(p.kind == p.VAR_POSITIONAL for p in params)
    if variadic or len(positional) >= 2:
        return
    raise ConfigError(f"model.name: {name!r} returned {type(model).__name__}, whose forward"
                      f"{inspect.signature(model.forward)} takes neither (input_ids, labels) "
                      "nor is a Hugging Face PreTrainedModel. Accepted: forward(input_ids, "
                      "labels) returning a loss (tensor, {'loss': t} or (t, ...)), or a "
                      "transformers causal LM (wrapped; the loss is computed from its logits "
                      "against the already-shifted labels)")
