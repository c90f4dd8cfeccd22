"""Turning YAML / JSON / dicts into a validated :class:`~speedtronic.config.SpeedtronicConfig`.

Kept apart from the dataclasses so the schema (``schema.py`` and the section modules beside it)
reads as the reference of every key. Order of work in :func:`load_config`: read the source ->
expand shorthands (refusing conflicts) -> apply ``--set`` overrides -> build dataclasses with
strict type checks and unknown-key suggestions -> fill cross-section defaults and validate ranges
(``SpeedtronicConfig.finalize``).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import re
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from ..errors import ConfigError, brief
from . import schema as _c
from .bundled import bundled_config, bundled_config_names
from .v2_keys import v2_key_advice, v2_value_advice

logger = logging.getLogger("speedtronic.config")

# PyYAML follows YAML 1.1, where "3e-4" (no dot) is a *string*. Learning rates are written that
# way all the time, so our loader also resolves such scientific notation to float.
_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)$")


class _Loader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        """PyYAML keeps the last of two equal keys; refuse them (naming the key and both lines)
        so a second ``run:`` block cannot silently replace the first."""
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # '<<' may override by design
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # unhashable key: the base class reports it
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        problem=f"duplicate key {brief(key)} (first on line {first}); each key may "
                                "appear once per mapping", problem_mark=key_node.start_mark)
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)

_ROOT_TO_RUN = ("name", "seed", "device", "max_steps", "output_dir")
_ROOT_TO_OPTIMIZER = ("muon_plus", "cautious")
_SECTION_SHORTHANDS = {"optimizer": "name", "precision": "mode"}  # `optimizer: muon` sets .name


#: Bounds on a config's YAML, checked on the event stream before anything is built: a config
#: is a few hundred values at most. A 573-byte "billion laughs" file (anchors of anchors) once
#: expanded to 10^9 values and took a minute and 2.3 GB to fail; 10,000 nested brackets once
#: ended in a RecursionError traceback.
MAX_YAML_DEPTH = 32
MAX_YAML_VALUES = 100_000


def _check_yaml_shape(text: str, origin: str) -> None:
    """Refuse nesting deeper than :data:`MAX_YAML_DEPTH` and documents that expand, through
    aliases (``*name`` of an ``&name`` anchor), to more than :data:`MAX_YAML_VALUES` values.
    The event stream is flat (no recursion) and an alias is counted by the size of what it
    names, so this costs one pass over the text whatever the aliases would expand to."""
    sizes: dict[str, int] = {}
    stack: list[list[Any]] = []  # [expanded size so far, anchor] of each open collection
    total = 0
    for event in yaml.parse(text, Loader=_Loader):
        size = 0
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            if len(stack) >= MAX_YAML_DEPTH:
                raise ConfigError(f"{origin}: line {event.start_mark.line + 1}: nesting deeper "
                                  f"than {MAX_YAML_DEPTH} levels; a config needs a few")
            stack.append([1, event.anchor])
            total += 1
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            size, anchor = stack.pop()
            if anchor:
                sizes[anchor] = size
        elif isinstance(event, yaml.ScalarEvent):
            size = 1
            total += 1
            if event.anchor:
                sizes[event.anchor] = 1
        elif isinstance(event, yaml.AliasEvent):
            size = sizes.get(event.anchor, 1)
            total += size
        if size and stack:
            stack[-1][0] += size
        if total > MAX_YAML_VALUES:
            raise ConfigError(f"{origin}: expands to more than {MAX_YAML_VALUES:,} values "
                              "through YAML aliases (*name of an &name anchor); a config "
                              "needs a few hundred: write the values out, or alias less")


def _parse_yaml(text: str, origin: str) -> Any:
    try:
        _check_yaml_shape(text, origin)
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader subclass
    except RecursionError:  # a bound above should make this unreachable; never a traceback
        raise ConfigError(f"{origin}: nested too deeply to read") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f": line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{origin}{where}: malformed YAML/JSON: {problem}") from None


def _read_source(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return _deep_copy(dict(source))
    path = Path(source)
    if not path.exists():
        own = path.with_name(path.name + ".yaml") if path.suffix == "" and path.name else None
        if own is not None and own.is_file():
            path = own  # "--config quickstart" beside a quickstart.yaml of the user's: theirs
        elif (bundled := bundled_config(str(source))) is not None:  # config/bundled.py
            logger.info("config: %r is not a file here: the bundled example %s", str(source),
                        bundled)
            path = bundled
    if not path.is_file():
        names = bundled_config_names()
        hint = ""
        if names and Path(str(source)).name == str(source):  # a name alone: say which exist
            close = difflib.get_close_matches(str(source).removesuffix(".yaml"), names, n=1)
            hint = (" (" + (f"did you mean the bundled {close[0]!r}? " if close else "")
                    + f"bundled examples, named alone: {', '.join(names)})")
        raise ConfigError(f"config file not found: {str(path)!r}{hint}" if not path.exists()
                          else f"config path is not a file: {str(path)!r}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc}") from None
    data = _parse_yaml(text, str(path))  # JSON is valid YAML 1.2 for our purposes
    if data is None:
        # allowed (defaults plus --set is a valid way to run), but an empty file is more often
        # a failed redirect or a wrong path than a choice: say so
        logging.getLogger("speedtronic.config").warning(
            "config file %s is empty: every key takes its default", str(path))
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, "
                          f"got {type(data).__name__}")
    return data


def _deep_copy(value: Any, depth: int = 0) -> Any:
    if depth > MAX_YAML_DEPTH and isinstance(value, (dict, list)):
        raise ConfigError(f"config nested deeper than {MAX_YAML_DEPTH} levels (or a dict that "
                          "contains itself); a config needs a few")
    if isinstance(value, dict):
        return {k: _deep_copy(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v, depth + 1) for v in value]
    return value


def _move(raw: dict[str, Any], key: str, section: str) -> None:
    """Move root ``key`` into ``raw[section]``, refusing a conflicting duplicate."""
    if key not in raw:
        return
    value = raw.pop(key)
    target = raw.setdefault(section, {})
    if target is None:
        target = raw[section] = {}
    if not isinstance(target, dict):
        raise ConfigError(f"{section}: must be a mapping to combine with root '{key}'")
    if key in target and target[key] != value:
        raise ConfigError(f"conflicting values for {section}.{key}: root "
                          f"'{key}: {brief(value)}' and '{section}.{key}: "
                          f"{brief(target[key])}'; set it in one place")
    target[key] = value


def _expand_shorthands(raw: dict[str, Any]) -> dict[str, Any]:
    for section, key in _SECTION_SHORTHANDS.items():
        if isinstance(raw.get(section), str):
            raw[section] = {key: raw[section]}
    if isinstance(raw.get("compile"), dict):
        extra = sorted(set(raw["compile"]) - {"enabled"})
        if extra:
            raise ConfigError(f"compile.{extra[0]}: unknown key; compile accepts only 'enabled'")
        raw["compile"] = raw["compile"].get("enabled", False)
    for key in _ROOT_TO_RUN:
        _move(raw, key, "run")
    for key in _ROOT_TO_OPTIMIZER:
        _move(raw, key, "optimizer")
    if "log_every" in raw:  # root log_every is logging.every_steps (not a key of its own)
        value = raw.pop("log_every")
        section = raw["logging"] = raw.get("logging") or {}
        if not isinstance(section, dict):
            raise ConfigError("logging: must be a mapping to combine with root 'log_every'")
        if "every_steps" in section and section["every_steps"] != value:
            raise ConfigError(f"conflicting values for logging.every_steps: root 'log_every: "
                              f"{brief(value)}' and 'logging.every_steps: "
                              f"{brief(section['every_steps'])}'; set it in one place")
        section["every_steps"] = value
    for name in ("diloco",):
        if name in raw:
            if "distributed" in raw:
                raise ConfigError(f"both '{name}' and 'distributed' are set; use 'distributed'")
            raw["distributed"] = raw.pop(name)
    return raw


def _long_form(keys: list[str], value: Any) -> list[str]:
    """The key a shorthand override stands for. Overriding that key, not the shorthand, keeps the
    rest of the file's section (``--set optimizer=muon`` keeps ``optimizer.lr``) and lets
    ``--set seed=5`` replace a ``run.seed`` from the file instead of conflicting with it."""
    head = keys[0]
    if len(keys) == 1 and isinstance(value, str) and head in _SECTION_SHORTHANDS:
        return [head, _SECTION_SHORTHANDS[head]]
    if len(keys) == 1 and head in _ROOT_TO_RUN:
        return ["run", head]
    if len(keys) == 1 and head in _ROOT_TO_OPTIMIZER:
        return ["optimizer", head]
    if keys == ["log_every"]:
        return ["logging", "every_steps"]
    if head == "diloco":  # the file's `diloco:` section is already `distributed` here
        return ["distributed", *keys[1:]]
    return keys


def _apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> None:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {brief(item)}: expected section.key=value")
        dotted, text = item.split("=", 1)
        keys = dotted.strip().split(".")
        if not all(keys):
            raise ConfigError(f"--set {brief(item)}: bad key {brief(dotted)}")
        value = _parse_yaml(text, f"--set {dotted}") if text.strip() else None
        if len(keys) == 1 and value is None:
            # An empty value (often an unset shell variable) would reset the whole section.
            raise ConfigError(f"--set {brief(item)}: empty value for the whole {keys[0]!r} "
                              "section; "
                              f"give {keys[0]}.key=value, or {keys[0]}={{}} to reset it to "
                              "its defaults")
        keys = _long_form(keys, value)
        node = raw
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {dotted}: {'.'.join(keys[:depth + 1])} is not a section")
            node = child
        node[keys[-1]] = value


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:  # fixed length: say how many
            names = {_type_name(a) for a in args}
            if len(names) == 1:
                return f"a list of {len(args)} {names.pop()}s"
            return f"a list of {len(args)} items ({', '.join(_type_name(a) for a in args)})"
        return f"list of {_type_name(args[0])}"
    return {type(None): "null"}.get(tp, getattr(tp, "__name__", str(tp)))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return ``value`` checked against annotation ``tp`` (ints widen to float, lists to tuples)."""
    ok, out = _match(value, tp)
    if not ok:
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} "
                          f"{brief(value)}")
    return out


