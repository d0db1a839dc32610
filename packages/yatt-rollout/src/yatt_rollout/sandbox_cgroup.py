"""One cgroup per sandboxed call: the whole process tree's memory and process count, and a way to kill it all.

`CgroupLayout.detect()` reads /proc/self/mountinfo and /proc/self/cgroup and finds where this process may create
a child cgroup with the `memory` and `pids` controllers:
- cgroup v2: under this process's own cgroup when its `cgroup.subtree_control` already enables both
  controllers (a delegated subtree), else under the hierarchy's root when the caller may write there (root);
- cgroup v1 (and the v1 half of a hybrid layout): under this process's own cgroup of the `memory` and the
  `pids` hierarchies, one directory in each.
A controller that is found nowhere is left to the rlimits of the sandbox (`SandboxCgroup.controllers` says
which the call got). The layout takes its mount points as arguments, so a test can hand it stand-in folders.

Limits written: v2 `memory.max`, `memory.swap.max = 0`, `pids.max`; v1 `memory.limit_in_bytes` (and
`memory.memsw.limit_in_bytes` where swap accounting exists), `pids.max`. The kernel's OOM killer then kills
inside the tree only; `oom_kills()` reads how often (v2 `memory.events`, v1 `memory.oom_control`), and
`process_limit_hits()` how many forks failed at `pids.max` (`pids.events`, v1 and v2).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from pathlib import Path

import msgspec

CONTROLLERS = ("memory", "pids")


class CgroupLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Where each controller's per-call cgroups go: `parents[controller] = (version, parent folder)`."""

    parents: dict[str, tuple[int, str]] = {}

    @classmethod
    def detect(cls, mountinfo: str = "/proc/self/mountinfo", own: str = "/proc/self/cgroup") -> CgroupLayout:
        """The layout of this machine for this process (empty when no cgroup may be created)."""
        try:
            mounts = _cgroup_mounts(Path(mountinfo).read_text())
            paths = _own_paths(Path(own).read_text())
        except OSError:
            return cls()
        return cls.from_mounts(mounts, paths)

    @classmethod
    def from_mounts(cls, mounts: dict[str, str], paths: dict[str, str]) -> CgroupLayout:
        """`mounts`: "v2" or a v1 controller name -> its mount point; `paths`: the same keys -> this process's
        cgroup inside that hierarchy (as /proc/self/cgroup gives it)."""
        parents: dict[str, tuple[int, str]] = {}
        if "v2" in mounts:
            parent = _v2_parent(Path(mounts["v2"]), paths.get("v2", "/"))
            if parent is not None:  # both controllers are enabled for its children
                parents.update({c: (2, str(parent)) for c in CONTROLLERS})
        for controller in CONTROLLERS:
            if controller not in parents and controller in mounts:
                folder = Path(mounts[controller]) / paths.get(controller, "/").lstrip("/")
                if os.access(folder, os.W_OK):
                    parents[controller] = (1, str(folder))
        return cls(parents=parents)

    def create(self, name: str, memory_bytes: int, max_processes: int) -> SandboxCgroup:
        """Make the call's cgroup(s) named `name` with these limits; a folder that cannot be made or limited is
        skipped (the rlimits still hold), and what was made is removed again on failure."""
        group = SandboxCgroup()
        made: dict[str, str] = {}  # parent folder -> the new folder (v2 holds both controllers in one)
        for controller, (version, parent) in sorted(self.parents.items()):
            folder = made.get(parent) or str(Path(parent) / name)
            try:
                if parent not in made:
                    os.mkdir(folder)
                    made[parent] = folder
                _limit(Path(folder), controller, version, memory_bytes, max_processes)
            except OSError:
                continue
            group.add(controller, version, folder)
        return group


