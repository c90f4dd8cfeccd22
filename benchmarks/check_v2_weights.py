"""Do speedtronic 2.0 checkpoints' weights, loaded with ``model.init_from``, compute what 2.0
computed? Trains a few steps with the speedtronic 2.0.0 package itself (in its own virtual
environment), evaluates its model on fixed ids there, then loads the checkpoint here through
:func:`speedtronic.train.v2_checkpoints.load_v2_weights` and compares the logits.

    python3 -m venv /tmp/venv20 && /tmp/venv20/bin/pip install torch==2.13.0 speedtronic==2.0.0
    python benchmarks/check_v2_weights.py --v20-python /tmp/venv20/bin/python

Writes ``benchmarks/results/v2_weights.md``. Not a test: CI does not install 2.0.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from speedtronic import load_config  # noqa: E402
from speedtronic.models import build_model  # noqa: E402
from speedtronic.train.v2_checkpoints import latest_v2_checkpoint, load_v2_weights  # noqa: E402

#: 2.0 model sections: its smoke config (GQA, explicit d_ff) and one on 2.0's defaults for d_ff
#: and n_kv_head, with an untied head.
CASES = {
    "2.0 smoke (n_kv_head 2, d_ff 128, tied)": {
        "vocab_size": 128, "max_seq_len": 32, "n_layer": 2, "n_head": 4, "n_kv_head": 2,
        "d_model": 64, "d_ff": 128},
    "d_ff and n_kv_head unset, untied head": {
        "vocab_size": 96, "max_seq_len": 32, "n_layer": 3, "n_head": 2, "d_model": 48,
        "tie_weights": False},
}

_IN_V20 = r"""
import json, subprocess, sys, torch
from pathlib import Path
folder = Path(sys.argv[1])
subprocess.run([sys.executable, "-m", "speedtronic", "train", "--config", str(folder / "v20.yaml")],
               check=True, capture_output=True)
from speedtronic import load_config, build_model
cfg = load_config(str(folder / "v20.yaml"))
pointer = json.loads((folder / "out" / "checkpoints" / "latest.json").read_text())
state = torch.load(folder / "out" / "checkpoints" / pointer["file"], weights_only=False)
model = build_model(cfg.model)
model.load_state_dict(state["model"])
model.eval()
ids = torch.load(folder / "ids.pt")
with torch.no_grad():
    out = model(ids)
logits = out["logits"] if isinstance(out, dict) else out
torch.save(logits, folder / "logits20.pt")
"""


def _check(v20_python: str, model: dict, folder: Path) -> dict:
    raw = {"name": "v2check", "seed": 3, "max_steps": 3, "output_dir": str(folder / "out"),
           "model": {"name": "reference_transformer", **model},
           "data": {"synthetic": True, "num_tokens": 4096, "block_size": model["max_seq_len"],
                    "micro_batch_size": 2, "target_batch_size": 2},
           "optimizer": {"lr": 0.003}, "scheduler": {"warmup_steps": 1, "max_steps": 3},
           "precision": {"mode": "fp32"}, "compile": False}
    (folder / "v20.yaml").write_text(yaml.safe_dump(raw))
    ids = torch.randint(0, model["vocab_size"], (2, model["max_seq_len"]),
                        generator=torch.Generator().manual_seed(0))
    torch.save(ids, folder / "ids.pt")
    # cwd: the folder, so that `-m speedtronic` there never finds this checkout's package
    subprocess.run([v20_python, "-c", _IN_V20, str(folder)], check=True, capture_output=True,
                   cwd=folder)
    reference = torch.load(folder / "logits20.pt")
    tensors, saved = load_v2_weights(latest_v2_checkpoint(folder / "out"))
    ours = {k: v for k, v in model.items() if k != "d_ff"}
    cfg = load_config({"model": {**ours, "d_ff": saved["d_ff"]}})
    net = build_model(cfg.model)
    missing, unexpected = net.load_state_dict(tensors, strict=False)
    net.eval()
    with torch.no_grad():
        out = net(ids)
    logits = out["logits"] if isinstance(out, dict) else out
    return {"d_ff_here": saved["d_ff"], "missing": missing, "unexpected": unexpected,
            "max_abs_diff": float((logits - reference).abs().max()),
            "max_abs_logit": float(reference.abs().max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--v20-python", required=True, help="a Python with speedtronic==2.0.0")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = {}
    for name, model in CASES.items():
        with tempfile.TemporaryDirectory() as tmp:
            rows[name] = _check(args.v20_python, model, Path(tmp))
    v20 = subprocess.run([args.v20_python, "-c", "import speedtronic, torch; "
                          "print(speedtronic.__version__, torch.__version__)"],
                         check=True, capture_output=True, text=True,
                         cwd=tempfile.gettempdir()).stdout.split()
    commit = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    lines = ["# speedtronic 2.0 checkpoints loaded with model.init_from: same logits?", "",
             f"`python benchmarks/check_v2_weights.py --v20-python <venv with speedtronic "
             f"{v20[0]}>` on {commit}, {time.strftime('%Y-%m-%d %H:%M')} UTC; torch "
             f"{torch.__version__} here, {v20[1]} beside speedtronic {v20[0]}; "
             f"{platform.machine()}, fp32, 1 thread.", "",
             "2.0 trains 3 steps on synthetic ids and writes its checkpoint; 2.0 evaluates its "
             "model on 2 x max_seq_len fixed ids; this version loads the checkpoint through "
             "`load_v2_weights` (the names converted, `d_ff` set to 2.0's MLP width) and "
             "evaluates the same ids.", "",
             "| 2.0 model | d_ff to set here | missing / unexpected tensors | max abs logit "
             "difference | max abs logit |", "|---|---:|---|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['d_ff_here']} | {len(r['missing'])} / "
                     f"{len(r['unexpected'])} | {r['max_abs_diff']:.1e} | "
                     f"{r['max_abs_logit']:.3f} |")
    out = ROOT / "benchmarks" / "results" / "v2_weights.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps(rows, default=str))


if __name__ == "__main__":
    main()