def _match(value: Any, tp: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True, value
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, out = _match(value, arg)
            if ok:
                return True, out
        return False, None
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and ("on" if value else "off") in choices:
            # YAML 1.1 reads an unquoted on / off as true / false: `cuda_graph: on` as written
            # in the docs was refused as "got bool True"
            return True, "on" if value else "off"
        if isinstance(value, str) and value not in choices:
            lowered = value.lower() if "DEBUG" not in choices else value.upper()
            if lowered in choices:
                return True, lowered
        return (value in choices and type(value) in {type(c) for c in choices}), value
    if tp is type(None):
        return value is None, None
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else None
    if tp is str:
        return isinstance(value, str), value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False, None
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis and len(args) != len(value):
            return False, None
        items = []
        for i, item in enumerate(value):
            ok, out = _match(item, args[0] if origin is list else args[min(i, len(args) - 1)])
            if not ok:
                return False, None
            items.append(out)
        return True, tuple(items) if origin is tuple else items
    return isinstance(value, tp), value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if raw is None:
        return cls()
    if isinstance(raw, cls):
        return raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix}: must be a mapping of keys, got {type(raw).__name__} "
                          f"{brief(raw)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            advice = v2_key_advice(dotted)  # a 2.0 key: its replacement, not the closest name
            if advice is not None:
                raise ConfigError(advice)
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean '{(prefix + '.') if prefix else ''}{close[0]}'?" if close else \
                f"; valid keys: {', '.join(fields)}"
            raise ConfigError(f"unknown config key '{dotted}'{hint}")
        tp = hints[key]
        advice = v2_value_advice(dotted, value)
        if advice is not None:
            raise ConfigError(advice)
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, dotted)
        else:
            kwargs[key] = _coerce(value, tp, dotted)
    return cls(**kwargs)


def load_config(source: str | Path | Mapping[str, Any] | _c.SpeedtronicConfig,
                overrides: Iterable[str] = ()) -> _c.SpeedtronicConfig:
    """Load, override, type-check and validate a configuration.

    Args:
        source: a YAML or JSON file path, a dict, or an existing config (re-validated).
        overrides: ``"section.key=value"`` strings; values are parsed as YAML.

    Raises:
        ConfigError: naming the full dotted key and what would be valid.
    """
    if isinstance(source, _c.SpeedtronicConfig):
        source = source.to_dict(redact=False)
    raw = _expand_shorthands(_read_source(source))
    _apply_overrides(raw, overrides)
    raw = _expand_shorthands(raw)
    cfg = _build(_c.SpeedtronicConfig, raw, "")
    data = raw.get("data") if isinstance(raw.get("data"), Mapping) else {}
    model = raw.get("model") if isinstance(raw.get("model"), Mapping) else {}
    if "vocab_size" not in model and (data.get("tokenizer") or data.get("tokens_path")):
        cfg.model.vocab_size = None  # not written: it follows the data (see ModelConfig)
    return cfg.finalize()



_c.LOADER[:] = [load_config]  # SpeedtronicConfig.from_dict / from_yaml call it
