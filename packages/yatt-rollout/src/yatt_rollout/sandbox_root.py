"""What the contained sandbox's new root holds: read-only binds of what an interpreter needs, nothing else.

`root_entries(interpreter)` lists `(kind, path, target)` triples for `sandbox_child.build_root`: "dir"/"file"
binds (read-only, at the same path as on the host) and "symlink"s (merged-/usr layouts: /bin -> usr/bin).
Bound: the system's program and library folders (/usr, /lib*, /bin, /sbin), the dynamic loader's files of
/etc (not /etc itself: /etc/shadow, /etc/passwd and the rest stay invisible), and the interpreter's prefixes
(`sys.prefix`, `base_prefix`, `exec_prefix`, as given and resolved). A venv bound this way brings its
site-packages; editable installs pointing elsewhere are not followed. The home folder, the work tree, /tmp,
/run, /var and /root stay invisible unless an interpreter prefix lies inside them (then only that prefix).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import PurePosixPath

SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")
_PREFIX_QUERY = "import sys, json; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]))"


class RootLayoutError(ValueError):
    """The interpreter cannot be given a root without exposing what must stay hidden."""


Entry = tuple[str, str, str]


def root_entries(interpreter: str) -> list[Entry]:
    """The binds and symlinks of the new root for `interpreter` (an absolute path), sorted parents first."""
    entries: list[Entry] = []
    for path in SYSTEM_DIRS + ETC_FILES:
        if os.path.islink(path):
            entries.append(("symlink", path, os.readlink(path)))
        elif os.path.isdir(path):
            entries.append(("dir", path, ""))
        elif os.path.isfile(path):
            entries.append(("file", path, ""))
    for prefix in interpreter_prefixes(interpreter):
        for path in {prefix, os.path.realpath(prefix)}:
            _refuse_too_wide(path)
            if os.path.isdir(path):
                entries.append(("dir", path, ""))
    return _outermost(entries)


def tmp_is_scratch(entries: list[Entry]) -> bool:
    """/tmp can be the scratch unless a bind lies under it (an interpreter or a venv inside /tmp)."""
    return not any(PurePosixPath(path).is_relative_to("/tmp") for _, path, _ in entries)


def interpreter_prefixes(interpreter: str) -> tuple[str, ...]:
    """The prefixes of `interpreter`: this process's own without a subprocess, another's by asking it once."""
    if interpreter == sys.executable:
        return tuple(dict.fromkeys((sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)))
    return _asked_prefixes(interpreter)


@functools.cache
def _asked_prefixes(interpreter: str) -> tuple[str, ...]:
    out = subprocess.run([interpreter, "-I", "-c", _PREFIX_QUERY], capture_output=True, check=True, text=True)
    return tuple(dict.fromkeys(json.loads(out.stdout)))


def _refuse_too_wide(path: str) -> None:
    home = os.path.expanduser("~")
    if os.path.realpath(path) in ("/", os.path.realpath(home), "/tmp", "/etc", "/root", "/home"):
        raise RootLayoutError(f"the interpreter's prefix {path} would expose all of {os.path.realpath(path)}")


def _outermost(entries: list[Entry]) -> list[Entry]:
    """Drop duplicates and binds inside another bind (already visible through it), parents first."""
    kept: list[Entry] = []
    bound: list[PurePosixPath] = []
    for kind, path, target in sorted(set(entries), key=lambda e: (e[1].count("/"), e[1])):
        pure = PurePosixPath(path)
        if any(pure.is_relative_to(b) for b in bound):
            continue
        kept.append((kind, path, target))
        if kind != "symlink":
            bound.append(pure)
    return kept
