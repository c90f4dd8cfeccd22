"""Speedtronic's hybrid Muon in a Lightning ``configure_optimizers``.

    pip install -e ".[dev]"                # lightning
    python examples/lightning_module.py    # a few seconds on a CPU

A small causal ``nn.TransformerEncoder`` learns bytes of a Python standard-library file. Its
attention keeps Q, K and V in one ``in_proj_weight``: routing orthogonalizes them as three
matrices (layout ``split:3``). Lightning keeps doing what it does (gradient accumulation,
``gradient_clip_val``, bf16 autocast, the scheduler); Speedtronic only supplies the optimizer.
"""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path

import torch

try:
    import lightning as L
except ImportError:  # one line, not a traceback: the dev extra installs it
    raise SystemExit("examples/lightning_module.py needs lightning: pip install -e \".[dev]\"") \
        from None
from torch import nn

from speedtronic.config import OptimizerConfig
from speedtronic.optim import build_optimizer, describe_routing


def byte_windows(path: Path, seq_len: int) -> torch.utils.data.TensorDataset:
    """(input, next-byte label) windows of one file, each ``(seq_len,)`` int64."""
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
    n = (len(data) - 1) // seq_len * seq_len
    return torch.utils.data.TensorDataset(data[:n].view(-1, seq_len),
                                          data[1:n + 1].view(-1, seq_len))


class ByteLM(L.LightningModule):
    """Embedding, causal TransformerEncoder, head; cross-entropy on the next byte."""

    def __init__(self, d_model: int = 64, n_layer: int = 2, seq_len: int = 64,
                 max_steps: int = 60) -> None:
        super().__init__()
        self.max_steps = max_steps
        self.embed = nn.Embedding(256, d_model)
        self.pos_emb = nn.Parameter(torch.zeros(seq_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model,
                                           dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 256)
        self.losses: list[float] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        T = ids.size(1)
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=ids.device)
        x = self.embed(ids) + self.pos_emb[:T]                      # (B, T, C)
        return self.head(self.encoder(x, mask=mask, is_causal=True))  # (B, T, 256)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        ids, labels = batch
        loss = nn.functional.cross_entropy(self(ids).flatten(0, 1).float(), labels.flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        # grad_clip: None because Lightning clips (gradient_clip_val) before every step.
        optimizer = build_optimizer(self, OptimizerConfig(name="muon", lr=3e-3, muon_lr=0.02,
                                                          grad_clip=None))
        warmup = max(1, self.max_steps // 10)
        schedule = torch.optim.lr_scheduler.LambdaLR(  # linear warmup, linear decay to 10%
            optimizer, lambda step: min((step + 1) / warmup,
                                        1.0 - 0.9 * step / max(1, self.max_steps)))
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def run(max_steps: int = 60, seq_len: int = 64, batch_size: int = 8, accumulation: int = 2,
        precision: str | None = None) -> ByteLM:
    """Train and return the module (``module.losses`` has one loss per micro-batch)."""
    L.seed_everything(0, verbose=False)
    module = ByteLM(seq_len=seq_len, max_steps=max_steps)
    if precision is None:  # bf16 autocast where the hardware runs it fast
        fast_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        precision = "bf16-mixed" if fast_bf16 else "32-true"
    trainer = L.Trainer(max_steps=max_steps, accumulate_grad_batches=accumulation,
                        gradient_clip_val=1.0, precision=precision, devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    loader = torch.utils.data.DataLoader(byte_windows(Path(inspect.__file__), seq_len),
                                         batch_size=batch_size, shuffle=True)
    trainer.fit(module, loader)
    return module


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--precision", default=None, help="e.g. bf16-mixed (default: auto)")
    cli = parser.parse_args()
    trained = run(cli.max_steps, precision=cli.precision)
    print(describe_routing(trained))
    print(f"train loss {trained.losses[0]:.3f} -> {trained.losses[-1]:.3f} over "
          f"{cli.max_steps} steps")
