"""The local Ray's reaper on real processes (no Ray): it finds a tree's descendants, kills exactly the
processes it recorded when its pipe closes, and never a process that merely reuses a recorded pid. The
job-level check (loopback sockets, nothing left after a kill -9 of the driver) is in test_run_lifecycle."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from yatt_apps.runtime import local_ray

# a parent that starts a grandchild which outlives it (as Ray's agents outlive the raylet) and then waits
TREE = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"


def _wait(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def test_descendants_reach_every_generation_and_depth_limits_them():
    root = subprocess.Popen([sys.executable, "-c", TREE])
    try:
        assert _wait(lambda: len(local_ray.descendants([root.pid])) == 1)
        everything = local_ray.descendants([os.getpid()])
        children = local_ray.descendants([os.getpid()], depth=1)
        assert root.pid in children
        grandchildren = set(local_ray.descendants([root.pid]))
        assert (
            len(grandchildren) == 1 and grandchildren <= set(everything) and not grandchildren & set(children)
        )
        assert everything[root.pid] == local_ray.start_time(root.pid)
    finally:
        for pid in local_ray.descendants([root.pid]):
            os.kill(pid, 9)
        root.kill()
        root.wait()


def test_reap_kills_recorded_processes_and_spares_a_reused_pid():
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    started = local_ray.start_time(bystander.pid)
    assert started is not None
    known = {
        victim.pid: local_ray.start_time(victim.pid),
        bystander.pid: started + 1,
    }  # +1: "another" process
    assert local_ray.reap(known) == [victim.pid]
    assert victim.wait(timeout=10) == -9
    assert bystander.poll() is None
    bystander.kill()
    bystander.wait()


def test_the_reaper_kills_the_orphans_of_its_roots_after_its_pipe_closes():
    root = subprocess.Popen([sys.executable, "-c", TREE])
    assert _wait(lambda: len(local_ray.descendants([root.pid])) == 1)
    (orphan,) = local_ray.descendants([root.pid])
    reaper = local_ray.Reaper.spawn([root.pid])  # returns once its first scan has recorded the grandchild
    root.kill()  # the root dies first, as the raylet does: its child is now an orphan
    root.wait()
    assert local_ray.alive(orphan)
    reaper.close()
    assert reaper.proc.wait(timeout=local_ray.GRACE_S + 10) == 0
    assert _wait(lambda: not local_ray.alive(orphan), timeout_s=5)


UV_SWITCH = """
import ray, ray._private.ray_constants as constants
from yatt_apps.runtime import local_ray
imported = constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV
session = local_ray.start(num_cpus=1, num_gpus=0)
started = constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV
session.shutdown()
print(imported, started, constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV)
"""


def test_start_keeps_workers_in_place_under_uv_run_even_when_ray_was_imported_first():
    """Ray reads RAY_ENABLE_UV_RUN_RUNTIME_ENV at import (default on: under `uv run` every worker starts
    through uv in a packaged copy of the working directory). A program that imported Ray before setting it
    still gets it off while its local Ray runs, and its own value back after."""
    env = {k: v for k, v in os.environ.items() if k != local_ray.UV_RUN_ENV}
    out = subprocess.run(
        [sys.executable, "-c", UV_SWITCH], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "True False True"


FLAKY_START = """
import subprocess, sys, ray
from yatt_apps.runtime import local_ray
real_init, calls, stand_ins = ray.init, [], []

def init(**kwargs):  # test double: the first start leaves a process behind and times out, as Ray's does
    calls.append(kwargs)
    if len(calls) == 1:
        stand_ins.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
        raise Exception("The current node timed out during startup. This could happen because ...")
    return real_init(**kwargs)

ray.init = init
session = local_ray.start(num_cpus=1, num_gpus=0)
cpus = ray.cluster_resources()["CPU"]
session.shutdown()
stand_ins[0].wait(timeout=10)  # killed by the retry (a zombie until waited: the wait says it ended)
print(len(calls), cpus, stand_ins[0].returncode)

def broken(**kwargs):
    raise ValueError("not a timeout")

ray.init = broken
try:
    local_ray.start(num_cpus=1, num_gpus=0)
except ValueError as exc:
    print("raised", exc)
"""


def test_a_ray_start_that_times_out_is_tried_again_and_its_leftovers_killed():
    """Ray gives its raylet a fixed 30 s to register, which a busy machine can miss: the start is tried again
    (up to `START_ATTEMPTS`), after killing what the failed one left; any other error is the job's at once."""
    out = subprocess.run(
        [sys.executable, "-c", FLAKY_START], env=dict(os.environ), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-2:] == ["2 1.0 -9", "raised not a timeout"]
    assert "yatt: Ray's start timed out (attempt 1 of 3); retrying" in out.stderr
