"""The sandbox's cgroup layout on stand-in folders (cgroup v2 delegated or not, v1, hybrid), and the parsing of
/proc/self/mountinfo and /proc/self/cgroup: where each call's cgroup goes and which limits it gets."""

from __future__ import annotations

from pathlib import Path

from yatt_rollout.sandbox_cgroup import CgroupLayout, SandboxCgroup, _cgroup_mounts, _own_paths

MOUNTINFO = """\
25 30 0:22 / /sys/fs/cgroup rw,nosuid - tmpfs tmpfs rw,mode=755
26 25 0:23 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
27 25 0:24 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
28 25 0:25 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
29 25 0:26 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
"""
PROC_CGROUP = "9:name=systemd:/\n8:pids:/\n4:memory:/jobs/a\n1:cpu,cpuacct:/\n0::/user.slice\n"


def _files(folder: Path, **contents: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in contents.items():
        (folder / name.replace("_", ".", 1)).write_text(text)


def test_mountinfo_and_own_paths_are_read():
    assert _cgroup_mounts(MOUNTINFO) == {
        "memory": "/sys/fs/cgroup/memory",
        "pids": "/sys/fs/cgroup/pids",
        "v2": "/sys/fs/cgroup/unified",
    }
    assert _own_paths(PROC_CGROUP) == {"pids": "/", "memory": "/jobs/a", "v2": "/user.slice"}


def test_v2_delegated_own_cgroup_gets_one_folder_with_both_limits(tmp_path):
    _files(tmp_path, cgroup_controllers="cpu memory pids", cgroup_subtree_control="memory pids")
    _files(tmp_path / "svc", cgroup_subtree_control="memory pids")
    layout = CgroupLayout.from_mounts({"v2": str(tmp_path)}, {"v2": "/svc"})
    assert layout.parents == {"memory": (2, str(tmp_path / "svc")), "pids": (2, str(tmp_path / "svc"))}
    group = layout.create("call", memory_bytes=1000, max_processes=9)
    call = tmp_path / "svc" / "call"
    assert [(call / n).read_text() for n in ("memory.max", "memory.swap.max", "pids.max")] == [
        "1000",
        "0",
        "9",
    ]
    assert group.procs_files() == [str(call / "cgroup.procs")]
    (call / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 2\noom_kill 2\n")
    assert (group.controllers, group.oom_kills()) == (("memory", "pids"), 2)


def test_v2_without_delegation_uses_the_root_and_enables_the_controllers_there(tmp_path):
    _files(tmp_path, cgroup_controllers="cpu memory pids", cgroup_subtree_control="cpu")
    _files(tmp_path / "user.slice", cgroup_subtree_control="")
    layout = CgroupLayout.from_mounts({"v2": str(tmp_path)}, {"v2": "/user.slice"})
    assert layout.parents == {"memory": (2, str(tmp_path)), "pids": (2, str(tmp_path))}
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+memory +pids"


def test_v1_gets_a_folder_per_hierarchy_under_its_own_cgroup(tmp_path):
    _files(tmp_path / "unified", cgroup_controllers="")  # a hybrid layout's empty v2 half
    _files(tmp_path / "memory" / "jobs" / "a")
    _files(tmp_path / "pids")
    mounts = {
        "v2": str(tmp_path / "unified"),
        "memory": str(tmp_path / "memory"),
        "pids": str(tmp_path / "pids"),
    }
    layout = CgroupLayout.from_mounts(mounts, _own_paths(PROC_CGROUP))
    assert layout.parents == {
        "memory": (1, str(tmp_path / "memory/jobs/a")),
        "pids": (1, str(tmp_path / "pids")),
    }
    group = layout.create("call", memory_bytes=4096, max_processes=5)
    memory, pids = tmp_path / "memory/jobs/a/call", tmp_path / "pids/call"
    assert (memory / "memory.limit_in_bytes").read_text() == "4096"
    assert (memory / "memory.memsw.limit_in_bytes").read_text() == "4096"
    assert (pids / "pids.max").read_text() == "5"
    assert group.procs_files() == sorted([str(memory / "cgroup.procs"), str(pids / "cgroup.procs")])
    (memory / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    assert group.oom_kills() == 3


def test_no_cgroup_anywhere_leaves_the_rlimits(tmp_path):
    layout = CgroupLayout.detect(mountinfo=str(tmp_path / "missing"))
    assert layout.parents == {}
    group = layout.create("call", memory_bytes=1, max_processes=1)
    assert (group.controllers, group.procs_files(), group.oom_kills()) == ((), [], 0)


def test_refused_forks_are_read_from_pids_events(tmp_path):
    group = SandboxCgroup()
    assert group.process_limit_hits() == 0  # no pids cgroup: nothing counts them
    _files(tmp_path / "call", pids_events="max 7\n")
    group.add("pids", 1, str(tmp_path / "call"))
    assert group.process_limit_hits() == 7
