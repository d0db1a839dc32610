"""The Python sandbox and the tools: every failure comes back as the right status within its limits, the
host process is unharmed, and through `ToolEnvironment` each failure is an error observation, counted."""

from __future__ import annotations

import os
import resource
import tempfile
from fractions import Fraction

import pytest
from yatt_rollout.env import ToolEnvironment, parse_tool_calls
from yatt_rollout.sandbox import SandboxLimits, run_python
from yatt_rollout.tools import calculator_tool, evaluate_arithmetic, python_tool
from yatt_rollout.types import Action, ToolCall

LIMITS = SandboxLimits(cpu_s=1, memory_bytes=256 << 20, output_bytes=4096, wall_s=3.0)
# generous margins: the machine is shared, and a fresh interpreter starts in ~0.1 s when idle
SLACK_S = 8.0


@pytest.fixture(autouse=True)
def host_unharmed():
    """The host's limits, working directory and pid are what they were, and it still allocates."""
    before = (resource.getrlimit(resource.RLIMIT_AS), resource.getrlimit(resource.RLIMIT_CPU), os.getcwd())
    yield
    assert (
        resource.getrlimit(resource.RLIMIT_AS),
        resource.getrlimit(resource.RLIMIT_CPU),
        os.getcwd(),
    ) == before
    assert len(bytearray(64 << 20)) == 64 << 20


def test_ok_prints_and_uses_a_throwaway_dir():
    result = run_python("import os\nopen('f.txt', 'w').write('hi')\nprint(6 * 7, os.listdir('.'))", LIMITS)
    assert (result.status, result.exit_code, result.stdout) == ("ok", 0, "42 ['f.txt']\n")
    assert result.network_isolation == "namespace"
    # contained: the call's own tmpfs; uncontained: a host folder, removed after the run
    assert run_python("import os; print(os.getcwd())", LIMITS).stdout == "/scratch\n"
    first_dir = run_python("import os; print(os.getcwd())", LIMITS, containment="none").stdout.strip()
    assert first_dir.startswith(tempfile.gettempdir()) and not os.path.exists(first_dir)


def test_infinite_loop_is_a_timeout_by_cpu_limit():
    result = run_python("while True:\n    pass", LIMITS)
    assert result.status == "timeout"
    assert result.wall_s < LIMITS.cpu_s + 1 + SLACK_S


def test_sleeping_forever_is_a_timeout_by_wall_limit():
    result = run_python("import time\ntime.sleep(60)", LIMITS)
    assert result.status == "timeout" and "wall-time limit" in result.stderr
    assert LIMITS.wall_s <= result.wall_s < LIMITS.wall_s + SLACK_S


def test_memory_bomb_is_memory():
    for code in ("x = bytearray(10**10)", "a = []\nwhile True:\n    a.append(' ' * 10**6)"):
        result = run_python(code, LIMITS)
        assert result.status == "memory", (code, result)
        assert result.wall_s < LIMITS.wall_s + SLACK_S


@pytest.mark.parametrize("network", ["auto", "patch"])
def test_network_call_fails(network):
    limits = SandboxLimits(cpu_s=2, wall_s=5.0, output_bytes=4096, network=network)
    # the socket patch is the uncontained sandbox's fallback; a contained call always has its own namespace
    containment = "none" if network == "patch" else "auto"
    code = "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=2)\nprint('connected')"
    result = run_python(code, limits, containment=containment)
    assert result.status == "network" and "connected" not in result.stdout
    if network == "patch":
        assert result.network_isolation == "patched" and "network access is disabled" in result.stderr
    # name resolution and urllib fail the same way
    code = "import urllib.request\nurllib.request.urlopen('http://example.com', timeout=2)"
    assert run_python(code, limits, containment=containment).status == "network"
    # code that catches the error itself still gets no connection
    caught = (
        "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 80), timeout=2)\n    print('open')\n"
    )
    caught += "except OSError as err:\n    print('refused')"
    assert run_python(caught, limits, containment=containment).stdout == "refused\n"


