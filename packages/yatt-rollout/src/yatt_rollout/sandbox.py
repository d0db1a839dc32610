"""Run untrusted Python (a model's tool call) contained: `run_python(code) -> SandboxResult`.

Contained (the default, `containment="auto"`): the code runs in a fresh interpreter (`python -I`) without
capabilities (no_new_privs) in its own PID, mount, IPC, UTS and network namespaces, inside a new root: a
read-only tmpfs with read-only binds of what the interpreter needs (`sandbox_root`), a fresh /proc of its PID
namespace, a minimal /dev, and one writable place, the call's private tmpfs `/scratch` (its cwd, HOME and
TMPDIR; /tmp and /dev/shm are the same tmpfs). Host root runs it as a per-call unprivileged uid/gid; any other
caller (or root of a user namespace) inside a user namespace whose uid 0 is the caller's own uid. The
namespace's init kills every descendant when the code's process ends (setsid double forks included), and the
wall-time kill ends the init, so nothing outlives `run_python`. The whole tree's memory and process count are
limited by a cgroup (`sandbox_cgroup`: v2 or v1, where this process may create one) and by rlimits (RLIMIT_AS
per process, RLIMIT_NPROC on the call's own uid). Built with Python and the kernel only (`sandbox_child`).
Where the namespaces cannot be made it raises `SandboxUnavailable`, never a weaker run, unless the caller
asks for `containment="none"`. The package README lists what this guarantees and what it does not.

`containment="none"`: the earlier, weaker sandbox: a `python -I` child in its own session and a throwaway
folder, the network cut by a namespace where allowed (else a socket patch), the same rlimits and limits on
CPU, wall time and output, but the host's files, processes and Unix sockets within its reach.

Statuses: ok, timeout (wall or CPU), memory (MemoryError or the tree's OOM kill), processes (a fork or spawn
failed at the process limit and the code failed: a fork bomb), crash (an uncaught exception or a fatal signal),
output_limit, network (an uncaught network error), malformed (the code does not compile).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

import msgspec

from yatt_rollout.sandbox_cgroup import CgroupLayout, SandboxCgroup
from yatt_rollout.sandbox_root import RootLayoutError, root_entries, tmp_is_scratch
from yatt_rollout.types import SandboxResult, ToolStatus

# exit codes of the runner for failures it classifies itself (sandbox_runner.py)
_EXIT_STATUS: dict[int, ToolStatus] = {
    91: "memory",
    92: "malformed",
    93: "network",
    94: "output_limit",
    95: "processes",
}
_HERE = Path(__file__).parent
# per-call uids and gids are drawn from here: far above any real account's id
UID_BASE, UID_SPAN = 0x60000000, 1 << 24
Containment = Literal["auto", "namespaces", "none"]


class SandboxUnavailable(RuntimeError):
    """The contained sandbox cannot run here (no namespaces, no mounts, no new root): nothing was run."""


class SandboxLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Limits of one run: CPU seconds (per process), memory bytes (per process, and the whole tree's where a
    cgroup is available), stdout/stderr bytes each, wall seconds, processes of the tree (the code's own
    included), and the scratch tmpfs's size (counted in the tree's memory too)."""

    cpu_s: int = 2
    memory_bytes: int = 256 << 20
    output_bytes: int = 64 << 10
    wall_s: float = 5.0
    # "auto": a network namespace where the kernel allows it, else the socket patch; "patch": the patch only
    # (containment="none" only: a contained call always has its own network namespace)
    network: Literal["auto", "patch"] = "auto"
    max_processes: int = 32
    scratch_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        for name in ("cpu_s", "memory_bytes", "output_bytes", "wall_s", "max_processes", "scratch_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")


def run_python(
    code: str,
    limits: SandboxLimits | None = None,
    *,
    containment: Containment = "auto",
    interpreter: str | None = None,
) -> SandboxResult:
    """Run `code` in a fresh sandboxed interpreter and classify how it ended (never raises for the code's
    sake). stdout/stderr come back decoded (invalid UTF-8 replaced), at most `limits.output_bytes` each.

    `containment`: "auto" / "namespaces" contain the code (see the module docstring) or raise
    `SandboxUnavailable`; "none" runs the weaker, uncontained sandbox. `interpreter`: the Python to run the code
    with (default: this one, `sys.executable`); its prefixes are bound read-only into the new root."""
    limits = limits or SandboxLimits()
    if containment not in ("auto", "namespaces", "none"):
        raise ValueError(f"containment must be 'auto', 'namespaces' or 'none', got {containment!r}")
    interpreter = interpreter or sys.executable
    root = Path(tempfile.mkdtemp(prefix="yatt-sandbox-"))
    try:
        if containment == "none":
            return _run_uncontained(root, code, limits, interpreter)
        return _run_contained(root, code, limits, interpreter)
    finally:
        _remove(root)


