"""Hostile code against the contained sandbox: one snippet per escape of issue 33, each asserting containment by
concrete values (errnos, listings, pids, file contents), and where it helps a control run with
`containment="none"` showing that the same snippet escapes the uncontained sandbox (so the check can fail)."""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from yatt_rollout import sandbox
from yatt_rollout.sandbox import UID_BASE, SandboxLimits, SandboxUnavailable, run_python
from yatt_rollout.sandbox_cgroup import CgroupLayout
from yatt_rollout.sandbox_root import root_entries, tmp_is_scratch

LIMITS = SandboxLimits(cpu_s=5, memory_bytes=256 << 20, output_bytes=8192, wall_s=20.0)

if os.geteuid() != 0:
    pytest.skip("the contained sandbox needs root (CI runs as root)", allow_module_level=True)


@pytest.fixture(scope="module")
def venv_under_tmp():
    """A venv whose interpreter binary is a copy under /tmp (as in a clone under /tmp): its bin/python."""
    folder = Path(tempfile.mkdtemp(prefix="yatt-sandbox-venv-", dir="/tmp")) / "venv"
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    subprocess.run([base, "-m", "venv", "--without-pip", "--copies", str(folder)], check=True)
    yield str(folder / "bin" / "python")
    shutil.rmtree(folder.parent)


def run_ok(code: str, limits: SandboxLimits = LIMITS, **kwargs: object) -> str:
    result = run_python(code, limits, **kwargs)  # type: ignore[arg-type]
    assert (result.status, result.stderr) == ("ok", ""), result
    return result.stdout


def test_etc_shadow_cannot_be_read():
    assert Path("/etc/shadow").exists()
    code = (
        "import os\ntry:\n    open('/etc/shadow').read()\nexcept OSError as err:\n    print(err.errno)\n"
        "print(sorted(os.listdir('/etc')))"
    )
    lines = run_ok(code).splitlines()
    assert lines[0] == str(errno.ENOENT)
    # only the dynamic loader's files and the time zone are bound into /etc
    assert set(eval(lines[1])) <= {"ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime"}


def test_files_under_the_home_directory_are_invisible():
    home = Path.home()
    secret = home / f".yatt-sandbox-secret-{secrets.token_hex(4)}"
    secret.write_text("s3cret")
    try:
        code = (
            f"import os\ntry:\n    print(open({str(secret)!r}).read())\nexcept OSError as err:\n"
            f"    print(err.errno)\ntry:\n    print(sorted(os.listdir({str(home)!r})))\n"
            "except OSError as err:\n    print(err.errno)"
        )
        lines = run_ok(code).splitlines()
        # uncontained, the same code reads the secret
        assert run_python(code, LIMITS, containment="none").stdout.splitlines()[0] == "s3cret"
    finally:
        secret.unlink()
    assert lines[0] == str(errno.ENOENT)
    # at most the top folder of an interpreter prefix that lives in the home directory (here ~/.pyenv)
    visible = [] if lines[1] == str(errno.ENOENT) else eval(lines[1])
    prefixes = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix)}
    assert all(any(p.is_relative_to(home / name) for p in prefixes) for name in visible), visible
    assert secret.name not in visible


def test_appending_to_root_owned_files_outside_the_scratch_fails(tmp_path, venv_under_tmp):
    hidden = tmp_path / "root_owned.txt"
    bound = Path(venv_under_tmp).parent.parent / "root_owned.txt"  # inside a read-only bind
    for path in (hidden, bound):
        path.write_text("original\n")
        path.chmod(0o666)  # only the sandbox, not the file's mode, may stop the append
    code = (
        f"for path in ({str(hidden)!r}, {str(bound)!r}):\n    try:\n"
        "        with open(path, 'a') as f:\n            f.write('pwned\\n')\n        print('appended')\n"
        "    except OSError as err:\n        print(err.errno)"
    )
    lines = run_ok(code, interpreter=venv_under_tmp).splitlines()
    assert lines == [str(errno.ENOENT), str(errno.EROFS)]
    assert hidden.read_text() == bound.read_text() == "original\n"
    assert (hidden.stat().st_uid, bound.stat().st_uid) == (0, 0)


