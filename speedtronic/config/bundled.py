"""The example configs that ship with the package: ``--config quickstart`` without a clone.

A wheel carries the repository's ``configs/*.yaml`` as ``speedtronic/configs/`` (``setup.py``
copies them at build time); a checkout or editable install reads ``configs/`` beside the
package. A ``--config`` value that is not a file and has no directory part is looked up here by
name, with or without ``.yaml``: after a wheel install, ``speedtronic train --config
quickstart`` is the README's main job with nothing else on disk. An existing file always wins
(``quickstart`` or ``quickstart.yaml``, config/loading.py), so a user's own
``quickstart.yaml`` in the working directory is never shadowed.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["bundled_config", "bundled_config_names"]

_PACKAGE = Path(__file__).resolve().parents[1]      # .../speedtronic
_IN_WHEEL = _PACKAGE / "configs"
_CHECKOUT = _PACKAGE.parent / "configs"


def _folders() -> list[Path]:
    """Where bundled configs live: the wheel's copy, else a checkout's ``configs/`` (only
    beside this project's ``pyproject.toml``: in site-packages a stray top-level ``configs``
    folder of another distribution must not be read as ours)."""
    found = [_IN_WHEEL] if _IN_WHEEL.is_dir() else []
    if _CHECKOUT.is_dir() and (_PACKAGE.parent / "pyproject.toml").is_file():
        found.append(_CHECKOUT)
    return found


def bundled_config_names() -> list[str]:
    """Names ``--config`` accepts without a path (sorted, no suffix)."""
    return sorted({p.stem for folder in _folders() for p in folder.glob("*.yaml")})


def bundled_config(name: str) -> Path | None:
    """The bundled config called ``name`` (``quickstart`` or ``quickstart.yaml``), or None;
    a value with a directory part is a path, never a name."""
    if not name or Path(name).name != name or name.startswith("."):
        return None
    stem = name[:-len(".yaml")] if name.endswith(".yaml") else name
    for folder in _folders():
        candidate = folder / f"{stem}.yaml"
        if candidate.is_file():
            return candidate
    return None