# ---- contained ----------------------------------------------------------------------------------------------


def _run_contained(root: Path, code: str, limits: SandboxLimits, interpreter: str) -> SandboxResult:
    try:
        entries = root_entries(interpreter)
    except (RootLayoutError, OSError, subprocess.CalledProcessError) as err:
        raise SandboxUnavailable(f"no root for the interpreter {interpreter}: {err}") from err
    (root / "code.py").write_text(code)
    (root / "newroot").mkdir()
    # the init counts against pids.max too: the code's own tree gets max_processes
    cgroup = CgroupLayout.detect().create(root.name, limits.memory_bytes, limits.max_processes + 1)
    spec = _spec(root, entries, cgroup, limits, interpreter)
    argv = [sys.executable, "-I", "-S", str(_HERE / "sandbox_child.py"), msgspec.json.encode(spec).decode()]
    try:
        returncode, timed_out, wall = _launch(root, argv, limits.wall_s)
        oom_kills, process_limit_hits = cgroup.oom_kills(), cgroup.process_limit_hits()
    finally:
        cgroup.kill_all_and_remove()
    status_text = (root / "status").read_text() if (root / "status").is_file() else ""
    kind, _, value = status_text.partition(" ")
    if kind == "setup":
        raise SandboxUnavailable(
            f"the contained sandbox could not be set up here: {value}; it needs Linux namespaces (as root, or "
            "user namespaces for other users); pass containment='none' to accept the uncontained sandbox"
        )
    if kind == "exit":
        returncode = int(value)
    elif kind == "signal":
        returncode = -int(value)
    elif not timed_out and not oom_kills:  # the launcher itself failed: never report that as the code's crash
        tail = _read(root / "stderr", limits.output_bytes)[-2000:]
        raise SandboxUnavailable(f"the sandbox's launcher failed (exit {returncode}): {tail}")
    elif oom_kills:
        returncode = -signal.SIGKILL  # the OOM kill took the init (and so the namespace)
    return _result(root, limits, returncode, timed_out, wall, "namespace", oom_kills, process_limit_hits)


def _spec(
    root: Path, entries: list, cgroup: SandboxCgroup, limits: SandboxLimits, interpreter: str
) -> dict[str, object]:
    """What `sandbox_child.py` needs, as JSON-able data."""
    # root of the host: a fresh uid per call; anyone else (or root inside a user namespace): a user namespace
    # whose uid 0 is the caller's own uid outside, without capabilities
    userns = not _host_root()
    ident = 0 if userns else UID_BASE + secrets.randbelow(UID_SPAN)
    return {
        "root": str(root / "newroot"),
        "entries": entries,
        "tmp_is_scratch": tmp_is_scratch(entries),
        "code_path": str(root / "code.py"),
        "status_path": str(root / "status"),
        "pid_path": str(root / "init.pid"),
        "cgroup_procs": cgroup.procs_files(),
        "caller_pid": os.getpid(),
        "userns": userns,
        "outer_uid": os.geteuid(),
        "outer_gid": os.getegid(),
        "uid": ident,
        "gid": ident,
        "scratch_bytes": limits.scratch_bytes,
        "max_processes": limits.max_processes,
        "interpreter": interpreter,
        "runner": (_HERE / "sandbox_runner.py").read_text(),
        "runner_args": [str(limits.cpu_s), str(limits.memory_bytes), str(limits.output_bytes), "0", "-"],
        "env": _child_env("/scratch"),
    }


def _host_root() -> bool:
    """Root of the initial user namespace (which alone may switch to any uid), not root of a user namespace."""
    if os.geteuid() != 0:
        return False
    try:
        return Path("/proc/self/uid_map").read_text().split() == ["0", "0", "4294967295"]
    except OSError:
        return False


def _launch(root: Path, argv: list[str], wall_s: float) -> tuple[int, bool, float]:
    """Start the launcher, wait at most `wall_s`, and on timeout kill the namespace's init (which takes every
    process of the namespace with it) before reaping the launcher."""
    started = time.perf_counter()
    with open(root / "stdout", "wb") as out, open(root / "stderr", "wb") as err:
        # the launcher gets none of the caller's environment (tokens, keys); the code gets spec["env"]
        env = {"PATH": "/usr/bin:/bin"}
        proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True
        )
        timed_out = not _wait(proc, wall_s)
        if timed_out:
            _kill_init(root / "init.pid", proc)
        proc.wait()
    return proc.returncode, timed_out, time.perf_counter() - started