def test_host_unix_sockets_cannot_be_reached(tmp_path):
    name = f"yatt-sandbox-test-{secrets.token_hex(4)}"
    listeners = []
    for address in (str(tmp_path / "host.sock"), "\0" + name):  # a path and an abstract socket
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen(4)
        listener.setblocking(False)
        listeners.append(listener)
    code = (
        "import socket\n"
        f"for address in ({str(tmp_path / 'host.sock')!r}, '\\0' + {name!r}):\n"
        "    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n    try:\n"
        "        s.connect(address)\n        print('connected')\n    except OSError as err:\n"
        "        print(err.errno)"
    )
    try:
        lines = run_ok(code).splitlines()
        assert lines == [str(errno.ENOENT), str(errno.ECONNREFUSED)]
        for listener in listeners:
            with pytest.raises(BlockingIOError):
                listener.accept()  # nothing ever connected
        # uncontained, the path connects (its own network namespace still keeps the abstract one out)
        assert run_python(code, LIMITS, containment="none").stdout.splitlines()[0] == "connected"
    finally:
        for listener in listeners:
            listener.close()


def test_a_host_process_cannot_be_signalled():
    victim = subprocess.Popen(["sleep", "60"])
    try:
        code = (
            "import os, signal\n"
            f"try:\n    os.kill({victim.pid}, signal.SIGKILL)\n    print('killed')\n"
            "except OSError as err:\n    print(err.errno)\n"
            "try:\n    os.kill(-1, signal.SIGKILL)\n    print('broadcast')\nexcept OSError as err:\n"
            "    print(err.errno)\n"
            "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"
        )
        lines = run_ok(code).splitlines()
        # no such process in its PID namespace; kill(-1) finds no process it may signal; it sees the
        # namespace's init (1) and itself (2) only
        assert lines == [str(errno.ESRCH), str(errno.ESRCH), "[1, 2]"]
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            continue
    return found


DOUBLE_FORK = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "{marker}"])
    os._exit(0)
os.wait()
for _ in range(2000):  # until the grandchild runs with the marker (seen through this namespace's /proc)
    if any(p.isdigit() and b"{marker}" in open(f"/proc/{{p}}/cmdline", "rb").read()
           for p in os.listdir("/proc") if p.isdigit() and p != str(os.getpid())):
        print("grandchild running", flush=True)
        break
    time.sleep(0.01)
"""


def test_a_double_forked_setsid_child_dies_with_the_call():
    marker = f"yatt-sandbox-marker-{secrets.token_hex(6)}"
    code = DOUBLE_FORK.format(marker=marker)
    assert run_ok(code) == "grandchild running\n"
    assert _processes_with(marker) == []
    # uncontained, the grandchild outlives the call
    assert run_python(code, LIMITS, containment="none").stdout == "grandchild running\n"
    survivors = _processes_with(marker)
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert len(survivors) == 1


def test_a_double_forked_setsid_child_dies_with_a_call_killed_at_its_wall_time():
    marker = f"yatt-sandbox-marker-{secrets.token_hex(6)}"
    limits = SandboxLimits(cpu_s=5, wall_s=3.0, output_bytes=4096)
    result = run_python(DOUBLE_FORK.format(marker=marker) + "time.sleep(60)\n", limits)
    assert (result.status, result.stdout) == ("timeout", "grandchild running\n")
    assert _processes_with(marker) == []


def test_a_fork_bomb_is_bounded_by_the_process_limit():
    limits = SandboxLimits(cpu_s=5, wall_s=20.0, output_bytes=4096, max_processes=8)
    code = (
        "import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n"
        "    except OSError as err:\n        print(n, err.errno)\n        break\n"
        "    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    n += 1"
    )
    # the code's own process and 7 children make 8
    assert run_ok(code, limits) == f"7 {errno.EAGAIN}\n"


def test_the_whole_trees_memory_is_limited():
    if "memory" not in CgroupLayout.detect().parents:
        pytest.skip("no memory cgroup may be created here: only the per-process RLIMIT_AS holds")
    code = """
