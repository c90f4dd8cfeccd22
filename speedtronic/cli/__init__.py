"""The ``speedtronic`` command: train | validate | prepare | env | plot | sample | export | compare.

Every subcommand is two functions, ``_add_<name>(subparsers)`` and ``_cmd_<name>(args)``,
listed in :data:`SUBCOMMANDS`; adding one (e.g. ``compare``) is one entry plus those two
functions. Heavy imports (torch) happen inside the ``_cmd_*`` functions, so ``--help`` and
``validate --config-only`` never load torch (``validate`` runs train's checks, which do).

Any error a user can cause prints one line ``speedtronic: error: ...`` on stderr and exits 2;
``--debug`` shows the traceback instead. A run stopped by a preemption signal (after saving)
exits 128 + the signal number (143 SIGTERM, 130 SIGINT), or 0 once its SLURM job is requeued.
A SIGTERM while ``prepare`` writes (alone or on ``train``'s first use) removes its temporary
folder and exits 143 with one line.

The top layer: it may import every package (heavy ones lazily, inside ``_cmd_*``); nothing in
the package imports it. :mod:`.env` is the ``speedtronic env`` report.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import RunPreempted, SpeedtronicError, Terminated, mask_secrets
from .console import console_for_output, setup_logging, stdout_to_devnull

EXIT_USER_ERROR = 2
_USER_ERRORS = (SpeedtronicError, ValueError, FileNotFoundError, OSError)


# ----------------------------------------------------------------------------------- train
def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train from a YAML/JSON config")
    p.add_argument("--config", required=True, help="YAML or JSON config file")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest valid checkpoint in the run directory")
    p.add_argument("--device", help="auto, cpu, cuda, cuda:N or mps (overrides run.device)")
    p.add_argument("--max-steps", type=int, help="optimizer steps (overrides run.max_steps)")
    p.add_argument("--output-dir", help="base folder of run directories (run.output_dir)")
    _add_set(p)


def _add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set optimizer.lr=1e-3 (repeatable, "
                        "values parsed as YAML)")


def _cmd_train(args: argparse.Namespace) -> int:
    from ..config import load_config

    overrides = list(args.overrides)
    if args.max_steps is not None:
        overrides.append(f"run.max_steps={args.max_steps}")
    if args.output_dir is not None:
        overrides.append(f"run.output_dir={json.dumps(args.output_dir)}")
    if args.device is not None:
        overrides.append(f"run.device={json.dumps(args.device)}")
    cfg = load_config(args.config, overrides)

    from ..train.host_memory import requested_for_cpu_runs
    from ..train.runtime import train_from_config

    with requested_for_cpu_runs():  # applied by the run builder once the device is the CPU
        result = train_from_config(cfg, resume=args.resume)

    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.4f}"

    from ..distributed import launched_rank

    if launched_rank() == 0:  # under torchrun: one line for the job, from rank 0
        print(f"done: steps={result.steps} tokens={result.tokens} loss={fmt(result.final_loss)} "
              f"eval_loss={fmt(result.final_eval_loss)} run_dir={result.run_dir}", flush=True)
    return 0


# ----------------------------------------------------------------------------------- prepare
def _add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="tokenize data.text_path / data.hf_dataset into cached "
                                       "token shards (train also does it on first use)")
    p.add_argument("--config", required=True, help="YAML or JSON config file")
    p.add_argument("--workers", type=_positive_int, help="tokenizer processes, > 0 (default: "
                                                         "data.prepare_workers, else one per "
                                                         "CPU core)")
    _add_set(p)


def _positive_int(text: str) -> int:
    """``--workers``: 0 used to mean the default silently and negatives were logged as is."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer (tokenizer processes), "
                                         f"got {text!r}")
    return value


def _cmd_prepare(args: argparse.Namespace) -> int:
    from ..config import load_config
    from ..data.prepare import prepare

    cfg = load_config(args.config, args.overrides)
    meta = prepare(cfg, workers=args.workers)
    print(f"prepared: {meta['tokens']} tokens, vocab {meta['vocab_size']}, "
          f"{len(meta['shards'])} shard(s) in {meta['directory']} "
          f"({meta['tokens_per_second']} tokens/s when tokenized)", flush=True)
    return 0


# ----------------------------------------------------------------------------------- validate
def _add_validate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check a config as train would before it starts "
                                        "(model, sizes, data files, run directory) and print "
                                        "it resolved (secrets redacted)")
    p.add_argument("--config", required=True, help="YAML or JSON config file")
    p.add_argument("--format", choices=("yaml", "json"), default="yaml")
    p.add_argument("--config-only", action="store_true",
                   help="check the config's keys and values only (no torch import, no files)")
    _add_set(p)


def _strict_json(data: Any) -> str:
    """JSON without ``Infinity`` (not JSON; a DiLoCo wait may be ``.inf``, "no limit"): an
    infinite float is written as ``1e999``, which JSON readers and our loader read back as inf."""
    marker = "\x00speedtronic-inf\x00"

    def swap(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        if isinstance(value, list):
            return [swap(v) for v in value]
        if isinstance(value, float) and math.isinf(value):
            return marker if value > 0 else "-" + marker
        return value

    text = json.dumps(swap(data), indent=2, allow_nan=False)
    return text.replace(json.dumps("-" + marker), "-1e999").replace(json.dumps(marker), "1e999")


def _cmd_validate(args: argparse.Namespace) -> int:
    import yaml

    from ..config import load_config

    with console_for_output():  # stdout holds the config alone (a bundled name logs a line)
        cfg = load_config(args.config, args.overrides)
    if not args.config_only:
        from ..train.preflight import preflight

        with console_for_output():
            lines = preflight(cfg)
        for line in lines:
            print(f"ok: {line}", file=sys.stderr)
    data = cfg.to_dict(redact=True)
    if args.format == "json":
        print(_strict_json(data))
    else:
        print(yaml.safe_dump(data, sort_keys=False), end="")
    return 0


# ----------------------------------------------------------------------------------- env
def _add_env(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="print versions, devices, threads and kernel status")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _cmd_env(args: argparse.Namespace) -> int:
    from .env import collect_env, format_env

    # Collecting the kernel status loads the kernels, whose loader logs its decision line: the
    # report already holds it (kernels.reason), and with --json stdout must be JSON alone.
    with console_for_output():
        info = collect_env()
    print(_strict_json(info) if args.json else format_env(info))
    return 0


# ----------------------------------------------------------------------------------- plot
def _add_plot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="PNG of train/eval loss curves, one line per run")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("-o", "--output", help="PNG path (default: <first RUN_DIR>/loss.png)")


