"""`local_calls`: refs of calls run in process mixed with object refs in `get` and `wait`, with Ray's meaning;
errors raised as they are; a timeout as Ray's. (A hosted
controller's calls reaching them: test_runtime.py, `pid_step`.)"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
from yatt_controller import local_calls
from yatt_controller.local_calls import LocalRef


@pytest.fixture
def threads():
    with ThreadPoolExecutor(4) as pool:
        yield pool


def _call(pool: ThreadPoolExecutor, fn, *args) -> LocalRef:
    return LocalRef(pool.submit(fn, *args), getattr(fn, "__name__", "call"))


def test_get_returns_values_in_the_order_given_and_raises_a_calls_own_error(threads):
    gate = threading.Event()
    slow, fast = _call(threads, lambda: gate.wait(5) and "slow"), _call(threads, lambda: "fast")
    assert local_calls.get(fast) == "fast"
    gate.set()
    assert local_calls.get([slow, fast]) == ["slow", "fast"]

    def broken():
        raise ValueError("row 3 has no reference")

    with pytest.raises(ValueError, match="row 3 has no reference"):  # not wrapped (Ray would wrap it)
        local_calls.get([fast, _call(threads, broken)])


def test_wait_returns_the_first_done_in_the_order_given_and_keeps_the_rest(threads):
    gates = [threading.Event() for _ in range(3)]
    refs = [_call(threads, gate.wait, 5) for gate in gates]
    ready, rest = local_calls.wait(refs, num_returns=1, timeout=0)
    assert (ready, rest) == ([], refs)  # nothing done yet: a zero timeout returns at once
    gates[2].set()
    ready, rest = local_calls.wait(refs, num_returns=1)
    assert ready == [refs[2]] and rest == refs[:2]
    gates[0].set()
    gates[1].set()
    local_calls.get(refs[:2])  # all three done now
    ready, rest = local_calls.wait(refs, num_returns=2)
    assert ready == refs[:2] and rest == [refs[2]]  # the order given, not the order of finishing


def test_a_timeout_is_rays_timeout_error(threads):
    gate = threading.Event()
    ref = _call(threads, gate.wait, 5)
    with pytest.raises(ray.exceptions.GetTimeoutError, match=r"wait: no result within 0.05s"):
        local_calls.get(ref, timeout=0.05)
    ready, rest = local_calls.wait([ref], num_returns=1, timeout=0.05)
    assert (ready, rest) == ([], [ref])
    gate.set()
    assert local_calls.get(ref) is True


def test_a_calls_own_timeout_error_is_its_own_and_a_bad_num_returns_is_refused(threads):
    def socket_timeout():
        raise TimeoutError("the judge's socket timed out")

    ref = _call(threads, socket_timeout)
    with pytest.raises(TimeoutError, match="the judge's socket timed out") as raised:
        local_calls.get(ref, timeout=5)
    assert not isinstance(raised.value, ray.exceptions.GetTimeoutError)
    with pytest.raises(ValueError, match=r"num_returns must be in \[1, 1\], got 2"):
        local_calls.wait([ref], num_returns=2)


def test_a_failed_call_nobody_fetched_is_reported(threads, capsys):
    def broken():
        raise RuntimeError("the engine ran out of blocks")

    ref = _call(threads, broken)
    ref.future.exception()  # finished
    del ref
    assert (
        "failed and its result was never fetched: broken: RuntimeError('the engine ran out of blocks')"
        in (capsys.readouterr().err)
    )
    fetched = _call(threads, broken)
    with pytest.raises(RuntimeError):
        local_calls.get(fetched)
    del fetched
    assert capsys.readouterr().err == ""  # its caller saw the error


def test_here_is_one_process_and_pickles_as_none():
    import pickle

    class Handle:  # an actor handle's id, as Ray's handles hold it
        def __init__(self, hex_id: str) -> None:
            self._actor_id = type("ActorID", (), {"hex": lambda _: hex_id})()

    host = object()
    here = local_calls.Here("ab12", host)
    assert here.host_of(Handle("ab12")) is host
    assert here.host_of(Handle("cd34")) is None and here.host_of(object()) is None
    assert pickle.loads(pickle.dumps(here)) is None
