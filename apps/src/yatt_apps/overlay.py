"""Typed configs from a preset, a YAML overlay and `--set key=value` overrides.

A run's config is a frozen msgspec Struct (rejecting unknown fields). The preset gives the base values, a YAML
file overlays some of them (nested mappings merge; lists and scalars replace), and `--set a.b.c=value` overrides
one leaf (the value parsed as a YAML scalar). A model section given a `path` (and no `warm_start`) drops the
preset's warm start: the user's model replaces the tiny one. Validation happens once, on the merged document, so every error
names its field path (`$.algo.clip_ratio_c`) and where the bad value came from.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec

T = TypeVar("T", bound=msgspec.Struct)


def _merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def read_yaml(path: Path) -> dict[str, Any]:
    """The YAML mapping of `path`; a missing file or a document that is not a mapping is a ValueError."""
    import yaml

    if not path.is_file():
        raise ValueError(f"config file not found: {path}")
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: the top level must be a mapping, got {type(doc).__name__}")
    return doc


def parse_override(item: str) -> dict[str, Any]:
    """`a.b.c=value` -> {"a": {"b": {"c": value}}}, the value parsed as a YAML scalar (`1e-6`, `true`, `[1, 2]`)."""
    import yaml

    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ValueError(f"--set {item!r}: expected key.path=value")
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as err:
        raise ValueError(f"--set {item!r}: value is not valid YAML: {err}") from None
    for part in reversed(key.split(".")):
        value = {part: value}
    assert isinstance(value, dict)  # key.split(".") has at least one part
    return value


def build_config(
    cls: type[T], base: T, yaml_path: str | Path | None = None, overrides: Sequence[str] = ()
) -> T:
    """Merge base <- YAML <- overrides and validate as `cls`; a bad field raises ValueError naming it."""
    doc = msgspec.to_builtins(base)
    given: dict[str, Any] = {}  # what the user's YAML and --set say, merged
    sources = []
    if yaml_path is not None:
        given = _merge(given, read_yaml(Path(yaml_path)))
        sources.append(str(yaml_path))
    for item in overrides:
        given = _merge(given, parse_override(item))
        sources.append(f"--set {item}")
    doc = _own_models(_merge(doc, given), given)
    try:
        return msgspec.convert(doc, cls, strict=False)  # lets "1e-6" (a string to YAML 1.1) be a float
    except msgspec.ValidationError as err:
        origin = f" (from {', '.join(sources)})" if sources else ""
        raise ValueError(f"invalid config{origin}: {err}") from None


def _own_models(doc: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """A model the user points at (a section such as `model`, `judge` or `distill.teacher` given a `path` and
    no `warm_start`) replaces the preset's tiny warm-started one: its `warm_start` becomes "none" (a warm start
    trains a tiny model built from a config, and would refuse a path)."""
    out = dict(doc)
    for key, section in given.items():
        if not (isinstance(section, dict) and isinstance(out.get(key), dict)):
            continue
        out[key] = _own_models(out[key], section)  # nested sections (distill.teacher)
        own = section.get("path") and "warm_start" not in section
        if own and out[key].get("warm_start", "none") != "none":
            out[key] = {**out[key], "warm_start": "none"}
    return out


def to_yaml(config: msgspec.Struct) -> str:
    """The full resolved config, for the run directory (re-loadable with `build_config`)."""
    import yaml

    return yaml.safe_dump(msgspec.to_builtins(config), sort_keys=False)
