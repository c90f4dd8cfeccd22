"""Durable, verifiable, resumable checkpoints.

Layout of ``<run dir>/checkpoints/``::

    step_00000100.pt        torch.save of a dict of tensors / plain Python values
    step_00000100.sha256    hex digest of the .pt file (written before the .pt is renamed in)
    latest                  name of the newest committed checkpoint (one line)

Write protocol (each step survives a crash at any instant): stream the state into a hidden temp
file while hashing it -> fsync -> write the digest file atomically -> rename the temp file onto
its final name -> fsync the directory -> rewrite ``latest`` atomically -> prune old checkpoints.
A crash leaves at worst an orphaned temp file (removed at the next start) and an older ``latest``
(which protects its checkpoint from pruning; loading takes the newest intact step).

Loading never unpickles arbitrary objects: ``torch.load(weights_only=True)``. A checkpoint whose
digest does not match, whose digest file is missing (every save writes it before the checkpoint
appears, and pruning deletes it last, so only a copy or a hand edit loses it), or that fails to
load, is skipped with a warning and the next older one is used, so one torn or bit-flipped file
never loses a run. Bit flips inside tensor data still unpickle fine: without the digest nothing
would notice them.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import random
import re
import signal
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from .._process import temp_owner_alive
from ..errors import SpeedtronicError
from .precision import mps_available as _mps_available  # (a test stands one in)
from .v2_checkpoints import V2_CHECKPOINT_ADVICE, is_v2_checkpoint_file

logger = logging.getLogger("speedtronic.checkpoint")

_NAME_RE = re.compile(r"^step_(\d{8,})\.pt$")
# Test hook for crash-safety tests: "<step>:<point>" makes the writer SIGKILL its own process at
# that point of the save of that step. Points: mid_write, before_rename, before_pointer.
CRASH_ENV = "SPEEDTRONIC_CHECKPOINT_CRASH"


class CheckpointError(SpeedtronicError):
    """No usable checkpoint, or a checkpoint that does not fit the run."""


def _crash_point(step: int, point: str) -> None:
    spec = os.environ.get(CRASH_ENV)
    if spec and spec == f"{step}:{point}":
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (POSIX); a no-op where directories cannot be opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs_durable(directory: Path) -> None:
    """``mkdir -p`` whose new folders survive a power cut: each one created is fsynced into its
    parent (a rename into a folder whose own entry was never made durable can vanish with it)."""
    missing = []
    probe = directory
    while not probe.is_dir():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    directory.mkdir(parents=True, exist_ok=True)
    for new in reversed(missing):
        _fsync_dir(new.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via temp file + fsync + rename + directory fsync."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


class _HashingWriter:
    """File wrapper for ``torch.save``: hashes what it writes; can crash mid-write for tests."""

    def __init__(self, f: BinaryIO, crash_after: int | None) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.written = 0
        self._crash_after = crash_after
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        if self._crash_after is not None and self.written + len(data) >= self._crash_after:
            cut = max(0, self._crash_after - self.written)
            self._f.write(bytes(memoryview(data)[:cut]))
            self._f.flush()
            os.fsync(self._f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        self.sha.update(data)
        self.written += len(data)
        try:
            return self._f.write(data)
        except OSError as exc:  # torch.save reports only "unexpected pos"; keep the cause
            self.error = exc
            raise

    def flush(self) -> None:
        self._f.flush()


def _sha256_file(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


class CheckpointManager:
    """Saves, lists, prunes and loads checkpoints of one run.

    Args:
        directory: checkpoint folder (created on first save).
        keep_last: keep the newest N checkpoints (None keeps all).
        owner: this process writes the run (it holds the run directory's lock): it removes
            what interrupted saves left behind. A reader (``sample``, ``export``, ``--resume``'s
            lookup) deletes nothing: on another host or in another container it cannot see the
            writer's pid, and it once deleted a live run's checkpoint mid-write.
    """

    def __init__(self, directory: str | Path, keep_last: int | None = 3, *,
                 owner: bool = False) -> None:
        self.directory = Path(directory)
        self.keep_last = keep_last
        if owner:
            self._remove_stale_temp_files()

    def _remove_stale_temp_files(self) -> None:
        if not self.directory.is_dir():
            return
        for digest in self.directory.glob("step_*.sha256"):
            # a prune or a save killed between its two files: a digest without its checkpoint
            if _NAME_RE.match(digest.with_suffix(".pt").name) and \
                    not digest.with_suffix(".pt").exists():
                logger.info("checkpoint: removing %s (its checkpoint is gone)", digest.name)
                digest.unlink(missing_ok=True)
        for tmp in self.directory.glob(".*.tmp-*"):
            if temp_owner_alive(tmp):  # another live process is writing it: not ours to delete
                logger.info("checkpoint: leaving %s alone (its writer, pid %s, is alive)", tmp,
                            tmp.name.rsplit("-", 1)[-1])
                continue
            logger.info("checkpoint: removing unfinished temp file %s (an interrupted save)", tmp)
            tmp.unlink(missing_ok=True)

    def probe_writable(self) -> None:
        """Create the folder and write and remove a probe file now, so an unwritable folder
        (read-only mount, permissions, a file in the way) stops the run before its first
        step instead of at its first save, after all the work before it."""
        probe = self.directory / f".write-probe-{os.getpid()}"
        try:
            make_dirs_durable(self.directory)
            with open(probe, "wb") as f:
                f.write(b"probe")
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            import errno as _errno

            fix = ("free space there (the disk is full)" if exc.errno in (
                _errno.ENOSPC, _errno.EDQUOT) else "fix its permissions")
            raise CheckpointError(f"checkpoint folder {self.directory} is not writable "
                                  f"({exc.strerror or exc}); {fix} or set "
                                  "checkpoint.directory / run.output_dir to a writable "
                                  "place, or checkpoint.enabled: false") from None
        finally:
            with contextlib.suppress(OSError):  # e.g. NotADirectoryError: nothing was made
                probe.unlink(missing_ok=True)

    def path_for(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}.pt"

    def list(self) -> list[tuple[int, Path]]:
        """Committed checkpoints as (step, path), newest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for p in self.directory.iterdir():
            m = _NAME_RE.match(p.name)
            if m:
                found.append((int(m.group(1)), p))
        return sorted(found, reverse=True)

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Durably write ``state`` as the checkpoint of ``step`` and point ``latest`` at it.

        A failed write (disk full, quota, I/O error) raises one :class:`CheckpointError` naming
        the cause; the temp file is removed and every committed checkpoint, and ``latest``, are
        as they were."""
        final = self.path_for(step)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        spec = os.environ.get(CRASH_ENV)
        crash_after = 4096 if spec == f"{step}:mid_write" else None
        writer: _HashingWriter | None = None
        try:
            make_dirs_durable(self.directory)
            with open(tmp, "wb") as f:
                writer = _HashingWriter(f, crash_after)
                torch.save(state, writer)  # type: ignore[arg-type]
                f.flush()
                os.fsync(f.fileno())
            atomic_write_text(final.with_suffix(".sha256"), writer.sha.hexdigest() + "\n")
            _crash_point(step, "before_rename")
            os.replace(tmp, final)
            _fsync_dir(self.directory)
        except (OSError, RuntimeError) as exc:  # torch.save reports a failed write as a
            # RuntimeError ("unexpected pos"); the writer kept the OSError behind it
            raise self._save_failed(step, writer.error if writer is not None
                                    and writer.error is not None else exc) from None
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        _crash_point(step, "before_pointer")
        try:
            atomic_write_text(self.directory / "latest", final.name + "\n")
        except OSError as exc:  # the checkpoint is committed; a scan finds it without latest
            raise CheckpointError(
                f"step {step} is saved ({final.name}), but updating "
                f"{self.directory / 'latest'} failed: {exc.strerror or exc}; --resume finds "
                f"{final.name} without it. Free space and train again with --resume") from None
        self.prune()
        return final

    def _save_failed(self, step: int, exc: BaseException) -> CheckpointError:
        cause: BaseException = exc
        while not isinstance(cause, OSError) and cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(cause, OSError) and cause.errno is not None:
            import errno as _errno

            why = f"{cause.strerror} ({_errno.errorcode.get(cause.errno, cause.errno)})"
        else:
            why = " ".join(str(exc).split())[:200] or type(exc).__name__
        kept = self.list()
        final, digest = self.path_for(step), self.path_for(step).with_suffix(".sha256")
        with contextlib.suppress(OSError):  # this save's digest must not outlive its failure
            if not final.exists():
                digest.unlink(missing_ok=True)
            elif digest.read_text(encoding="utf-8").strip() != _sha256_file(final):
                # a forced re-save of a saved step failed after writing its digest: the digest
                # must describe the file still in place, or that checkpoint would read corrupt
                atomic_write_text(digest, _sha256_file(final) + "\n")
        newest = f"the newest, {kept[0][1].name}, is intact" if kept else "none was saved yet"
        import errno as _errno

        full = isinstance(cause, OSError) and cause.errno in (_errno.ENOSPC, _errno.EDQUOT)
        advice = ("Free space (or raise the quota)" if full else
                  "Fix the cause (the folder must stay writable and nothing else may write in "
                  "it)")
        return CheckpointError(f"saving the checkpoint of step {step} in {self.directory} "
                               f"failed: {why}; committed checkpoints are untouched ({newest}). "
                               f"{advice} and train again with --resume")

    def prune(self) -> None:
        """Delete all but the newest ``keep_last`` checkpoints (never the one ``latest`` names)."""
        if self.keep_last is None:
            return
        pointed = self._pointer()
        for _, path in self.list()[self.keep_last:]:
            if pointed is not None and path.name == pointed.name:
                continue
            path.unlink(missing_ok=True)
            path.with_suffix(".sha256").unlink(missing_ok=True)

    def _pointer(self) -> Path | None:
        try:
            name = (self.directory / "latest").read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            # A damaged pointer (one flipped bit made it undecodable) must not block a resume
            # from intact checkpoints: scan them instead, newest first.
            if not isinstance(exc, FileNotFoundError):
                logger.warning("checkpoint: %s/latest is unreadable (%s); using the newest "
                               "intact checkpoint instead", self.directory, type(exc).__name__)
            return None
        return self.directory / name if _NAME_RE.match(name) else None

    def candidates(self) -> list[Path]:
        """Paths to try, in order: newest step first. ``latest`` is not consulted: a save that
        crashed (or failed to write the pointer) after its checkpoint was committed leaves
        ``latest`` one save behind, and following it once resumed a whole save interval before
        the newest intact checkpoint (a pointer edited by hand did the same)."""
        return [p for _, p in self.list()]

    def load_latest(self) -> tuple[dict[str, Any], Path] | None:
        """Load the newest valid checkpoint; falls back past corrupt ones. None if there is none."""
        candidates = self.candidates()
        for i, path in enumerate(candidates):
            try:
                state = self.load(path)
            except CheckpointError as exc:
                nxt = candidates[i + 1].name if i + 1 < len(candidates) else None
                logger.warning("checkpoint: %s; %s", exc,
                               f"falling back to {nxt}" if nxt else "no older checkpoint left")
                continue
            pointed = self._pointer()
            if pointed is not None and pointed.name != path.name and i == 0:
                logger.info("checkpoint: latest names %s, but %s is newer and intact (a save "
                            "ended before its pointer update); using %s", pointed.name,
                            path.name, path.name)
            return state, path
        if candidates:
            raise CheckpointError(f"no usable checkpoint in {self.directory} ({len(candidates)} "
                                  "found, all corrupt, unverifiable or unloadable: see the "
                                  "warnings above)")
        return None

    def load(self, path: str | Path, *, verify: bool = True) -> dict[str, Any]:
        """Verify ``path`` against its digest and load it with ``weights_only=True``.

        ``verify=False`` skips the digest (for a checkpoint copied without its ``.sha256``, at
        your own risk); otherwise a missing or unreadable digest is a :class:`CheckpointError`.
        """
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} does not exist" if not path.exists()
                                  else f"checkpoint {str(path)!r} is not a file")
        if is_v2_checkpoint_file(path):
            raise CheckpointError(f"{path.name} is a speedtronic 2.0 checkpoint: "
                                  f"{V2_CHECKPOINT_ADVICE}")
        digest_file = path.with_suffix(".sha256")
        if verify:
            try:
                expected = digest_file.read_text(encoding="utf-8").strip()
            except OSError:
                raise CheckpointError(f"{path.name} cannot be verified: its digest file "
                                      f"{digest_file.name} is missing or unreadable (every save "
                                      "writes one; copy it along with the checkpoint)") from None
            if _sha256_file(path) != expected:
                raise CheckpointError(f"{path.name} is corrupt (sha256 mismatch)")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            # torch's own message suggests weights_only=False, i.e. running the file's code:
            # never the advice for a file that is not what a Speedtronic save writes.
            found = re.search(r"GLOBAL (\S+)|Unsupported global: (\S+)", str(exc))
            what = f" ({(found.group(1) or found.group(2)).rstrip(',')})" if found else ""
            raise CheckpointError(f"{path.name} cannot be loaded: it holds Python objects "
                                  f"beyond tensors and plain values{what}, refused unopened "
                                  "(loading it could run code). Speedtronic checkpoints never "
                                  "hold such objects: something else wrote this file") from None
        except Exception as exc:  # torn zip, I/O error
            raise CheckpointError(f"{path.name} cannot be loaded ({type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0][:300] if str(exc) else ''})"
                                  ) from None
        if not isinstance(state, dict) or "model" not in state or "step" not in state:
            raise CheckpointError(f"{path.name} is not a Speedtronic checkpoint")
        return state


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU, (if initialized) every CUDA generator and, on a Mac, the MPS
    generator, as load-safe values."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        # The NumPy key array is uint32; store it as int64 so weights_only loading accepts it.
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]),
                  int(np_state[3]), float(np_state[4])),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if _mps_available():  # dropout on MPS draws from its own generator
        state["mps"] = torch.mps.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state` (CUDA states only if the device count matches)."""
    random.setstate(_tuples(state["python"]))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            logger.warning("checkpoint: saved %d CUDA RNG states but %d devices exist; CUDA RNG "
                           "not restored (dropout masks will differ)", len(cuda),
                           torch.cuda.device_count())
    if state.get("mps") is not None and _mps_available():
        torch.mps.set_rng_state(state["mps"])


def _tuples(value: Any) -> Any:
    """``random.setstate`` needs tuples; some serializers hand back lists."""
    if isinstance(value, (list, tuple)):
        return tuple(_tuples(v) for v in value)
    return value


def mismatch_details(exc: RuntimeError) -> str:
    """What ``load_state_dict``'s error says after its first line (which only reads "Error(s)
    in loading state_dict for X:"): the missing, unexpected and mis-shaped tensors, first 3."""
    details = [line.strip() for line in str(exc).splitlines()[1:] if line.strip()]
    return ("; ".join(details[:3]) or str(exc))[:600]
