"""``python -m speedtronic.diloco master --config run.yaml [--set k=v ...]``: a master that does
not train. Nodes run ``speedtronic train`` with ``distributed.role: worker``."""

from __future__ import annotations

import argparse
import logging
import sys

from ..config import load_config
from ..errors import SpeedtronicError
from .service import run_master


def main(argv: list[str] | None = None) -> int:
    """``python -m speedtronic.diloco master``: run a master-only aggregation loop until it stops,
    then print where the final global is. Returns the exit code (2 on a config or store error)."""
    parser = argparse.ArgumentParser(prog="python -m speedtronic.diloco")
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("master", help="run a master-only aggregation loop")
    m.add_argument("--config", required=True)
    m.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    m.add_argument("--expect-nodes", default="", help="comma-separated node ids to wait for")
    m.add_argument("--idle-timeout", type=float, default=None,
                   help="stop after this many seconds without a new delta (default: "
                        "distributed.master_idle_timeout; inf = no limit)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.set)
        expect = {n for n in args.expect_nodes.split(",") if n} or None
        master = run_master(cfg, expect_nodes=expect, idle_timeout=args.idle_timeout)
    except (SpeedtronicError, ValueError, OSError) as exc:  # OSError: what the CLI reports too
        print(f"speedtronic: error: {exc}", file=sys.stderr)
        return 2
    pointer = master.pointer
    if pointer is None:
        print("master done at v-1 (nothing published)")
        return 0
    # where the run's model is: the store object, and the node checkpoints that hold it
    print(f"master done at v{pointer.version}: the final global is {pointer.path} in "
          f"{master.store.url} (the last worker to finish, with distributed.final_sync_timeout > "
          "0, ends holding it in its final checkpoint, for speedtronic sample / export / "
          "model.init_from)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
