"""The contained sandbox's launcher, run as a script (`python -I -S sandbox_child.py SPEC_JSON`) by `sandbox.py`.

Three processes, stdlib only (this file is run by path and imports nothing of yatt):
- the launcher (host PID namespace): `unshare(NEWPID | NEWNET | NEWIPC | NEWUTS)`, forks the init, writes
  the init's host pid to `pid_path` (the parent's wall-time kill aims at it) and waits for it;
- the init (PID 1 of the new PID namespace; dies with the launcher by PDEATHSIG): joins the call's cgroups,
  unshares a mount namespace of its own, builds the new root (a read-only tmpfs holding read-only binds of what the interpreter needs, a fresh /proc,
  a minimal /dev, a private tmpfs `/scratch`), pivots into it and forks the worker. When the worker exits it
  SIGKILLs everything else in the namespace, reaps it, and writes the worker's end (`exit N`, `signal N`) to
  the status file. Anything left is killed by the kernel when PID 1 exits: setsid double forks included.
- the worker: drops every capability from its bounding set, all groups, and becomes the call's unprivileged
  uid/gid (which clears its capabilities), sets no_new_privs and RLIMIT_NPROC/CORE, and execs the interpreter
  with the runner. Its stdout/stderr are the files the parent opened on the host.
A setup failure is written as `setup <message>` to the status file (the parent raises SandboxUnavailable).
"""

import contextlib
import ctypes
import errno
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
# pivot_root has no glibc wrapper: its syscall number per architecture
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
DEVICES = ("null", "zero", "full", "random", "urandom")

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    pass


def check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)} (errno {err})")


def mount(
    source: "str | None", target: str, fstype: "str | None", flags: int, data: "str | None" = None
) -> None:
    check(
        libc.mount(
            source and source.encode(),
            target.encode(),
            fstype and fstype.encode(),
            flags,
            data and data.encode(),
        ),
        f"mount {source or fstype} on {target}",
    )


# statvfs's ST_* flags that are also MS_* flags (same bits): noexec and the atime flags of the source mount are
# locked in a user namespace, and a remount that drops them is refused
KEPT_FLAGS = MS_NOEXEC | 1024 | 2048 | 4096  # | MS_NOATIME | MS_NODIRATIME | MS_RELATIME


def bind(source: str, target: str, writable: bool = False) -> None:
    mount(source, target, None, MS_BIND)
    flags = MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | (0 if writable else MS_RDONLY)
    mount(None, target, None, flags | (os.statvfs(target).f_flag & KEPT_FLAGS))


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def make_point(path: str, is_dir: bool) -> None:
    if is_dir:
        os.makedirs(path, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a"):
            pass


def build_root(spec: dict) -> None:
    """Mount the new root at spec["root"] (host path) and everything inside it; returns nothing, raises
    SetupError naming the step that failed."""
    root = spec["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for kind, path, target in spec["entries"]:
        inside = root + path
        if kind == "symlink":
            make_point(os.path.dirname(inside), True)
            os.symlink(target, inside)
        else:
            make_point(inside, kind == "dir")
            bind(path, inside)
    make_point(root + "/proc", True)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    build_dev(root)
    scratch = root + "/scratch"
    make_point(scratch, True)
    options = f"size={spec['scratch_bytes']},mode=700,uid={spec['uid']},gid={spec['gid']}"
    mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, options)
    # /tmp is the scratch too, unless it holds read-only binds (an interpreter under /tmp): then it stays read-only
    if spec["tmp_is_scratch"]:
        make_point(root + "/tmp", True)
        bind(scratch, root + "/tmp", writable=True)
    bind(scratch, root + "/dev/shm", writable=True)  # the same tmpfs: still one writable place
    mount(None, root + "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID)
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    pivot(root)


def build_dev(root: str) -> None:
    dev = root + "/dev"
    make_point(dev, True)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID, "size=64k,mode=755")
    for name in DEVICES:
        if os.path.exists("/dev/" + name):
            make_point(f"{dev}/{name}", False)
            mount("/dev/" + name, f"{dev}/{name}", None, MS_BIND)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
    ):
        os.symlink(target, f"{dev}/{name}")
    os.symlink("/proc/self/fd/2", dev + "/stderr")
    make_point(dev + "/shm", True)


def pivot(root: str) -> None:
    """Make `root` the root and detach the old one (nothing of the host's tree stays reachable)."""
    os.chdir(root)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is not None and libc.syscall(number, b".", b".") == 0:
        check(libc.umount2(b".", MNT_DETACH), "umount the old root")
    else:  # no pivot_root (e.g. a rootfs root): move the mount over / and chroot (the worker lacks CAP_SYS_CHROOT)
        mount(root, "/", None, 0x2000)  # MS_MOVE
        os.chroot(".")
    os.chdir("/")


