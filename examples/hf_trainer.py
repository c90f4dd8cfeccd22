"""Speedtronic's hybrid Muon as the optimizer of a Hugging Face ``Trainer``.

    pip install -e ".[dev]"          # transformers + accelerate
    python examples/hf_trainer.py    # a few seconds on a CPU

A tiny GPT-2 (its projections are ``Conv1D``, stored (in, out): routing knows the orientation)
learns bytes of a Python standard-library file. The Trainer keeps doing what it does (gradient
accumulation, clipping with ``max_grad_norm``, bf16 autocast, the schedule); Speedtronic only
supplies the optimizer through ``optimizers=(optimizer, scheduler)``.
"""

from __future__ import annotations

import argparse
import inspect
import math
from pathlib import Path

import torch

try:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
except ImportError:  # one line, not a traceback: the dev extra installs it
    raise SystemExit("examples/hf_trainer.py needs transformers: pip install -e \".[dev]\"") \
        from None

from speedtronic.config import OptimizerConfig
from speedtronic.optim import build_optimizer, describe_routing


class ByteChunks(torch.utils.data.Dataset):
    """Fixed-length byte windows of one text file, as the dicts a Trainer feeds the model."""

    def __init__(self, path: Path, seq_len: int) -> None:
        data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
        self.chunks = data[: len(data) // seq_len * seq_len].view(-1, seq_len)  # (N, T)

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        # GPT-2 shifts the labels itself (labels = inputs).
        return {"input_ids": self.chunks[i], "labels": self.chunks[i]}


def run(output_dir: str, max_steps: int = 60, d_model: int = 64, n_layer: int = 2,
        seq_len: int = 64, batch_size: int = 8, accumulation: int = 2,
        bf16: bool | None = None) -> Trainer:
    """Train and return the finished ``Trainer`` (its ``state.log_history`` has the losses)."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=seq_len, n_embd=d_model,
                                       n_layer=n_layer, n_head=4, bos_token_id=0,
                                       eos_token_id=0))
    # grad_clip: None because the Trainer clips (max_grad_norm) before every optimizer step.
    optimizer = build_optimizer(model, OptimizerConfig(name="muon", lr=3e-3, muon_lr=0.02,
                                                       grad_clip=None))
    warmup = max(1, max_steps // 10)

    def lr_factor(step: int) -> float:  # linear warmup, cosine decay to 10%
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, max_steps - warmup)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    if bf16 is None:  # bf16 autocast where the hardware runs it fast
        bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    args = TrainingArguments(
        output_dir=output_dir, max_steps=max_steps, per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation, max_grad_norm=1.0, bf16=bf16,
        logging_steps=max(1, max_steps // 6), save_strategy="no", report_to=[],
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=args,
                      train_dataset=ByteChunks(Path(inspect.__file__), seq_len),
                      optimizers=(optimizer, scheduler))
    trainer.train()
    return trainer


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default="runs/example-hf-trainer")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast on CPU too")
    cli = parser.parse_args()
    finished = run(cli.output_dir, cli.max_steps, bf16=True if cli.bf16 else None)
    print(describe_routing(finished.model))
    losses = [row["loss"] for row in finished.state.log_history if "loss" in row]
    print(f"train loss {losses[0]:.3f} -> {losses[-1]:.3f} over {cli.max_steps} steps")
