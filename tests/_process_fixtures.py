"""Real ``speedtronic`` processes for reliability tests: a driver that runs the CLI and, at the
end of optimizer step ``AT``, signals itself or pauses until the test lets it go on."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

# At the end of optimizer step AT: send SIG to itself (twice with TWICE, the second inside the
# checkpoint write the first asked for), or with PAUSE print "paused" and wait for a line on
# stdin. TOKEN_CHUNK shrinks the data loader's chunk, so token files are read during the run.
# START_METHOD sets multiprocessing's (DataLoader workers: fork, forkserver, spawn). With
# PGROUP the signal goes to the whole process group (REPEAT: twice, as under torchrun).
DRIVER = textwrap.dedent("""
    import os, signal, sys
    if __name__ == "__main__":  # spawned DataLoader workers import this file as __mp_main__
        if os.environ.get("START_METHOD"):
            import multiprocessing
            multiprocessing.set_start_method(os.environ["START_METHOD"])
        from speedtronic.cli import main
        from speedtronic.train import checkpoint, trainer
        if os.environ.get("TOKEN_CHUNK"):
            import speedtronic.data.build as build
            build.TOKEN_CHUNK = int(os.environ["TOKEN_CHUNK"])
        at, sig = int(os.environ["AT"]), getattr(signal, os.environ.get("SIG", "SIGTERM"))
        original = trainer.Trainer._call
        sent = []
        def _call(self, name, *args):
            original(self, name, *args)
            if name == "after_optimizer_step" and args[0] == at:
                if os.environ.get("PAUSE"):
                    print("paused", flush=True)
                    sys.stdin.readline()
                else:
                    sent.append(sig)
                    if os.environ.get("PGROUP"):  # a terminal's Ctrl-C, SLURM's scancel
                        os.killpg(os.getpgid(0), sig)
                        if os.environ.get("REPEAT"):  # and torchrun's forwarded copy of it
                            os.killpg(os.getpgid(0), sig)
                    else:
                        os.kill(os.getpid(), sig)
        trainer.Trainer._call = _call
        if os.environ.get("TWICE"):
            write = checkpoint._HashingWriter.write
            def write_then_signal(self, data):
                if sent and self.written > 2048:  # inside the save the first signal asked for
                    os.kill(os.getpid(), sig)
                return write(self, data)
            checkpoint._HashingWriter.write = write_then_signal
        sys.exit(main(sys.argv[1:]))
""")


def launch_cli(tmp_path: Path, cfg: Path, at: int, *extra: str, stdin=None,
               **env: str) -> subprocess.Popen:
    """``speedtronic train --config cfg *extra`` under the driver (text pipes); with
    ``PGROUP`` in a session of its own, whose whole process group it signals."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    return subprocess.Popen([sys.executable, str(driver), "train", "--config", str(cfg), *extra],
                            env={**os.environ, "AT": str(at), "OMP_NUM_THREADS": "1", **env},
                            stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=bool(env.get("PGROUP")))


def wait_for_pause(proc: subprocess.Popen) -> None:
    """Read the run's console (its log lines come first) up to the driver's "paused"."""
    for line in proc.stdout:
        if line.strip() == "paused":
            return
    raise AssertionError(f"the run ended before it paused: {proc.stderr.read()[-2000:]}")


def resume_run(proc: subprocess.Popen) -> tuple[str, str]:
    """Let a paused run go on; its (stdout, stderr) once it ends."""
    proc.stdin.write("\n")
    proc.stdin.flush()
    return proc.communicate(timeout=300)
