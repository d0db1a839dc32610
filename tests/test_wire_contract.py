"""The wire contract of every package's `types.py`.

For each package, `packages/<pkg>/tests/wire_examples.py` holds an example of every Struct. This test checks
that every Struct has one, that each round-trips through msgpack and JSON, that the encoded bytes equal the
golden fixtures checked in under `packages/<pkg>/tests/golden/` (so a change that breaks old messages fails
here), that a wrongly typed field fails with msgspec's error naming the field, and that configs reject
unknown fields while messages ignore them.

New Struct: add an example, then write its fixtures with `python tests/test_wire_contract.py --regen`
(writes only missing files; `--force` rewrites all, which is a wire break to call out in the CHANGELOG).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections import Counter
from pathlib import Path

import msgspec
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["placement", "rollout", "algos", "multimodal", "controller"]


def _structs(pkg: str) -> list[type[msgspec.Struct]]:
    module = importlib.import_module(f"yatt_{pkg}.types")
    return [
        obj
        for name, obj in vars(module).items()
        if inspect.isclass(obj)
        and issubclass(obj, msgspec.Struct)
        and obj.__module__ == module.__name__
        and not name.startswith("_")
    ]


def _examples(pkg: str) -> list[msgspec.Struct]:
    path = ROOT / "packages" / f"yatt-{pkg}" / "tests" / "wire_examples.py"
    spec = importlib.util.spec_from_file_location(f"_wire_examples_{pkg}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.EXAMPLES


def _cases() -> list[tuple[str, str, msgspec.Struct]]:
    cases = []
    for pkg in PACKAGES:
        seen: Counter[str] = Counter()
        for example in _examples(pkg):
            cls = type(example).__name__
            cases.append((pkg, f"{cls}.{seen[cls]}", example))
            seen[cls] += 1
    return cases


CASES = _cases()
IDS = [f"{pkg}:{key}" for pkg, key, _ in CASES]


def _golden(pkg: str, key: str, ext: str) -> Path:
    return ROOT / "packages" / f"yatt-{pkg}" / "tests" / "golden" / f"{key}.{ext}"


def _is_config(cls: type[msgspec.Struct]) -> bool:
    return bool(cls.__struct_config__.forbid_unknown_fields)


@pytest.mark.parametrize("pkg", PACKAGES)
def test_every_struct_has_an_example(pkg):
    covered = {type(example) for example in _examples(pkg)}
    missing = [cls.__name__ for cls in _structs(pkg) if cls not in covered]
    assert not missing, f"yatt_{pkg}.types Structs without an example in wire_examples.py: {missing}"


@pytest.mark.parametrize(("pkg", "key", "example"), CASES, ids=IDS)
def test_roundtrip_msgpack_and_json(pkg, key, example):
    cls = type(example)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(example), type=cls) == example
    assert msgspec.json.decode(msgspec.json.encode(example), type=cls) == example


@pytest.mark.parametrize(("pkg", "key", "example"), CASES, ids=IDS)
def test_golden_fixtures(pkg, key, example):
    cls = type(example)
    for ext, codec in (("msgpack", msgspec.msgpack), ("json", msgspec.json)):
        path = _golden(pkg, key, ext)
        assert path.exists(), (
            f"missing golden fixture {path}: run `python tests/test_wire_contract.py --regen`"
        )
        golden = path.read_bytes()
        # Old bytes must still decode to the same value, and today's encoder must still write them. Configs
        # encode every field, so a field appended (with a default) adds to their encoding: for them, the
        # golden document must be contained, key for key, in today's.
        assert codec.decode(golden, type=cls) == example, f"{path} no longer decodes to the example"
        if _is_config(cls):
            old, now = codec.decode(golden), codec.decode(codec.encode(example))
            assert {k: now.get(k) for k in old} == old, f"encoding of {key} changed; see {path}"
        else:
            assert codec.encode(example) == golden, f"encoding of {key} changed; see {path}"


@pytest.mark.parametrize(("pkg", "key", "example"), CASES, ids=IDS)
def test_wrong_type_names_the_field(pkg, key, example):
    cls = type(example)
    doc = msgspec.to_builtins(example)
    field = next(name for name in cls.__struct_fields__ if name in doc and not isinstance(doc[name], dict))
    doc[field] = {"not": "this"}
    with pytest.raises(msgspec.ValidationError, match=rf"\$\.{field}"):
        msgspec.json.decode(msgspec.json.encode(doc), type=cls)


@pytest.mark.parametrize(("pkg", "key", "example"), CASES, ids=IDS)
def test_unknown_fields(pkg, key, example):
    cls = type(example)
    doc = msgspec.to_builtins(example)
    doc["field_from_the_future"] = 1
    raw = msgspec.json.encode(doc)
    if _is_config(cls):
        with pytest.raises(msgspec.ValidationError, match="field_from_the_future"):
            msgspec.json.decode(raw, type=cls)
    else:
        assert msgspec.json.decode(raw, type=cls) == example


def test_configs_are_frozen_and_wire_types_are_not():
    for pkg, _, example in CASES:
        cls = type(example)
        config = cls.__struct_config__
        with pytest.raises(TypeError):  # kw_only: positional construction is refused
            cls(*(getattr(example, name) for name in cls.__struct_fields__))
        assert config.frozen == _is_config(cls), f"{pkg}.{cls.__name__}: configs frozen, messages not"


def _regen(force: bool) -> None:
    for pkg, key, example in CASES:
        for ext, codec in (("msgpack", msgspec.msgpack), ("json", msgspec.json)):
            path = _golden(pkg, key, ext)
            if force or not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(codec.encode(example))
                print("wrote", path.relative_to(ROOT))


if __name__ == "__main__":
    _regen(force="--force" in sys.argv)
