"""Validation rules shared by every config section: the error helper, the finite-number check
and the ``Literal`` choice check that :meth:`SpeedtronicConfig.finalize` runs over all sections.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from pathlib import Path
from typing import Any, Literal

from ..errors import ConfigError, brief

__all__ = ["INF_IS_NO_LIMIT", "byte_text_file", "check_choices", "check_finite", "require",
           "torchrun_world_size"]


def require(ok: bool, key: str, message: str) -> None:
    """Raise ``ConfigError("<key>: <message>")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}: {message}")


# Field metadata of the few floats where YAML ``.inf`` has a meaning: a wait without a limit.
INF_IS_NO_LIMIT = {"inf_is_no_limit": True}


def torchrun_world_size() -> int:
    """``WORLD_SIZE`` as torchrun sets it; 1 outside torchrun (or when it is not a number: the
    data-parallel setup reports that)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def check_finite(section: Any, prefix: str = "") -> None:
    """Refuse inf and NaN in every float field and float-list item of ``section`` (recursively).

    One check here instead of one per field: ``lr > 0`` is true for inf, and NaN slips past any
    rule written as ``not (x < 0)`` or on list items, and either ends a run in NaN losses.
    """
    for f in dataclasses.fields(section):
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(section, f.name)
        if f.type == "Any":  # user objects (data.dataset), not numbers we interpret
            continue
        if dataclasses.is_dataclass(value):
            check_finite(value, key)
            continue
        no_limit = bool(f.metadata.get("inf_is_no_limit"))
        is_list = isinstance(value, (list, tuple))
        for item in value if is_list else (value,):
            if isinstance(item, float) and not math.isfinite(item) \
                    and not (no_limit and item == math.inf):
                rule = "a finite number or .inf (no limit)" if no_limit else "a finite number"
                require(False, key, f"{'every item ' if is_list else ''}must be {rule}, "
                       f"got {brief(list(value) if is_list else value)}")


def check_choices(section: Any, prefix: str) -> None:
    """Refuse a value outside its ``Literal[...]`` choices in the fields of one section.

    The YAML loader checks these while parsing; this covers configs built in Python (e.g.
    ``OptimizerConfig(name="Muon")`` handed to ``build_optimizer``, which once built an
    all-AdamW optimizer without a word). Fields whose type mixes a Literal with other types
    (``compile: bool | "auto"``), and values that are not strings, are left to the section's own
    rules and to the code that reads them."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        hint = hints.get(f.name)
        if typing.get_origin(hint) is not Literal:
            continue
        choices = typing.get_args(hint)
        value = getattr(section, f.name)
        # Strings only: other values (a torch dtype for muon_ns_dtype, None) go to consumers
        # that accept or refuse them themselves, as before this check existed.
        if isinstance(value, str) and value not in choices:
            key = f"{prefix}.{f.name}" if prefix else f.name
            require(False, key, f"must be one of {', '.join(repr(c) for c in choices)}, "
                   f"got {brief(value)}")


def byte_text_file(spec: str) -> Path:
    """``data.text_path`` read as bytes (no ``data.tokenizer``): one existing file, ``~``
    expanded. The schema checks it at load and the data layer before reading (a config built
    in Python may skip the load); a folder once said "file not found"."""
    path = Path(str(spec)).expanduser()
    require(not path.is_dir() and not any(c in str(spec) for c in "*?["), "data.text_path",
            f"{brief(spec)} is a folder or a glob; read as bytes (no data.tokenizer) it must be "
            "one file. Give one file, or set data.tokenizer to tokenize a folder")
    require(path.is_file(), "data.text_path", f"file not found: {str(spec)!r}")
    return path