import os, time
children = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        block = b"x" * (96 << 20)  # touched: every page counts
        time.sleep(3)
        os._exit(0)
    children.append(pid)
ends = [os.waitpid(pid, 0)[1] for pid in children]
print(sum(os.WIFEXITED(s) and os.WEXITSTATUS(s) == 0 for s in ends),
      sum(os.WIFSIGNALED(s) and os.WTERMSIG(s) == 9 for s in ends))
"""
    ok, killed = map(int, run_ok(code).split())
    # 4 x 96 MiB against 256 MiB for the tree: at most two children can hold their block at once
    assert ok <= 2 and ok + killed == 4
    # each child alone is within the per-process limit: uncontained, all four finish
    assert run_python(code, LIMITS, containment="none").stdout == "4 0\n"


def test_no_connection_to_a_host_listener_on_127_0_0_1():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    code = (
        "import socket\nprint([name for _, name in socket.if_nameindex()])\n"
        f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('connected')\n"
        "except OSError as err:\n    print(err.errno)"
    )
    try:
        lines = run_ok(code).splitlines()
        assert lines[0] == "['lo']"  # an empty network namespace: its loopback only, and down
        assert lines[1] in (str(errno.ENETUNREACH), str(errno.ECONNREFUSED))
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()


def test_the_scratch_is_the_only_writable_place_and_private_per_call():
    code = """
import os, stat
print(os.getcwd(), os.environ["HOME"], os.environ["TMPDIR"], sorted(os.listdir(".")))
st = os.stat("/scratch")
print(oct(stat.S_IMODE(st.st_mode)), st.st_uid == os.getuid())
open("/scratch/a.txt", "w").write("a" * 1000)
open("/tmp/b.txt", "w").write("b")
print(sorted(os.listdir("/scratch")))
for path in ("/new.txt", "/usr/new.txt", "/dev/new.txt", "/proc/new.txt"):
    try:
        open(path, "w")
        print("wrote", path)
    except OSError as err:
        print(err.errno)
