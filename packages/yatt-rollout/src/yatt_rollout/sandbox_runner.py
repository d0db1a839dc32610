"""The runner inside the sandbox: `python -I -c <this file's text> CODE_FD CPU_S MEM OUT ISOLATE META`.

`sandbox.py` passes this file's text with `-c` (inside a contained call the package's files may not be
visible). It reads the code from an inherited fd, sets RLIMIT_CPU (SIGXCPU, then SIGKILL one second later),
RLIMIT_AS (allocations fail: MemoryError), RLIMIT_FSIZE (stdout and stderr are files: writing past the cap
fails with EFBIG) and no core files, runs the code and exits with a code that says how it ended:
91 memory, 92 malformed, 93 network, 94 output_limit, 95 processes (an uncaught EAGAIN from fork or
spawn: the process limit; one line, not a traceback, since every copy of a fork bomb ends this way)
(0 ok, 1 an uncaught exception).

ISOLATE: 0 the call is already contained (its own network namespace); 1 `unshare(CLONE_NEWUSER|CLONE_NEWNET)`
or `CLONE_NEWNET` here, else the socket patch; 2 the socket patch only (Python code only, not C extensions).
META (a path or "-") receives how the network was cut ("namespace" or "patched").
"""

import contextlib
import ctypes
import errno
import os
import resource
import sys

code_fd, cpu_s, mem_bytes, out_bytes, isolate_mode = (int(a) for a in sys.argv[1:6])
meta_path = sys.argv[6]


class NetworkDisabled(OSError):
    pass


def _blocked(*args, **kwargs):
    raise NetworkDisabled(errno.EACCES, "network access is disabled in the sandbox")


def isolate() -> str:
    if isolate_mode == 0:
        return "namespace"
    libc = ctypes.CDLL(None, use_errno=True)
    # CLONE_NEWUSER | CLONE_NEWNET: an empty network namespace, and a user namespace in which even root has
    # no CAP_SYS_RESOURCE over the host (hard limits stay); CLONE_NEWNET alone where user namespaces are off
    for flags in (0x40000000 | 0x10000000, 0x40000000):
        if isolate_mode == 1 and libc.unshare(flags) == 0:
            return "namespace"
    import _socket
    import socket

    class BlockedSocket(_socket.socket):  # a class still: other modules subclass socket.socket
        def __init__(self, *args, **kwargs):
            _blocked()

    # the patch replaces the class itself (mypy: assigning to a type)
    socket.socket = _socket.socket = BlockedSocket  # type: ignore[misc, assignment]
    socket.create_connection = socket.getaddrinfo = _socket.getaddrinfo = _blocked
    return "patched"


def is_network_error(err: BaseException) -> bool:
    unreachable = (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL, errno.ENETDOWN)
    for _ in range(8):  # the error or what it wraps (urllib's URLError holds the socket error)
        if isinstance(err, (NetworkDisabled, socket.gaierror)) or (
            isinstance(err, OSError) and err.errno in unreachable
        ):
            return True
        inner = getattr(err, "reason", None) or err.__cause__ or err.__context__
        if not isinstance(inner, BaseException):
            return False
        err = inner
    return False


isolation = isolate()
with os.fdopen(code_fd) as f:
    source = f.read()
if meta_path != "-":
    with open(meta_path, "w") as f:
        f.write(isolation)
import socket  # noqa: E402 - imported before the limits: the error paths below need them
import traceback  # noqa: E402

resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (out_bytes, out_bytes))
resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
try:
    code = compile(source, "<sandbox>", "exec")
except (SyntaxError, ValueError) as err:
    sys.stderr.write(f"{type(err).__name__}: {err}\n")
    sys.stderr.flush()
    os._exit(92)
status = 0
try:
    exec(code, {"__name__": "__main__"})
    sys.stdout.flush()
except SystemExit as err:
    status = 0 if err.code in (None, 0) else 1
except MemoryError:
    status = 91
except BlockingIOError as err:  # EAGAIN from fork/spawn: the process limit (RLIMIT_NPROC or pids.max)
    status = 95 if err.errno == errno.EAGAIN else 1
    with contextlib.suppress(BaseException):
        sys.stderr.write(f"{type(err).__name__}: {err}\n" if status == 95 else traceback.format_exc())
except BaseException as err:
    if isinstance(err, OSError) and err.errno == errno.EFBIG:
        status = 94
    elif is_network_error(err):
        status = 93
    else:
        status = 1
    with contextlib.suppress(BaseException):
        traceback.print_exc()
try:
    sys.stdout.flush()
    sys.stderr.flush()
except OSError as err:
    # a full output is the status, unless the process limit came first: a fork bomb's copies, one line each,
    # fill the output before the first copy exits, and that is still the process limit's doing
    status = 94 if err.errno == errno.EFBIG and status != 95 else status
os._exit(status)
