"""The Ray a job starts for itself: reachable from this machine only, and gone when the driver is.

Local by default. Ray binds its GCS, raylet, object manager and every worker's gRPC server to the node's
address, which it resolves to the routed interface on Linux (a `_node_ip_address="127.0.0.1"` is rewritten
to it). Ray's one switch for a loopback node is the flag that macOS and Windows run with
(`ray_constants.ENABLE_RAY_CLUSTER` off, from `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`): the node address is
then 127.0.0.1 and every one of those services listens there (measured with Ray 2.60: no socket of the
job's processes on another interface). It is set for the driver (already imported) and in the environment
its processes inherit. A run that joins a cluster (`ray.address`) changes nothing: see the README's
Multi-node section for what that exposes.

Gone with the driver. A kill -9 of the driver takes the GCS and raylet down (Ray fate-shares them) but leaves
the raylet's DashboardAgent and RuntimeEnvAgent alive under PID 1. A reaper process, started next to Ray,
keeps the list of Ray's processes (the driver's children that `ray.init` started, and all of their
descendants; pid and start time, so a reused pid is never hit) and SIGKILLs whichever of them are still
alive a few seconds after the driver's end of its pipe closes: on kill -9, or on a normal exit once
`ray.shutdown` has had its chance. Other children of the driver (an embedding program's, a test's) are not
Ray's and are never touched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
UV_RUN_ENV = "RAY_ENABLE_UV_RUN_RUNTIME_ENV"
GRACE_S = 3.0  # after the driver's end: Ray's own shutdown goes first
POLL_S = 1.0  # how often the reaper refreshes its list of the driver's descendants
START_ATTEMPTS = 3  # Ray starts tried before its node-start timeout is the job's error
STARTUP_TIMEOUT = "timed out during startup"  # Ray's message when its raylet did not register in time


def start(num_cpus: int, num_gpus: int) -> LocalRay:
    """Start a local Ray on the loopback interface, with no dashboard, and its reaper."""
    import ray
    import ray._private.ray_constants as ray_constants
    from yatt_controller.worker_group import host_env_inherited

    before_env, before_flag = os.environ.get(LOOPBACK_ENV), ray_constants.ENABLE_RAY_CLUSTER
    before_uv = ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV
    os.environ[LOOPBACK_ENV] = "0"  # Ray's processes and workers read it at import
    ray_constants.ENABLE_RAY_CLUSTER = False  # the driver's copy, read when ray.init picks the node address
    # under `uv run`, Ray packages the working directory (.venv included) as every worker's runtime env and
    # starts each worker through uv in a copy of it, unless RAY_ENABLE_UV_RUN_RUNTIME_ENV is off, which Ray
    # reads at import: a program that imported Ray before setting it (a benchmark, a notebook) still gets
    # workers started in place. Set it to 1 to have Ray package the directory.
    ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = os.environ.get(UV_RUN_ENV, "0").lower() in ("1", "true")
    before = set(descendants([os.getpid()], depth=1))
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            with host_env_inherited():  # the hosts start without a runtime_env of their own
                ray.init(
                    address="local",
                    num_cpus=num_cpus,
                    num_gpus=num_gpus,
                    include_dashboard=False,
                    object_store_memory=512 * 2**20,
                    log_to_driver=False,
                    logging_level=logging.WARNING,  # no "Started a local Ray instance" line in a normal run
                )
            break
        except Exception as exc:
            if STARTUP_TIMEOUT not in str(exc) or attempt == START_ATTEMPTS:
                raise
            # Ray waits a fixed 30 s for its raylet to register, which a machine busy with other work can
            # miss; what the failed start left (GCS, raylet, monitors) goes before the next try
            ray.shutdown()
            left = {pid: t for pid, t in descendants([os.getpid()], depth=1).items() if pid not in before}
            reap({**left, **descendants(list(left))})
            print(
                f"yatt: Ray's start timed out (attempt {attempt} of {START_ATTEMPTS}); retrying",
                file=sys.stderr,
            )
    # log_to_driver=False: nothing reads the worker output Ray's log monitor would forward, and it polls every
    # worker's log files ten times a second for the whole run (about 3 core-seconds per test session here)
    with contextlib.suppress(Exception):
        ray._private.worker._global_node.kill_log_monitor()
    ray_roots = sorted(set(descendants([os.getpid()], depth=1)) - before)  # GCS, raylet, monitors
    return LocalRay(Reaper.spawn(ray_roots), restore=(before_env, before_flag, before_uv))


class LocalRay:
    """A started local Ray; `shutdown()` stops it and then its reaper (which kills what Ray left)."""

    def __init__(self, reaper: Reaper, restore: tuple[str | None, bool, bool]) -> None:
        self.reaper, self.restore = reaper, restore

    def shutdown(self) -> None:
        """Stop Ray, then the reaper; the process's loopback and uv switches go back to what they were (an
        embedding program may join a cluster next)."""
        import ray
        import ray._private.ray_constants as ray_constants

        try:
            ray.shutdown()
        finally:
            self.reaper.close()
            env, ray_constants.ENABLE_RAY_CLUSTER, ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = self.restore
            if env is None:
                os.environ.pop(LOOPBACK_ENV, None)
            else:
                os.environ[LOOPBACK_ENV] = env


class Reaper:
    """The driver's end of the reaper: a pipe whose close (explicit or by the driver's death) starts the
    reaping."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    @classmethod
    def spawn(cls, roots: list[int]) -> Reaper:
        proc = subprocess.Popen(
            [sys.executable, "-m", "yatt_apps.runtime.local_ray", *map(str, roots)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C to the driver's group must not stop the reaper first
        )
        # armed: its first scan holds every process of the tree so far (a driver that dies right after
        # this still has them reaped); an empty read is a reaper that died at start, which reaps nothing
        assert proc.stdout is not None
        proc.stdout.read(1)
        return cls(proc)

    def close(self) -> None:
        """Closing its stdin is the signal; the reaper exits on its own after the grace time."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ")"
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def alive(pid: int, started: int | None = None) -> bool:
    """Whether `pid` is a live process (not a zombie) and, given `started`, still the one that started then."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0] != "Z" and (started is None or int(fields[19]) == started)


def descendants(roots: list[int], depth: int | None = None) -> dict[int, int]:
    """{pid: start time} of every live descendant of `roots` (down to `depth` generations; all when None),
    from one scan of /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found: dict[int, int] = {}
    stack = [(pid, 1) for root in roots for pid in children.get(root, [])]
    while stack:
        pid, generation = stack.pop()
        if (started := start_time(pid)) is not None:
            found[pid] = started
        if depth is None or generation < depth:
            stack.extend((child, generation + 1) for child in children.get(pid, []))
    return found


def reap(known: dict[int, int]) -> list[int]:
    """SIGKILL every process of `known` that is still the same process (same start time); the pids hit."""
    killed = []
    for pid, started in known.items():
        if start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


def main(roots: list[int]) -> None:
    """The reaper: watch Ray's processes (`roots` and their descendants) until stdin closes, wait the grace
    time, kill the rest."""
    known = {pid: started for pid in roots if (started := start_time(pid)) is not None}
    known.update(descendants(roots))
    os.write(sys.stdout.fileno(), b"r")  # armed (`Reaper.spawn` waits for it)
    while True:
        known.update(descendants(roots))
        ready, _, _ = select.select([sys.stdin.buffer], [], [], POLL_S)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break  # EOF: closed by the driver, or the driver died
    time.sleep(GRACE_S)
    reap(known)


if __name__ == "__main__":
    main([int(arg) for arg in sys.argv[1:]])