print(os.getuid())
"""
    if not tmp_is_scratch(root_entries(sys.executable)):
        # this interpreter lives under /tmp (a clone under /tmp): /tmp holds its read-only binds instead
        code = code.replace('open("/tmp/b.txt", "w")', 'open("/scratch/b.txt", "w")')
        assert run_python('open("/tmp/b.txt", "w")', LIMITS).stderr.endswith(
            "OSError: [Errno 30] Read-only file system: '/tmp/b.txt'\n"
        )
    first = run_ok(code).splitlines()
    second = run_ok(code).splitlines()
    for lines in (first, second):
        assert lines[0] == "/scratch /scratch /scratch []"  # the second call does not see the first's files
        assert lines[1] == "0o700 True"
        assert lines[2] == "['a.txt', 'b.txt']"  # /tmp is the same private tmpfs (where it is the scratch)
        assert lines[3:6] == [str(errno.EROFS)] * 3
        assert lines[6] in (str(errno.EACCES), str(errno.ENOENT))
        assert int(lines[7]) >= UID_BASE
    assert first[7] != second[7]  # a uid of its own per call


def test_the_code_runs_unprivileged_in_namespaces_of_its_own():
    kinds = ("pid", "mnt", "ipc", "uts", "net")
    code = (
        "import os, socket\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines())\n"
        "print(*(status[k].strip() for k in ('CapEff', 'CapPrm', 'CapBnd', 'CapAmb', 'NoNewPrivs')))\n"
        f"print(*(os.readlink('/proc/self/ns/' + k) for k in {kinds!r}))\n"
        "print(socket.gethostname(), os.getgroups())"
    )
    lines = run_ok(code).splitlines()
    assert lines[0] == "0000000000000000 0000000000000000 0000000000000000 0000000000000000 1"
    inside = lines[1].split()
    host = [os.readlink(f"/proc/self/ns/{k}") for k in kinds]
    assert [a.split(":")[0] for a in inside] == list(kinds) and all(
        a != b for a, b in zip(inside, host, strict=True)
    )
    assert lines[2] == "sandbox []"


def test_an_interpreter_under_tmp_runs_contained(venv_under_tmp):
    # session 6's bug: a clone (and its venv) under /tmp, where the sandbox puts its private /tmp
    code = "import sys, tempfile\nprint(sys.executable, sys.prefix)\nprint(tempfile.mkstemp()[1][:9])"
    lines = run_ok(code, interpreter=venv_under_tmp).splitlines()
    prefix = str(Path(venv_under_tmp).parent.parent)
    assert lines == [f"{venv_under_tmp} {prefix}", "/scratch/"]


def test_an_unknown_containment_is_refused():
    with pytest.raises(ValueError, match=r"containment must be 'auto', 'namespaces' or 'none', got 'bwrap'"):
        run_python("print(1)", LIMITS, containment="bwrap")  # type: ignore[arg-type]


def test_a_killed_caller_takes_the_sandbox_with_it():
    marker = f"yatt-sandbox-marker-{secrets.token_hex(6)}"
    code = DOUBLE_FORK.format(marker=marker) + "time.sleep(60)\n"
    caller = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from yatt_rollout.sandbox import SandboxLimits, run_python\nrun_python({code!r}, SandboxLimits(wall_s=60.0))",
        ]
    )
    try:
        for _ in range(3000):  # until the grandchild runs (the caller starts and builds the sandbox first)
            if _processes_with(marker):
                break
            time.sleep(0.01)
        assert len(_processes_with(marker)) == 1
    finally:
        caller.kill()
        caller.wait()
    for _ in range(3000):  # the kernel ends the namespace asynchronously after the launcher's death
        if not _processes_with(marker):
            break
        time.sleep(0.01)
    assert _processes_with(marker) == []


def test_the_code_sees_none_of_the_callers_environment(monkeypatch):
    monkeypatch.setenv("YATT_TEST_SECRET_TOKEN", "s3cret")
    keys = ["HOME", "LC_CTYPE", "OMP_NUM_THREADS", "PATH", "PYTHONDONTWRITEBYTECODE", "TMPDIR"]
    code = "import os\nprint(sorted(os.environ), 's3cret' in open('/proc/1/environ', 'rb').read().decode())"
    result = run_python(code, LIMITS)
    # its own variables only (LC_CTYPE: the interpreter's locale coercion); the init's are not readable
    assert result.stdout == "" and "PermissionError: [Errno 13]" in result.stderr
    assert run_ok("import os\nprint(sorted(os.environ))") == f"{keys}\n"


def test_a_failing_launcher_or_interpreter_is_unavailable_never_the_codes_crash(tmp_path, monkeypatch):
    with pytest.raises(SandboxUnavailable, match=r"no root for the interpreter /nonexistent/python: "):
        run_python("print(1)", LIMITS, interpreter="/nonexistent/python")
    here = Path(sandbox.__file__).parent
    shutil.copy(here / "sandbox_runner.py", tmp_path)
    (tmp_path / "sandbox_child.py").write_text("raise SystemExit('launcher broke')\n")
    monkeypatch.setattr(sandbox, "_HERE", tmp_path)
    with pytest.raises(
        SandboxUnavailable, match=r"^the sandbox's launcher failed \(exit 1\): launcher broke\n$"
    ):
        run_python("print(1)", LIMITS)
