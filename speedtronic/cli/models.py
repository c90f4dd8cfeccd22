"""``speedtronic sample`` and ``speedtronic export``: a run's model, looked at and handed on.

Both read a run directory (its ``config.yaml`` and newest verified checkpoint, or
``--checkpoint``); ``sample`` writes nothing, ``export`` only its output folder (default
``<RUN_DIR>/hf``).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any


def _seed(text: str) -> int:
    """``--seed``: an int torch's generator takes (a larger one failed deep inside torch)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be in [0, 2^63), got {text}")
    return value


def add_sample(sub: argparse._SubParsersAction) -> None:
    """Register ``speedtronic sample RUN_DIR``: text from a run's checkpoint."""
    p = sub.add_parser("sample", help="generate text from a run's checkpoint")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8,
                   help="0 = greedy; higher = more random (default 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely ids "
                                                         "(0 = all)")
    p.add_argument("--seed", type=_seed, default=0,
                   help="same seed, same text (same device); 0 <= seed < 2^63")
    p.add_argument("--checkpoint", help="a checkpoint file (default: the newest verified one)")
    p.add_argument("--tokenizer", help="tokenizer.json for runs on token files without "
                                       "data.tokenizer")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default cpu)")


def _codec(cfg: Any, tokenizer: str | None) -> tuple[Callable[[str], list[int]],
                                                      Callable[[list[int]], str], int | None]:
    """(encode, decode, end-of-text id) of the run's tokens."""
    from ..config import ConfigError

    spec = tokenizer or cfg.data.tokenizer
    if spec:
        from ..data.prepare import eos_id, load_tokenizer

        tok = load_tokenizer(spec)
        return (lambda text: tok.encode(text, add_special_tokens=False).ids,
                lambda ids: tok.decode(ids), eos_id(tok))
    if cfg.data.tokens_path is None and cfg.model.vocab_size == 256:  # bundled / text: bytes
        return (lambda text: list(text.encode("utf-8")),
                lambda ids: bytes(ids).decode("utf-8", errors="replace"), None)
    raise ConfigError("sample: this run trained on token ids without data.tokenizer, so its "
                      "text cannot be decoded: give --tokenizer path/to/tokenizer.json")


def cmd_sample(args: argparse.Namespace) -> int:
    """Generate from a run's checkpoint and print prompt plus continuation on stdout (loading
    warnings and the settings line go to stderr, so the text can be piped). Returns the exit
    code; a bad option raises ConfigError."""

    from ..config import ConfigError
    from ..models.generate import generate
    from ..train.run_model import load_run_model

    for bad, rule in ((args.max_new_tokens < 1, f"--max-new-tokens must be >= 1, got "
                                                f"{args.max_new_tokens}"),
                      (not 0 <= args.temperature < math.inf, "--temperature must be a finite "
                       f"number >= 0 (0 = greedy), got {args.temperature:g}"),
                      (args.top_k < 0, f"--top-k must be >= 0 (0 = all), got {args.top_k}")):
        if bad:
            raise ConfigError(f"sample: {rule}")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # a raw byte from the shell arrives as a lone surrogate
        raise ConfigError(f"sample: --prompt is not valid UTF-8 text (position {exc.start}); "
                          "pass the prompt as UTF-8") from None
    from ..train.precision import resolve_device

    args.device = str(resolve_device(args.device))  # an unavailable device: one line, exit 2
    from .console import console_for_output

    with console_for_output():  # stdout holds the text alone
        model, cfg, path = load_run_model(args.run_dir, args.checkpoint, args.device)
    encode, decode, stop = _codec(cfg, args.tokenizer)
    prompt = encode(args.prompt)
    if not prompt:
        raise ConfigError("sample: --prompt encodes to no tokens")
    print(f"sample: {path.name}, {args.max_new_tokens} tokens, temperature "
          f"{args.temperature:g}, top-k {args.top_k or 'all'}, seed {args.seed} (no KV cache: "
          "each token re-reads the window)", file=sys.stderr)
    ids = generate(model, prompt, args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k or None, max_seq_len=cfg.model.max_seq_len, seed=args.seed,
                   device=args.device, stop_id=stop)
    _print_text(args.prompt + decode(ids))
    return 0


def _print_text(text: str) -> None:
    """Print sampled text whatever stdout's encoding: a byte-level model emits U+FFFD, and a
    Windows pipe or file is cp1252, where print raised "'charmap' codec can't encode" (exit 2
    after the whole sample ran); what the encoding lacks becomes ``?``."""
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        text = text.encode(encoding, errors="replace").decode(encoding)
    except LookupError:  # a stream naming no codec Python knows: print as it is
        pass
    print(text, flush=True)


def add_export(sub: argparse._SubParsersAction) -> None:
    """Register ``speedtronic export RUN_DIR``: a run's model as a Hugging Face folder."""
    p = sub.add_parser("export", help="write a run's model as a Hugging Face folder "
                                      "(LlamaForCausalLM for the reference model)")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("-o", "--output", help="folder to write (default: <RUN_DIR>/hf)")
    p.add_argument("--checkpoint", help="a checkpoint file (default: the newest verified one)")


def cmd_export(args: argparse.Namespace) -> int:
    """Write a run's checkpoint as a Hugging Face folder (default ``<RUN_DIR>/hf``), with the run's
    tokenizer and end-of-text token when it has them. Returns the exit code."""
    from pathlib import Path

    from ..models.export import export_hf
    from ..train.run_model import load_run_model

    model, cfg, path = load_run_model(args.run_dir, args.checkpoint)
    eos = None
    if cfg.data.tokenizer:  # the id the run's prepared data ends each document with
        from ..data.prepare import eos_id, load_tokenizer

        tokenizer = load_tokenizer(cfg.data.tokenizer)
        found = eos_id(tokenizer)
        eos = None if found is None else (tokenizer.id_to_token(found), found)
    out = export_hf(model, cfg.model, args.output or Path(args.run_dir) / "hf",
                    tokenizer=cfg.data.tokenizer, eos=eos)
    kind = "LlamaForCausalLM" if cfg.model.name != "hf" else "its Hugging Face class"
    tok = "tokenizer.json copied" if (out / "tokenizer.json").exists() else \
        "no tokenizer (byte-level ids are the UTF-8 bytes)" if cfg.model.vocab_size == 256 \
        else "no tokenizer file"
    print(f"exported {path.name} as {kind} to {out} ({tok})", flush=True)
    return 0
