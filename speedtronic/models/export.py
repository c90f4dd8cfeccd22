"""The reference model out to the Hugging Face format, as a ``LlamaForCausalLM`` folder.

The reference decoder is Llama-shaped (RoPE, grouped-query attention, SwiGLU, RMSNorm eps 1e-5,
no biases, optionally tied head), so only names change. Its RoPE is the half-split form
(pairs ``x[i], x[i + hd/2]``), which is what transformers' Llama applies (``rotate_half``), so
q/k need no permutation (that is only for Meta's interleaved checkpoints). A test loads the
folder with transformers and compares logits with ours (fp32, <= 1e-5).

A Hugging Face model trained through :class:`~speedtronic.models.hf.HFCausalLM` is written with
its own ``save_pretrained``. Any other model is refused with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ConfigError, ModelConfig
from .builtin import swiglu_hidden

__all__ = ["export_hf", "llama_config", "llama_state_dict", "reference_state_from_llama"]

_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}


def llama_config(cfg: ModelConfig) -> dict[str, Any]:
    """``config.json`` of the ``LlamaForCausalLM`` equal to the reference model of ``cfg``."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": swiglu_hidden(cfg.d_model, cfg.d_ff),
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head or cfg.n_head,
        "head_dim": cfg.d_model // cfg.n_head,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": 1e-5,  # RMSNorm's default in reference.py
        "rope_theta": cfg.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_weights,
        "torch_dtype": "float32",
    }


def llama_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Reference-model tensors under Llama names (a tied head is left to ``tie_word_embeddings``:
    safetensors stores a tensor once)."""
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": state["embed.weight"],
                                    "model.norm.weight": state["final_norm.weight"]}
    if not cfg.tie_weights:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(cfg.n_layer):
        for ours, theirs in _BLOCK_NAMES.items():
            out[f"model.layers.{i}.{theirs}"] = state[f"blocks.{i}.{ours}"]
    unknown = {k for k in state if not (k.startswith(("embed.", "final_norm.", "lm_head.",
                                                     "blocks.")))}
    if unknown:
        raise ConfigError(f"export: tensors with no Llama counterpart: {sorted(unknown)[:4]}")
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in out.items()}


def reference_state_from_llama(tensors: dict[str, torch.Tensor],
                               cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of :func:`llama_state_dict`: a Llama folder's tensors under reference-model
    names (a tied head takes the embedding). Unknown or missing names are a ConfigError."""
    inverse = {f"model.layers.{i}.{theirs}": f"blocks.{i}.{ours}"
               for i in range(cfg.n_layer) for ours, theirs in _BLOCK_NAMES.items()}
    inverse.update({"model.embed_tokens.weight": "embed.weight",
                    "model.norm.weight": "final_norm.weight", "lm_head.weight": "lm_head.weight"})
    unknown = sorted(k for k in tensors if k not in inverse and "rotary_emb" not in k)
    if unknown:
        raise ConfigError(f"model.init_from: tensors the reference model does not have (is it "
                          f"a Llama folder of model.n_layer={cfg.n_layer} layers?): "
                          f"{unknown[:4]}")
    out = {inverse[k]: v for k, v in tensors.items() if k in inverse}
    if "lm_head.weight" not in out and "embed.weight" in out:
        out["lm_head.weight"] = out["embed.weight"]  # tie_word_embeddings: stored once
    return out


#: Marks a folder this function wrote: only such a folder is replaced by a later export.
EXPORT_MARKER = "speedtronic_export.json"


def export_hf(model: nn.Module, cfg: ModelConfig, out_dir: str | Path,
              tokenizer: str | None = None, eos: tuple[str, int] | None = None) -> Path:
    """Write ``model`` as a Hugging Face folder (see the module docstring); returns it.

    ``eos`` is the run's end-of-text token (name, id), written as ``eos_token_id`` (and into a
    ``tokenizer_config.json`` beside a copied tokenizer); without it the id is written as null:
    left out, transformers filled in Llama's defaults (bos 1, eos 2), a '"' in one run's
    vocabulary, where serving tools would stop. No BOS: training never prepends one.

    The folder is written whole beside ``out_dir`` and then moved into place, so it never mixes
    files of two exports (a re-export without a tokenizer once kept the old tokenizer.json). An
    existing ``out_dir`` is replaced only if an earlier export wrote it (:data:`EXPORT_MARKER`)
    or it is empty; any other folder is refused rather than overwritten."""
    from .hf import HFCausalLM
    from .reference import ReferenceTransformer

    if not isinstance(model, (HFCausalLM, ReferenceTransformer)):
        raise ConfigError(f"export: {type(model).__name__} is neither the reference model "
                          "(exported as LlamaForCausalLM) nor a Hugging Face model (written "
                          "with save_pretrained); a custom model has no known Hugging Face "
                          "layout")
    out = Path(out_dir).absolute()  # "-o ." has no name to stage beside
    if out.parent == out:
        raise ConfigError(f"export: output {out_dir} is a filesystem root; give -o a new or "
                          "empty folder")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"export: output {out} exists and is not a folder; give -o a new or "
                          "empty folder")
    if out.is_dir() and any(out.iterdir()) and not (out / EXPORT_MARKER).is_file():
        raise ConfigError(f"export: output folder {out} is not empty and was not written by "
                          "speedtronic export (no " + EXPORT_MARKER + "); give -o a new or "
                          "empty folder, so nothing of yours is overwritten")
    staging = out.with_name(f".{out.name}.export-tmp")
    try:
        shutil.rmtree(staging, ignore_errors=True)  # a crashed earlier export's leftovers
        staging.mkdir(parents=True)
        _write_folder(model, cfg, staging, tokenizer, eos)
        if out.exists():
            old = out.with_name(f".{out.name}.export-old")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            try:
                staging.rename(out)
            except OSError:
                old.rename(out)  # the earlier export stays where it was
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            staging.rename(out)
    except ConfigError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    except Exception as exc:  # OSError, safetensors' SafetensorError: a folder it cannot write
        shutil.rmtree(staging, ignore_errors=True)
        raise ConfigError(f"export: cannot write the output folder {out}: {exc}") from None
    return out


def _write_folder(model: nn.Module, cfg: ModelConfig, out: Path, tokenizer: str | None,
                  eos: tuple[str, int] | None) -> None:
    from .hf import HFCausalLM

    if isinstance(model, HFCausalLM):
        if eos is not None and getattr(model.hf.config, "eos_token_id", None) is None:
            model.hf.config.eos_token_id = eos[1]
        model.hf.save_pretrained(out)
    else:
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ConfigError("export needs the 'safetensors' package: pip install "
                              "safetensors") from None
        tensors = llama_state_dict(model.state_dict(), cfg)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        config = dict(llama_config(cfg), bos_token_id=None,
                      eos_token_id=None if eos is None else eos[1])
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copied = None
    if tokenizer:
        source = Path(tokenizer).expanduser()
        source = source / "tokenizer.json" if source.is_dir() else source
        if source.is_file():
            shutil.copyfile(source, out / "tokenizer.json")
            copied = str(source)
            settings: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                        "model_max_length": cfg.max_seq_len}
            if eos is not None:
                settings["eos_token"] = eos[0]
            (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    (out / EXPORT_MARKER).write_text(json.dumps({"tokenizer": copied}, indent=2) + "\n")
    # safetensors writes its file 0600 whatever the umask; the folder is made to be shared
    # (copied, uploaded, served), so every file gets the mode the umask gives new files
    umask = os.umask(0)
    os.umask(umask)
    for f in out.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~umask)
