"""The contained sandbox without host root: an unprivileged caller (uid 65534 with the system's Python) and root
of a user namespace (`unshare -r`) get a user namespace around the same containment; where no namespace can be
made, `run_python` raises `SandboxUnavailable` unless the caller asks for `containment="none"`."""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yatt_rollout
from yatt_rollout.sandbox import SandboxUnavailable  # noqa: F401 - named by the scripts below

if os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("unshare") is None:
    pytest.skip(
        "needs root and util-linux's setpriv/unshare to become another caller", allow_module_level=True
    )

SRC = str(Path(yatt_rollout.__file__).parent.parent)
SITE = str(Path(__import__("msgspec").__file__).parent.parent)  # msgspec and yatt-rollout's metadata

# run by the caller under test; prints one JSON object of what the hostile snippets saw
HOSTILE = r"""
import json, os, sys
sys.path[:0] = [SRC, SITE]
from yatt_rollout.sandbox import SandboxLimits, run_python
victim, marker = int(sys.argv[1]), sys.argv[2]
code = f'''
import errno, os, socket, sys, time
seen = {{"uid": os.getuid(), "cap_eff": open("/proc/self/status").read().split("CapEff:")[1].split()[0]}}
for key, path, mode in (("shadow", "/etc/shadow", "r"), ("usr", "/usr/new.txt", "a")):
    try:
        open(path, mode)
        seen[key] = 0
    except OSError as err:
        seen[key] = err.errno
try:
    os.kill({victim}, 9)
    seen["kill"] = 0
except OSError as err:
    seen["kill"] = err.errno
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
seen["nested_userns"] = ctypes.get_errno() if libc.unshare(0x10000000) else 0
try:
    socket.create_connection(("127.0.0.1", 9), timeout=2)
except OSError as err:
    seen["net"] = err.errno
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "{marker}"])
    os._exit(0)
os.wait()
n = 0
while True:
    try:
        pid = os.fork()
    except OSError as err:
        seen["forks"] = [n, err.errno]
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    n += 1
seen["pids"] = len([p for p in os.listdir("/proc") if p.isdigit()])
print(__import__("json").dumps(seen))
'''
result = run_python(code, SandboxLimits(cpu_s=5, wall_s=20.0, output_bytes=4096, max_processes=8))
print(json.dumps({"status": result.status, "stderr": result.stderr, "seen": result.stdout}))
""".replace("SRC", repr(SRC)).replace("SITE", repr(SITE))


def _leftovers(marker: str) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            continue
    return found


def _run_hostile(prefix: list[str], python: str) -> dict:
    victim = subprocess.Popen(["sleep", "60"])
    marker = f"yatt-userns-marker-{secrets.token_hex(6)}"
    try:
        out = subprocess.run(
            [*prefix, python, "-I", "-c", HOSTILE, str(victim.pid), marker],
            capture_output=True,
            text=True,
            cwd="/",
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert victim.poll() is None  # the host process survived
        assert _leftovers(marker) == []  # the setsid grandchild died with the call
    finally:
        victim.kill()
        victim.wait()
    report = json.loads(out.stdout.splitlines()[-1])
    assert (report["status"], report["stderr"]) == ("ok", ""), report
    return json.loads(report["seen"])


def _expected(uid: int) -> dict:
    return {
        "uid": uid,
        "cap_eff": "0000000000000000",
        "shadow": errno.ENOENT,
        "usr": errno.EROFS,
        "kill": errno.ESRCH,
        "net": errno.ENETUNREACH,
        "nested_userns": errno.ENOSPC,  # max_user_namespaces is 0 inside
        # 8 processes: the code's own, the setsid grandchild (alive until the call ends) and 6 children
        "forks": [6, errno.EAGAIN],
        "pids": 9,  # and the namespace's init
    }


def test_an_unprivileged_caller_is_contained_in_a_user_namespace():
    python = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    if not os.access(python, os.X_OK):
        pytest.skip(f"no system {python} that uid 65534 may run")
    probe = f"import sys; sys.path[:0] = [{SRC!r}, {SITE!r}]; import yatt_rollout.sandbox"
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-I", "-c", probe]
    if subprocess.run(as_nobody, capture_output=True, cwd="/").returncode != 0:
        pytest.skip(
            "uid 65534 cannot run the system Python with this checkout (a private folder, another ABI)"
        )
    seen = _run_hostile(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"], python)
    assert seen == _expected(uid=0)  # uid 0 of its user namespace: 65534 outside, without capabilities


def test_root_of_a_user_namespace_is_contained_too():
    # `unshare -r`: euid 0 but only uid 0 mapped, so no per-call uid can be switched to (rootless containers)
    seen = _run_hostile(["unshare", "-r", "--"], sys.executable)
    assert seen == _expected(uid=0)


REFUSED = """
import sys
from yatt_rollout.sandbox import SandboxUnavailable, run_python
open("/proc/sys/user/max_user_namespaces", "w").write("0")  # this user namespace may make no more
try:
    run_python("print(1)")
except SandboxUnavailable as err:
    print(err)
print(run_python("print(1)", containment="none").stdout, end="")
"""


def test_without_namespaces_it_refuses_unless_asked_for_no_containment():
    out = subprocess.run(
        ["unshare", "-r", "--", sys.executable, "-c", REFUSED], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    refusal, printed = out.stdout.splitlines()
    assert refusal == (
        "the contained sandbox could not be set up here: unshare of the namespaces: No space left on device "
        "(errno 28); it needs Linux namespaces (as root, or user namespaces for other users); pass "
        "containment='none' to accept the uncontained sandbox"
    )
    assert printed == "1"