class SandboxCgroup:
    """The cgroup folders of one call: join them (`procs_files`), read OOM kills, kill everything, remove."""

    def __init__(self) -> None:
        self.folders: dict[str, tuple[int, str]] = {}  # controller -> (version, folder)

    def add(self, controller: str, version: int, folder: str) -> None:
        self.folders[controller] = (version, folder)

    @property
    def controllers(self) -> tuple[str, ...]:
        return tuple(sorted(self.folders))

    def procs_files(self) -> list[str]:
        """The `cgroup.procs` files a process writes its pid into to join (one per distinct folder)."""
        return sorted({str(Path(folder) / "cgroup.procs") for _, folder in self.folders.values()})

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer killed inside the tree (0 without a memory cgroup)."""
        if "memory" not in self.folders:
            return 0
        version, folder = self.folders["memory"]
        name = "memory.events" if version == 2 else "memory.oom_control"
        with contextlib.suppress(OSError, ValueError):
            for line in (Path(folder) / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def process_limit_hits(self) -> int:
        """How many forks inside the tree failed at its process limit (`pids.events`' "max"; 0 without a
        pids cgroup)."""
        if "pids" not in self.folders:
            return 0
        with contextlib.suppress(OSError, ValueError):
            for line in (Path(self.folders["pids"][1]) / "pids.events").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "max":
                    return int(value)
        return 0

    def pids(self) -> set[int]:
        found: set[int] = set()
        for procs in self.procs_files():
            with contextlib.suppress(OSError, ValueError):
                found.update(int(p) for p in Path(procs).read_text().split())
        return found

    def kill_all_and_remove(self, deadline_s: float = 10.0) -> None:
        """SIGKILL every process still inside, wait until the folders are empty, and remove them."""
        stop = time.monotonic() + deadline_s
        while (pids := self.pids()) and time.monotonic() < stop:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)
        for _, folder in {f for f in self.folders.values()}:
            while True:
                try:
                    os.rmdir(folder)
                    break
                except FileNotFoundError:
                    break
                except OSError as err:  # EBUSY: the last task is still leaving
                    if err.errno != errno.EBUSY or time.monotonic() > stop:
                        break
                    time.sleep(0.005)


def _limit(folder: Path, controller: str, version: int, memory_bytes: int, max_processes: int) -> None:
    if controller == "pids":
        _write(folder / "pids.max", str(max_processes))
    elif version == 2:
        _write(folder / "memory.max", str(memory_bytes))
        with contextlib.suppress(OSError):  # absent without swap accounting
            _write(folder / "memory.swap.max", "0")
    else:
        _write(folder / "memory.limit_in_bytes", str(memory_bytes))
        with contextlib.suppress(OSError):
            _write(folder / "memory.memsw.limit_in_bytes", str(memory_bytes))


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _words(path: Path) -> set[str]:
    try:
        return set(path.read_text().split())
    except OSError:
        return set()


def _v2_parent(mount: Path, own: str) -> Path | None:
    """A v2 folder whose children get both controllers: our own cgroup if delegated, else the root (if root
    may enable them there; the root cgroup is exempt from the no-internal-processes rule)."""
    available = _words(mount / "cgroup.controllers")
    if not set(CONTROLLERS) <= available:
        return None
    own_folder = mount / own.lstrip("/")
    if set(CONTROLLERS) <= _words(own_folder / "cgroup.subtree_control") and os.access(own_folder, os.W_OK):
        return own_folder
    if not os.access(mount, os.W_OK):
        return None
    missing = set(CONTROLLERS) - _words(mount / "cgroup.subtree_control")
    if missing:
        try:
            _write(mount / "cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(missing)))
        except OSError:
            return None
    return mount


def _cgroup_mounts(mountinfo: str) -> dict[str, str]:
    """ "v2" -> the cgroup2 mount point; each v1 controller of CONTROLLERS -> its hierarchy's mount point."""
    mounts: dict[str, str] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        fstype, options = after[0], set(after[-1].split(","))
        point = fields[4].replace("\\040", " ")
        if fstype == "cgroup2":
            mounts.setdefault("v2", point)
        elif fstype == "cgroup":
            for controller in CONTROLLERS:
                if controller in options:
                    mounts.setdefault(controller, point)
    return mounts


def _own_paths(cgroup: str) -> dict[str, str]:
    """/proc/self/cgroup lines `id:controllers:path` -> {"v2" or controller: path}."""
    paths: dict[str, str] = {}
    for line in cgroup.splitlines():
        hid, _, rest = line.partition(":")
        names, _, path = rest.partition(":")
        if hid == "0" and names == "":
            paths["v2"] = path
        for name in names.split(","):
            if name in CONTROLLERS:
                paths[name] = path
    return paths
