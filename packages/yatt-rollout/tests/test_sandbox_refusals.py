"""What the sandbox refuses that the README promises beyond test_sandbox's limits: writes outside its own
folder and fork bombs. Each run returns a failed status and, through the python tool, a counted error
observation; the host is untouched (no file appears outside, the host keeps running)."""

from __future__ import annotations

import os
import uuid

from yatt_rollout.env import ToolEnvironment
from yatt_rollout.sandbox import SandboxLimits, run_python
from yatt_rollout.tools import python_tool
from yatt_rollout.types import Action, ToolCall

LIMITS = SandboxLimits(cpu_s=2, memory_bytes=256 << 20, output_bytes=4096, wall_s=5.0)


def test_a_write_outside_its_folder_is_refused(tmp_path):
    target = tmp_path / f"escape-{uuid.uuid4().hex}"
    result = run_python(f"open({str(target)!r}, 'w').write('x')\nprint('wrote')", LIMITS)
    assert result.status != "ok" and "wrote" not in result.stdout
    assert not target.exists()  # the host's file system never saw it


def test_a_fork_bomb_is_contained_and_counted():
    bomb = "import os\nwhile True:\n    os.fork()"
    result = run_python(bomb, LIMITS)
    # the process limit makes fork fail (EAGAIN) in every copy: its own status, one line per copy, not a
    # traceback each (those filled the output and came back as output_limit)
    assert result.status == "processes", result
    assert result.stderr.endswith(
        f"refused: a new process past the tree's limit of {LIMITS.max_processes} processes"
    )
    assert "Traceback" not in result.stderr
    assert os.getpid() > 0  # the host is still here
    env = ToolEnvironment([python_tool(LIMITS)])
    env.reset({"prompt": "p"})
    step = env.step(Action(text="", tool_calls=[ToolCall(name="python", arguments={"code": bomb})]))
    assert (step.tool_calls, step.tool_errors) == (1, ["processes"])
    assert step.observation.messages[0].content.startswith("error: processes: python: processes\n")


def test_a_failed_fork_the_code_handles_is_its_own_business():
    code = (
        "import os, time\nkids = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
        "            time.sleep(5)\n            os._exit(0)\n        kids += 1\n"
        "except BlockingIOError:\n    print('refused after', kids)"
    )
    result = run_python(code, SandboxLimits(cpu_s=2, output_bytes=4096, wall_s=5.0, max_processes=4))
    assert (result.status, result.stdout) == ("ok", "refused after 3\n")


def test_the_process_limit_stays_the_status_when_the_output_is_already_full():
    """A fork bomb's copies can fill the output before the first copy's own refusal line is written: the
    status is still the process limit, not the full output it led to (what made the bomb's tool call come
    back as output_limit once in a CI run)."""
    code = "import errno, sys\nsys.stderr.write('x' * 5000)\nraise BlockingIOError(errno.EAGAIN, 'fork')"
    result = run_python(code, LIMITS)
    assert result.status == "processes", result
    full = run_python("import sys\nsys.stderr.write('x' * 5000)\nsys.stderr.flush()", LIMITS)
    assert full.status == "output_limit", full  # a full output alone is still its own status
