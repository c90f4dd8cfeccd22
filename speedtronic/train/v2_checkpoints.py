"""Recognising speedtronic 2.0's checkpoints, so that pointing this version at one says what it
is instead of failing on a detail.

2.0 wrote ``<output_dir>/checkpoints/step_<12 digits>.pt`` beside a ``latest.json`` pointer,
with no digest files, as a pickle of Python objects; this version writes
``<output_dir>/<run.name>/checkpoints/step_<8 digits>.pt`` with a ``.sha256`` each and a
``latest`` pointer, loaded with ``weights_only=True``. Neither the layout nor the weights carry
over: 2.0's reference model names and shapes its tensors differently (for 2.0's own smoke
config, ``d_ff: 128``, its MLP is 88 wide and this version's 128). Met with a 2.0 checkpoint,
``--resume`` started a fresh run without naming it (it looked one folder deeper), and
``model.init_from`` asked for a digest file 2.0 never wrote and then called the file "written
by something else".
"""

from __future__ import annotations

import json
import re
from pathlib import Path

__all__ = ["V2_CHECKPOINT_ADVICE", "find_v2_checkpoints", "is_v2_checkpoint_file"]

_V2_NAME = re.compile(r"step_\d{12}\.pt")

V2_CHECKPOINT_ADVICE = ("this version cannot load speedtronic 2.0 checkpoints (2.0's reference "
                        "model names and shapes its weights differently, and its files are "
                        "pickles without digests); train a fresh run: the 2.0 files are left "
                        "as they are")
"""What a user pointed at a 2.0 checkpoint is told (after naming what was found)."""


def _is_v2_pointer(path: Path) -> bool:
    """``path`` is 2.0's ``latest.json``: ``{"step": int, "file": "step_<12 digits>.pt"}``."""
    try:
        pointer = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (isinstance(pointer, dict) and isinstance(pointer.get("file"), str)
            and _V2_NAME.fullmatch(pointer["file"]) is not None)


def is_v2_checkpoint_file(path: Path) -> bool:
    """``path`` is named as 2.0 named its checkpoints and has no digest of this version's."""
    return (_V2_NAME.fullmatch(path.name) is not None
            and not path.with_suffix(".sha256").exists())


def find_v2_checkpoints(*folders: Path) -> Path | None:
    """The first of ``folders`` (or its ``checkpoints/``) that holds 2.0's checkpoint layout:
    a 2.0 ``latest.json`` or ``step_<12 digits>.pt`` files."""
    for folder in folders:
        for candidate in (folder, folder / "checkpoints"):
            if not candidate.is_dir():
                continue
            if _is_v2_pointer(candidate / "latest.json"):
                return candidate
            if any(is_v2_checkpoint_file(p) for p in candidate.glob("step_*.pt")):
                return candidate
    return None