def _kill_init(pid_path: Path, proc: subprocess.Popen) -> None:
    """SIGKILL the init (the launcher's waitpid returns once the whole namespace is gone); before the launcher
    has written its pid, its process group (the init is in it, and dies with the launcher by PDEATHSIG)."""
    with contextlib.suppress(OSError, ValueError):
        os.kill(int(pid_path.read_text()), signal.SIGKILL)
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


# ---- uncontained (containment="none") -----------------------------------------------------------------------


def _run_uncontained(root: Path, code: str, limits: SandboxLimits, interpreter: str) -> SandboxResult:
    work, code_path, meta = root / "work", root / "code.py", root / "meta"
    work.mkdir()
    code_path.write_text(code)
    code_fd = os.open(code_path, os.O_RDONLY)
    runner = (_HERE / "sandbox_runner.py").read_text()
    isolate = "2" if limits.network == "patch" else "1"
    limit_args = [str(limits.cpu_s), str(limits.memory_bytes), str(limits.output_bytes), isolate, str(meta)]
    argv = [interpreter, "-I", "-c", runner, str(code_fd), *limit_args]
    started = time.perf_counter()
    try:
        with open(root / "stdout", "wb") as out, open(root / "stderr", "wb") as err:
            proc = subprocess.Popen(
                argv,
                cwd=work,
                env=_child_env(str(work)),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                pass_fds=(code_fd,),
            )
            timed_out = not _wait(proc, limits.wall_s)
            _kill_session(proc)
    finally:
        os.close(code_fd)
    wall = time.perf_counter() - started
    isolation = meta.read_text() if meta.is_file() else ""
    return _result(root, limits, proc.returncode, timed_out, wall, isolation, 0)


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole session (the code may have forked), then reap the child."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# ---- shared -------------------------------------------------------------------------------------------------


def _wait(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Whether `proc` ended within `timeout_s` (not reaped). A pidfd wakes the moment it ends;
    `Popen.wait(timeout)` polls with sleeps of up to 50 ms, which was most of a short call's time."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd (kernel < 5.3): Popen's polling
        try:
            proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        return bool(select.select([pidfd], [], [], timeout_s)[0])
    finally:
        os.close(pidfd)


def _child_env(home: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": home,
        "OMP_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def _result(
    root: Path,
    limits: SandboxLimits,
    returncode: int,
    timed_out: bool,
    wall: float,
    isolation: str,
    oom_kills: int,
    process_limit_hits: int = 0,
) -> SandboxResult:
    stdout, stderr = (_read(root / name, limits.output_bytes) for name in ("stdout", "stderr"))
    status = _status(returncode, timed_out, root, limits, oom_kills, process_limit_hits)
    if timed_out:
        stderr += f"\nkilled: ran past the {limits.wall_s:g} s wall-time limit"
    elif status == "memory" and returncode == -signal.SIGKILL:
        stderr += f"\nkilled: the process tree went past its {limits.memory_bytes} byte memory limit"
    elif status == "processes":
        stderr += f"\nrefused: a new process past the tree's limit of {limits.max_processes} processes"
    return SandboxResult(
        status=status,
        stdout=stdout,
        stderr=stderr,
        exit_code=returncode,
        wall_s=wall,
        network_isolation=isolation,
    )


def _status(
    code: int, timed_out: bool, root: Path, limits: SandboxLimits, oom_kills: int, process_limit_hits: int
) -> ToolStatus:
    if timed_out:
        return "timeout"
    if code == -signal.SIGKILL and oom_kills:
        return "memory"  # the tree's OOM kill took the code's own process
    if code in (-signal.SIGXCPU, -signal.SIGKILL):
        return "timeout"  # RLIMIT_CPU's SIGXCPU / SIGKILL
    if process_limit_hits and code in (1, 94, 95):
        return (
            "processes"  # it failed after forks failed at pids.max (a fork bomb's copies may fill the output)
        )
    if code in _EXIT_STATUS:
        return _EXIT_STATUS[code]
    if any((root / name).stat().st_size >= limits.output_bytes for name in ("stdout", "stderr")):
        return "output_limit"  # the code caught EFBIG itself: its output was still cut
    return "ok" if code == 0 else "crash"


def _read(path: Path, cap: int) -> str:
    with open(path, "rb") as f:
        return f.read(cap).decode("utf-8", errors="replace")


def _remove(root: Path) -> None:
    """Remove the call's folder (the new root's mount point lived only in the call's mount namespace)."""
    shutil.rmtree(root, ignore_errors=True)
