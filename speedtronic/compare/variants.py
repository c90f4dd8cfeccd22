"""Optimizer variants for ``speedtronic compare``: presets, ``--variant`` parsing, resolution.

A variant is a name plus a list of dotted config overrides (``optimizer.muon_lr=0.05``). Every
variant is resolved against the same base config through :func:`speedtronic.config.load_config`,
so an unknown key or a bad value fails with the usual message naming the key. Keys that would
break the comparison (model, data, seed, run identity, checkpoints) are refused: compare holds
them fixed so every variant starts from the same weights and sees the same batches.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import ConfigError, SpeedtronicConfig, load_config

__all__ = ["PRESETS", "Variant", "parse_variant", "parse_variants", "resolve_variant",
           "sweep_key"]

# Each preset sets all three optimizer switches explicitly, so a base config that already says
# ``cautious: true`` cannot leak into the plain ``adamw`` / ``muon`` rows.
PRESETS: dict[str, tuple[str, ...]] = {
    "adamw": ("optimizer.name=adamw", "optimizer.muon_plus=false", "optimizer.cautious=false"),
    "muon": ("optimizer.name=muon", "optimizer.muon_plus=false", "optimizer.cautious=false"),
    "muon_plus": ("optimizer.name=muon", "optimizer.muon_plus=true", "optimizer.cautious=false"),
    "cautious_adamw": ("optimizer.name=adamw", "optimizer.muon_plus=false",
                       "optimizer.cautious=true"),
    "cautious_muon": ("optimizer.name=muon", "optimizer.muon_plus=false",
                      "optimizer.cautious=true"),
}
"""Preset name -> overrides. ``--variant muon`` uses the preset as is; ``--variant
muon:optimizer.muon_lr=0.05`` starts from the preset and adds the overrides."""

# Sections / root keys compare owns or holds fixed across variants (first dotted component).
_FIXED_KEYS = {
    "run": "compare sets the run name, seed, steps and output directory itself",
    "name": "compare names each run itself", "seed": "use --seeds; every variant shares seeds",
    "device": "use --device", "max_steps": "use --steps", "output_dir": "use --output-dir",
    "model": "every variant trains the same model from the same initial weights",
    "data": "every variant sees the same batches in the same order",
    "checkpoint": "compare manages checkpoints to make runs resumable",
    "distributed": "compare runs single-process training",
}
# Root shorthands rewritten to their long form, so a preset's explicit value and the user's
# shorthand do not trip load_config's "conflicting values" check.
_SHORTHANDS = {"muon_plus": "optimizer.muon_plus", "cautious": "optimizer.cautious",
               "optimizer": "optimizer.name", "precision": "precision.mode",
               "log_every": "logging.every_steps"}
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")
_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclass(frozen=True)
class Variant:
    """One row of the comparison: a name and the overrides applied on top of the base config."""

    name: str
    """Label in the table and the run directory prefix."""
    overrides: tuple[str, ...] = ()
    """``key=value`` strings (values parsed as YAML), preset overrides first."""
    preset: str | None = None
    """The preset this variant starts from, if its name is one."""
    user_overrides: tuple[str, ...] = field(default=(), compare=False)
    """Only the overrides the user wrote (for the report)."""

    def describe(self) -> str:
        """``muon + optimizer.muon_lr=0.05`` style one-liner for tables and logs."""
        parts = [self.preset] if self.preset else []
        parts += list(self.user_overrides)
        return " + ".join(parts) if parts else "(base config)"


def _split_items(body: str, spec: str) -> list[str]:
    """Split ``a=1,b=[1,2],c='x,y'`` on commas outside brackets and quotes."""
    items, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(body):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(body[start:i])
            start = i + 1
    if quote or depth != 0:
        raise ConfigError(f"--variant {spec!r}: unbalanced brackets or quotes")
    items.append(body[start:])
    return [item.strip() for item in items if item.strip()]


def parse_variant(spec: str) -> Variant:
    """Parse ``NAME`` (a preset) or ``NAME:key=value,key=value``.

    Raises:
        ConfigError: bad syntax, an unknown preset without overrides, or a key compare holds
            fixed. Unknown config keys are caught later by :func:`resolve_variant`.
    """
    name, _, body = spec.partition(":")
    name = name.strip()
    if not _NAME_RE.fullmatch(name):
        raise ConfigError(f"--variant {spec!r}: the name must be 1-64 of [A-Za-z0-9_.+-] "
                          "starting with a letter or digit (form NAME or NAME:key=value,...)")
    preset = name if name in PRESETS else None
    items = _split_items(body, spec)
    if preset is None and not items:
        raise ConfigError(f"--variant {name!r}: unknown preset; presets: {', '.join(PRESETS)} "
                          f"(or define one: {name}:optimizer.name=muon,optimizer.muon_lr=0.05)")
    user: list[str] = []
    seen: set[str] = set()
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not _KEY_RE.fullmatch(key):
            raise ConfigError(f"--variant {spec!r}: expected key=value with a dotted config key, "
                              f"got {item!r}")
        key = _SHORTHANDS.get(key, key)
        head = key.split(".")[0]
        if head in _FIXED_KEYS:
            raise ConfigError(f"--variant {name}: key '{key}' cannot vary between variants "
                              f"({_FIXED_KEYS[head]})")
        if key in seen:
            raise ConfigError(f"--variant {name}: key '{key}' is given twice")
        seen.add(key)
        user.append(f"{key}={value.strip()}")
    return Variant(name=name, overrides=PRESETS.get(name, ()) + tuple(user), preset=preset,
                   user_overrides=tuple(user))


def parse_variants(specs: Sequence[str] | None) -> list[Variant]:
    """Parse every ``--variant``; none given means all presets, ``adamw`` first (the baseline)."""
    variants = [parse_variant(s) for s in specs] if specs else \
        [Variant(name=n, overrides=o, preset=n) for n, o in PRESETS.items()]
    names = [v.name for v in variants]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"--variant: duplicate variant name(s) {', '.join(dupes)}; "
                          "give each variant its own name")
    return variants


def sweep_key(cfg: SpeedtronicConfig) -> str:
    """The learning rate that matters for a variant: Muon's for hybrid Muon, AdamW's otherwise."""
    return "optimizer.muon_lr" if cfg.optimizer.name == "muon" else "optimizer.lr"


def resolve_variant(source: str | Path | Mapping[str, Any], base_overrides: Sequence[str],
                    variant: Variant, run_overrides: Sequence[str] = ()) -> SpeedtronicConfig:
    """Load the base config with ``base_overrides``, the variant's overrides, then compare's own
    ``run_overrides`` (run name, seed, steps, checkpoints) last.

    Raises:
        ConfigError: prefixed with the variant name, naming the offending key.
    """
    try:
        return load_config(source, [*base_overrides, *variant.overrides, *run_overrides])
    except ConfigError as exc:
        raise ConfigError(f"--variant {variant.name}: {exc}") from None