def _cmd_plot(args: argparse.Namespace) -> int:
    from ..train.plot import plot_runs

    print(f"wrote {plot_runs(args.run_dirs, args.output)}")
    return 0


# name -> (add its parser, run it). Append new subcommands here.
SUBCOMMANDS: dict[str, tuple[Callable[[argparse._SubParsersAction], None],
                             Callable[[argparse.Namespace], int]]] = {
    "train": (_add_train, _cmd_train),
    "prepare": (_add_prepare, _cmd_prepare),
    "validate": (_add_validate, _cmd_validate),
    "env": (_add_env, _cmd_env),
    "plot": (_add_plot, _cmd_plot),
    "sample": (lambda sub: _models_command().add_sample(sub),
               lambda args: _models_command().cmd_sample(args)),
    "export": (lambda sub: _models_command().add_export(sub),
               lambda args: _models_command().cmd_export(args)),
    "compare": (lambda sub: _compare_command().add_parser(sub),
                lambda args: _compare_command().run(args)),
}


def _models_command():  # speedtronic/cli/models.py: sample and export (torch inside)
    from . import models

    return models


def _compare_command():  # speedtronic/compare/command.py (imports no torch)
    from ..compare import command

    return command


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # same one-line format and exit code as our errors
        self.print_usage(sys.stderr)
        self.exit(EXIT_USER_ERROR, f"speedtronic: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``speedtronic`` argument parser: one subcommand per :data:`SUBCOMMANDS` entry, each also
    taking ``--debug`` after its name."""
    from .. import __version__

    parser = _Parser(prog="speedtronic", description="Speedtronic training engine")
    parser.add_argument("--version", action="version", version=f"speedtronic {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show full tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for add, _ in SUBCOMMANDS.values():
        add(sub)
    for command in sub.choices.values():  # `speedtronic train --debug ...` works too
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show full tracebacks and debug logs")
    return parser


#: Characters of one error line: enough for any message of ours, not for an echoed blob.
_MAX_ERROR_LINE = 2000


def _one_line(exc: BaseException) -> str:
    """The error as one line, credentials masked (a message may quote a URL or a value the user
    gave) and bounded in length."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, OSError) and not isinstance(exc, SpeedtronicError) and exc.filename:
        text = f"{exc.strerror or text}: {exc.filename!r}"
    text = mask_secrets(text)
    return text if len(text) <= _MAX_ERROR_LINE else text[:_MAX_ERROR_LINE - 3] + "..."


def _stdout_closed() -> bool:
    """Whether stdout's reader is gone (a broken pipe from elsewhere, a store socket say, is a
    real error and is reported)."""
    import select

    try:
        poller = select.poll()  # a pipe whose reader is gone polls POLLERR on the write end
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & (select.POLLERR | select.POLLHUP) for _, event in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll() (Windows), or no real stdout
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``speedtronic`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(debug)
    try:
        return SUBCOMMANDS[args.command][1](args)
    except BrokenPipeError as exc:
        if debug or not _stdout_closed():
            if debug:
                raise
            print(f"speedtronic: error: {_one_line(exc)}", file=sys.stderr)
            return EXIT_USER_ERROR
        # The reader of our stdout went away (`speedtronic env | head`): not an error of ours.
        stdout_to_devnull()
        return 141  # 128 + SIGPIPE, what a shell reports for a command killed by it
    except _USER_ERRORS as exc:
        if debug:
            raise
        print(f"speedtronic: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except RunPreempted as exc:  # a signal asked for it; the checkpoint is saved
        print(f"speedtronic: {_one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("speedtronic: interrupted", file=sys.stderr)
        return 130
    except Terminated as exc:  # SIGTERM while a command cleaned up after itself (prepare)
        print(f"speedtronic: {exc}", file=sys.stderr)
        return exc.exit_code


def console_main() -> None:
    """The ``speedtronic`` console script and ``python -m speedtronic``: :func:`main`, then exit.

    ``gc.freeze()`` first: the interpreter's final garbage collections walk every object torch
    created at import, ~0.22 s of each CLI run (``python -c "import torch"``: 1.24 s, with a
    freeze before exit 1.02 s). Objects freed by reference counting are still released at
    shutdown (atexit handlers run; logs, metrics and checkpoints are closed by the commands
    themselves); only garbage held in reference cycles is left uncollected, which a process
    about to exit does not need.
    """
    # `python -m speedtronic` finds `data.dataset: mymodule:make` in the working directory; so
    # does the console script. Appended, so an installed package of the same name still wins.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    code = main()
    gc.freeze()
    if os.environ.get("WORLD_SIZE", "1").strip() not in ("", "0", "1"):
        # a torchrun rank (its process group is destroyed by now): see exit_after_distributed
        from ..distributed.process_group import exit_after_distributed

        exit_after_distributed(code)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
