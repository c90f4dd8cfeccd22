"""The ``speedtronic compare`` subcommand: argument parsing and the printed summary.

Registered in :mod:`speedtronic.cli` as ``add_parser`` / ``run``. Parsing imports no torch.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from .variants import PRESETS

__all__ = ["add_parser", "run"]

_EPILOG = (
    "presets: " + ", ".join(PRESETS) + ". No --variant = all presets, adamw first.\n"
    "examples:\n"
    "  speedtronic compare --config base.yaml --variant adamw --variant muon --steps 300\n"
    "  speedtronic compare --config base.yaml --variant adamw "
    "--variant mymuon:optimizer.name=muon,optimizer.muon_lr=0.05 --seeds 3 --lr-sweep\n"
    "Rerunning the same command resumes: finished runs are reused, interrupted ones continue "
    "from their newest checkpoint."
)


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") \
            from None
    if not values:  # an empty list once fell back to the defaults without a word
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    return values


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``compare`` to the CLI's subparsers."""
    p = sub.add_parser(
        "compare", help="train the same model with several optimizers and compare quality",
        description="Train one base config with several optimizer variants from the same\n"
                    "initial weights, data order and seeds; write a markdown table, a JSON\n"
                    "report and PNGs of eval loss and weight spectra.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="base YAML or JSON config")
    p.add_argument("--variant", action="append", dest="variants", metavar="NAME[:KEY=VALUE,...]",
                   help="a preset, or NAME:key=value,... with dotted config keys (values parsed "
                        "as YAML); a preset name with overrides starts from the preset. "
                        "Repeatable; the first is the baseline")
    p.add_argument("--steps", type=int, help="optimizer steps per run (default run.max_steps)")
    p.add_argument("--seeds", type=int, default=1,
                   help="seeds per variant: run.seed, run.seed+1, ... (default 1)")
    p.add_argument("--output-dir", default="compare-runs",
                   help="folder for run dirs and reports (default compare-runs)")
    p.add_argument("--lr-sweep", action="store_true",
                   help="first pick each variant's lr (muon_lr for Muon variants, lr for AdamW) "
                        "from short runs by eval loss")
    p.add_argument("--sweep-fraction", type=float, default=0.25,
                   help="sweep run length as a fraction of --steps (default 0.25)")
    p.add_argument("--lr-factors", type=_floats, default=None, metavar="F,F,...",
                   help="sweep points as multiples of the variant's lr (default 0.5,1,2)")
    p.add_argument("--eval-every", type=int,
                   help="eval interval in steps (default: the config's if it gives >= 10 evals, "
                        "else steps/10)")
    p.add_argument("--device", help="auto, cpu, cuda, cuda:N or mps (overrides run.device)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a base config key for every variant (repeatable)")


def run(args: argparse.Namespace) -> int:
    """Run the comparison and print the table; returns the exit code."""
    from ..train.host_memory import requested_for_cpu_runs
    from .api import DEFAULT_LR_FACTORS, run_compare

    command = "speedtronic " + " ".join(shlex.quote(a) for a in sys.argv[1:]) \
        if sys.argv and sys.argv[0].endswith(("speedtronic", "__main__.py")) else None
    try:
        with requested_for_cpu_runs():  # each CPU run's builder applies it (host_memory)
            result = run_compare(
                args.config, args.variants, overrides=args.overrides, steps=args.steps,
                seeds=args.seeds, output_dir=args.output_dir, lr_sweep=args.lr_sweep,
                sweep_fraction=args.sweep_fraction,
                lr_factors=args.lr_factors or DEFAULT_LR_FACTORS, eval_every=args.eval_every,
                device=args.device, command=command)
    except KeyboardInterrupt:
        print(f"speedtronic: compare interrupted; rerun the same command to resume (finished "
              f"runs in {args.output_dir} are kept)", file=sys.stderr)
        return 130
    print(result.table, end="", flush=True)  # run_compare logged the files it wrote
    return 0