def become_worker(spec: dict, code_fd: int) -> None:
    """In the worker: no capabilities, the call's uid, then exec the interpreter with the runner."""
    with open("/proc/self/oom_score_adj") as f:
        if int(f.read()) < 0:  # the init's -1000 is not the code's (raising is always allowed)
            write("/proc/self/oom_score_adj", "0")
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
            break  # past the kernel's last capability
    if not spec["userns"]:  # a user namespace maps one uid (the caller's) and denies setgroups
        os.setgroups([])
        os.setresgid(spec["gid"], spec["gid"], spec["gid"])
        os.setresuid(spec["uid"], spec["uid"], spec["uid"])  # leaving uid 0 clears every capability set
    # in a user namespace the worker stays its uid 0 (the caller's uid outside): the exec below gives it no
    # capabilities, since its bounding and inheritable sets are empty
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # the uid is this call's alone, so the count is the whole tree's (the cgroup's pids.max where available); in
    # a user namespace the launcher and the init are that uid too (the kernel counts per namespace and uid)
    nproc = spec["max_processes"] + (2 if spec["userns"] else 0)
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    os.chdir("/scratch")
    os.set_inheritable(code_fd, True)
    argv = [spec["interpreter"], "-I", "-c", spec["runner"], str(code_fd), *spec["runner_args"]]
    os.execve(spec["interpreter"], argv, spec["env"])


def run_init(spec: dict, code_fd: int, status_fd: int) -> None:
    """PID 1 of the namespace: set up, run the worker, kill the rest, report the worker's end."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # the tree's OOM kill should take the code's processes, not the init (whose death ends them all anyway);
    # lowering needs host root, so elsewhere the init just stays the smallest process
    with contextlib.suppress(OSError):
        write("/proc/self/oom_score_adj", "-1000")
    try:
        for procs in spec["cgroup_procs"]:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        if spec["userns"]:  # nested user namespaces would hand the code capabilities again (over nothing
            # of the host's, but with the kernel surface that comes with them): this namespace makes none
            with open("/proc/sys/user/max_user_namespaces", "w") as f:
                f.write("0")
        check(libc.unshare(CLONE_NEWNS), "unshare of the mount namespace")
        build_root(spec)
        check(libc.sethostname(b"sandbox", 7), "sethostname")
    except (SetupError, OSError) as err:
        os.write(status_fd, f"setup {err}".encode())
        os._exit(97)
    worker = os.fork()
    if worker == 0:
        try:
            become_worker(spec, code_fd)  # the status fd closes on its exec
        except BaseException as err:  # the worker must never return into the init's code
            os.write(status_fd, f"setup the worker: {err}".encode())
        os._exit(98)
    os.close(code_fd)
    status = wait_for(worker)
    kill_the_rest()
    if os.fstat(status_fd).st_size:
        pass  # the worker's setup failure is the news
    elif os.WIFSIGNALED(status):
        os.write(status_fd, f"signal {os.WTERMSIG(status)}".encode())
    else:
        os.write(status_fd, f"exit {os.WEXITSTATUS(status)}".encode())
    os._exit(0)


def wait_for(worker: int) -> int:
    while True:  # reaps orphans re-parented to PID 1 on the way
        pid, status = os.waitpid(-1, 0)
        if pid == worker:
            return status


def kill_the_rest() -> None:
    with contextlib.suppress(ProcessLookupError):  # none left
        os.kill(-1, signal.SIGKILL)  # every process of the namespace but PID 1
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def map_ids(uid: int, gid: int) -> None:
    """Map uid/gid 0 of the new user namespace to the caller's own ids (the only ones it may map)."""
    for name, text in (("uid_map", f"0 {uid} 1"), ("setgroups", "deny"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def main() -> None:
    spec = json.loads(sys.argv[1])
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # a killed caller takes the sandbox with it
    if os.getppid() != spec["caller_pid"]:
        sys.exit(99)  # the caller died before the line above
    status_fd = os.open(spec["status_path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    # the mount namespace is the init's alone (below): pivot_root moves the root of every process of the
    # namespace, and the launcher must keep the host's to write the init's pid
    flags = (
        CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | (CLONE_NEWUSER if spec["userns"] else 0)
    )
    try:
        check(libc.unshare(flags), "unshare of the namespaces")
        if spec["userns"]:
            map_ids(spec["outer_uid"], spec["outer_gid"])
    except (SetupError, OSError) as err:
        os.write(status_fd, f"setup {err}".encode())
        sys.exit(97)
    code_fd = os.open(spec["code_path"], os.O_RDONLY)
    init = os.fork()
    if init == 0:
        run_init(spec, code_fd, status_fd)
    with open(spec["pid_path"], "w") as f:
        f.write(str(init))
    _, status = os.waitpid(init, 0)
    sys.exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 99)


if __name__ == "__main__":
    main()