def test_huge_print_is_output_limit():
    result = run_python("while True:\n    print('y' * 1000)", LIMITS)
    assert result.status == "output_limit"
    assert len(result.stdout) <= LIMITS.output_bytes and result.stdout.startswith("y" * 1000)
    assert result.wall_s < LIMITS.wall_s + SLACK_S


def test_crash_and_malformed_code():
    crash = run_python("1 / 0", LIMITS)
    assert (crash.status, crash.exit_code) == ("crash", 1) and "ZeroDivisionError" in crash.stderr
    assert run_python("import os\nos.abort()", LIMITS).status == "crash"
    malformed = run_python("def f(:", LIMITS)
    assert malformed.status == "malformed" and "SyntaxError" in malformed.stderr


def test_limits_are_validated():
    with pytest.raises(ValueError, match=r"SandboxLimits.wall_s must be > 0, got 0"):
        SandboxLimits(wall_s=0)


def test_calculator_values():
    assert evaluate_arithmetic("(3 + 4) * 2") == 14
    assert evaluate_arithmetic("2 + 3 * 4 - 6 / 3") == 12
    assert evaluate_arithmetic("-3 - -2") == -1
    assert evaluate_arithmetic("7 / 2") == Fraction(7, 2)
    calc = calculator_tool()
    assert calc({"expression": "7 / 2"}).output == "3.5"
    assert calc({"expression": "12 - 5"}).output == "7"
    for bad, message in (
        ("1 / 0", "division by zero"),
        ("2 * (3", "missing ')'"),
        ("3 ** 2", "unexpected '*'"),
        ("__import__('os')", "unexpected character '_'"),
        ("1 +", "unexpected end"),
    ):
        result = calc({"expression": bad})
        assert result.status == "error" and message in result.output, (bad, result)
    assert calc({"expr": "1"}).status == "malformed"


def test_parse_tool_calls():
    text = (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
        "<tool_call>[1, 2]</tool_call><tool_call>{oops</tool_call><tool_call>"
    )
    calls, problems = parse_tool_calls(text)
    assert calls == [
        ToolCall(name="calculator", arguments={"expression": "1+1"}),
        ToolCall(name="python", arguments={"code": "print(1)"}),
    ]
    assert len(problems) == 3
    assert problems[0].startswith('tool call must be an object with a string "name"')
    assert problems[1].startswith("tool call is not valid JSON")
    assert problems[2] == "<tool_call> without </tool_call>"
    assert parse_tool_calls("no calls here") == ([], [])


def test_python_tool_failures_are_counted_error_observations():
    env = ToolEnvironment([python_tool(LIMITS), calculator_tool()])
    env.reset({"prompt": "p"})
    codes = [
        "print(40 + 2)",
        "while True:\n    pass",
        "x = bytearray(10**10)",
        "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)",
        "print('z' * 10**5)",
    ]
    calls = [ToolCall(name="python", arguments={"code": c}) for c in codes]
    calls.append(ToolCall(name="python", arguments={"source": "print(1)"}))
    result = env.step(Action(text="...", tool_calls=calls, malformed=["tool call is not valid JSON"]))
    assert not result.done and result.tool_calls == 7
    assert result.tool_errors == ["malformed", "timeout", "memory", "network", "output_limit", "malformed"]
    contents = [m.content for m in result.observation.messages]
    assert contents[0].startswith("error: malformed tool call:")
    assert contents[1] == "42\n"
    assert [c.split(":")[1].strip() for c in contents[2:6]] == [
        "timeout",
        "memory",
        "network",
        "output_limit",
    ]
    assert contents[6] == "error: malformed: python: argument 'code' must be a string, got missing"
    final = env.step(Action(text="42"))
    assert final.done and final.tool_calls == 0 and final.observation.messages == []
