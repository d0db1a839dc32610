"""Run untrusted Python (a model's tool call) in a separate, limited process: `run_python(code) -> SandboxResult`.

The child is a fresh interpreter (`python -I`, its own session) in a throwaway working directory, started by a
fixed runner script that, before it compiles the user's code:
- cuts the network: `unshare(CLONE_NEWNET)` into a new, empty network namespace (with `CLONE_NEWUSER` when
  unprivileged); where the kernel refuses both, it replaces `socket.socket`, `socket.create_connection`,
  `socket.getaddrinfo` and `_socket.socket` with functions that raise. `SandboxResult.network_isolation`
  says which one the run got ("namespace" or "patched"; the patch binds Python code only, not C extensions);
- sets RLIMIT_CPU (SIGXCPU, then SIGKILL one second later), RLIMIT_AS (allocations fail: MemoryError),
  RLIMIT_FSIZE (stdout and stderr are files: writing past the cap fails with EFBIG, so a huge print costs
  at most the cap) and no core files;
- in the user namespace even a root host's child lacks CAP_SYS_RESOURCE, so the code cannot raise its hard
  limits (with CLONE_NEWNET alone, as root, it could; the wall-time kill still holds).
The parent kills the whole session at the wall-time limit and removes the directory afterwards.

Statuses: ok, timeout (wall or CPU), memory, crash (an uncaught exception or a fatal signal), output_limit,
network (an uncaught network error), malformed (the code does not compile). The host process is never
touched: the child is a different process, and every failure comes back as data.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

import msgspec

from yatt_rollout.types import SandboxResult

# exit codes of the runner for failures it classifies itself
_EXIT_STATUS = {91: "memory", 92: "malformed", 93: "network", 94: "output_limit"}

_RUNNER = r"""
import ctypes, errno, os, resource, sys
code_path, meta_path = sys.argv[1], sys.argv[2]
cpu_s, mem_bytes, out_bytes, allow_unshare = (int(a) for a in sys.argv[3:7])

class NetworkDisabled(OSError):
    pass

def _blocked(*args, **kwargs):
    raise NetworkDisabled(errno.EACCES, "network access is disabled in the sandbox")

def isolate():
    libc = ctypes.CDLL(None, use_errno=True)
    # CLONE_NEWUSER | CLONE_NEWNET: an empty network namespace, and a user namespace in which even root has
    # no CAP_SYS_RESOURCE over the host (hard limits stay); CLONE_NEWNET alone where user namespaces are off
    for flags in (0x40000000 | 0x10000000, 0x40000000):
        if allow_unshare and libc.unshare(flags) == 0:
            return "namespace"
    import _socket, socket
    class BlockedSocket(_socket.socket):  # a class still: other modules subclass socket.socket
        def __init__(self, *args, **kwargs):
            _blocked()
    socket.socket = _socket.socket = BlockedSocket
    socket.create_connection = socket.getaddrinfo = _socket.getaddrinfo = _blocked
    return "patched"

def is_network_error(err):
    unreachable = (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL, errno.ENETDOWN)
    for _ in range(8):  # the error or what it wraps (urllib's URLError holds the socket error)
        if isinstance(err, (NetworkDisabled, socket.gaierror)) or (
                isinstance(err, OSError) and err.errno in unreachable):
            return True
        err = getattr(err, "reason", None) or err.__cause__ or err.__context__
        if not isinstance(err, BaseException):
            return False
    return False

isolation = isolate()
with open(code_path) as f:
    source = f.read()
with open(meta_path, "w") as f:
    f.write(isolation)
import socket, traceback  # imported before the limits: the error paths below need them
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (out_bytes, out_bytes))
resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
try:
    code = compile(source, "<sandbox>", "exec")
except (SyntaxError, ValueError) as err:
    sys.stderr.write(f"{type(err).__name__}: {err}\n"); sys.stderr.flush()
    os._exit(92)
status = 0
try:
    exec(code, {"__name__": "__main__"})
    sys.stdout.flush()
except SystemExit as err:
    status = 0 if err.code in (None, 0) else 1
except MemoryError:
    status = 91
except BaseException as err:
    if isinstance(err, OSError) and err.errno == errno.EFBIG:
        status = 94
    elif is_network_error(err):
        status = 93
    else:
        status = 1
    try:
        traceback.print_exc()
    except BaseException:
        pass
try:
    sys.stdout.flush(); sys.stderr.flush()
except OSError as err:
    status = 94 if err.errno == errno.EFBIG else status
os._exit(status)
"""


class SandboxLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Limits of one run: CPU seconds, address space, stdout/stderr bytes each, wall seconds."""

    cpu_s: int = 2
    memory_bytes: int = 256 << 20
    output_bytes: int = 64 << 10
    wall_s: float = 5.0
    # "auto": a network namespace where the kernel allows it, else the socket patch; "patch": the patch only
    network: Literal["auto", "patch"] = "auto"

    def __post_init__(self) -> None:
        for name in ("cpu_s", "memory_bytes", "output_bytes", "wall_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` in a fresh sandboxed interpreter and classify how it ended (never raises for the code's
    sake). stdout/stderr come back decoded (invalid UTF-8 replaced), at most `limits.output_bytes` each."""
    limits = limits or SandboxLimits()
    root = Path(tempfile.mkdtemp(prefix="yatt-sandbox-"))
    try:
        return _run_in(root, code, limits)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run_in(root: Path, code: str, limits: SandboxLimits) -> SandboxResult:
    work, code_path, meta = root / "work", root / "code.py", root / "meta"
    work.mkdir()
    code_path.write_text(code)
    argv = [
        sys.executable,
        "-I",
        "-c",
        _RUNNER,
        str(code_path),
        str(meta),
        str(limits.cpu_s),
        str(limits.memory_bytes),
        str(limits.output_bytes),
        str(int(limits.network != "patch")),
    ]
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(work),
        "TMPDIR": str(work),
        "OMP_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    started = time.perf_counter()
    with open(root / "stdout", "wb") as out, open(root / "stderr", "wb") as err:
        proc = subprocess.Popen(
            argv, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True
        )
        timed_out = False
        try:
            proc.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_session(proc)
    wall = time.perf_counter() - started
    stdout, stderr = (_read(root / name, limits.output_bytes) for name in ("stdout", "stderr"))
    status = _status(proc.returncode, timed_out, root, limits)
    isolation = meta.read_text() if meta.is_file() else ""
    if timed_out:
        stderr += f"\nkilled: ran past the {limits.wall_s:g} s wall-time limit"
    return SandboxResult(
        status=status,
        stdout=stdout,
        stderr=stderr,
        exit_code=proc.returncode,
        wall_s=wall,
        network_isolation=isolation,
    )


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole session (the code may have forked), then reap the child."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _status(code: int, timed_out: bool, root: Path, limits: SandboxLimits) -> str:
    if timed_out or code in (-signal.SIGXCPU, -signal.SIGKILL):
        return "timeout"  # the wall limit, or RLIMIT_CPU's SIGXCPU / SIGKILL
    if code in _EXIT_STATUS:
        return _EXIT_STATUS[code]
    if any((root / name).stat().st_size >= limits.output_bytes for name in ("stdout", "stderr")):
        return "output_limit"  # the code caught EFBIG itself: its output was still cut
    return "ok" if code == 0 else "crash"


def _read(path: Path, cap: int) -> str:
    with open(path, "rb") as f:
        return f.read(cap).decode("utf-8", errors="replace")
