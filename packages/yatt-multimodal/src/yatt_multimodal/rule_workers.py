"""Rule rewards with hard limits: worker processes that can be killed, a deadline per request.

A rule that parses untrusted text can run unbounded: math_verify/sympy given `\\boxed{9^{9^{9^{9}}}}` computes
a power inside one C call that holds the GIL for minutes, so neither a thread timeout nor `signal.alarm` can
stop it. Here each request runs in a worker process; the one that overruns its deadline is SIGKILLed and
replaced, and that request's outcome is "timeout". The rest of the batch runs on the other workers.

Layout (`RuleWorkerPool`, an object its caller holds and closes):

    caller process ── pipes ──> supervisor process ── socketpair each ──> N worker processes (forked)

The supervisor is a fresh interpreter (`python -m yatt_multimodal.rule_workers`): it never inherits the
caller's threads, torch or Ray state, imports the rules once (math_verify and sympy warmed up), then forks
its workers, so starting or replacing one costs a fork, not an import. It owns every deadline: it waits on
the workers with a timer, kills the late one and forks a new one. It exits when the caller's end of its pipe
closes (`close()`, or the caller dying, kill -9 included), killing its workers; workers get SIGKILL when the
supervisor dies (PR_SET_PDEATHSIG) and a CPU-time limit per request (RLIMIT_CPU, deadline + 2 s), so none
outlives its deadline by much even when orphaned.

Rules cross the pipe pickled: module-level functions and `functools.partial`s of them (every rule in
`yatt_multimodal.rules`). A rule that cannot be pickled gets status "error" naming why.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import resource
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

from yatt_multimodal.types import RewardRequest

OutcomeStatus = Literal["ok", "error", "timeout"]
_HEADER = struct.Struct(">I")  # every message: 4-byte big-endian length, then a pickle
_PR_SET_PDEATHSIG = 1
_CPU_GRACE_S = 2  # a worker's CPU limit is its deadline plus this: the supervisor's kill comes first


@dataclass(frozen=True)
class RuleOutcome:
    """What one request gave: its value, or why there is none ("error": the rule raised or its worker died;
    "timeout": no value within the deadline, the worker was killed)."""

    status: OutcomeStatus
    value: float = 0.0
    error: str = ""


class RuleWorkerPool:
    """`num_workers` killable worker processes for rules. `submit(fn, request, deadline_s)` returns a future
    of a `RuleOutcome`; callers on several threads may submit at once. Each worker's address space is
    limited to `memory_limit_mb` (a memory bomb is a MemoryError, status "error"); None leaves it unlimited.
    The supervisor starts on the first `submit` (or `start()`); `close()` stops it and its workers."""

    def __init__(self, num_workers: int = 2, *, memory_limit_mb: int | None = 4096):
        if num_workers < 1:
            raise ValueError(f"RuleWorkerPool: num_workers must be >= 1, got {num_workers}")
        if memory_limit_mb is not None and memory_limit_mb < 256:
            raise ValueError(f"RuleWorkerPool: memory_limit_mb must be >= 256 or None, got {memory_limit_mb}")
        self.num_workers, self.memory_limit_mb = num_workers, memory_limit_mb
        self.restarts = 0  # workers killed at their deadline or found dead, and replaced
        self._lock = threading.Lock()  # guards the fields below
        # writes to the supervisor's pipe, never under `_lock`: a full pipe must not block the reader thread
        self._write_lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._to_supervisor: int | None = None
        self._futures: dict[int, Future[RuleOutcome]] = {}
        self._next_id = 0
        self._closed = False
        self._finalizer: weakref.finalize | None = None

    def __enter__(self) -> RuleWorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the supervisor and its workers now (otherwise the first `submit` does)."""
        with self._lock:
            self._ensure_running()

    def submit(
        self, fn: Callable[[RewardRequest], float], request: RewardRequest, deadline_s: float
    ) -> Future[RuleOutcome]:
        """Run `fn(request)` on a worker; its outcome is "timeout" if it has not returned `deadline_s`
        seconds after the worker took it (time waiting for a free worker does not count)."""
        if deadline_s <= 0:
            raise ValueError(f"RuleWorkerPool.submit: deadline_s must be > 0, got {deadline_s}")
        future: Future[RuleOutcome] = Future()
        try:
            payload = pickle.dumps((fn, request))
        except Exception as exc:  # lambdas, closures, bound methods of unpicklable objects
            future.set_result(RuleOutcome("error", error=f"rule {fn!r} cannot be sent to a worker: {exc}"))
            return future
        with self._lock:
            if self._closed:
                raise RuntimeError("RuleWorkerPool.submit after close()")
            to_supervisor = self._ensure_running()
            job_id, self._next_id = self._next_id, self._next_id + 1
            futures = self._futures
            futures[job_id] = future
        try:
            with self._write_lock:
                _write_frame(to_supervisor, (job_id, payload, float(deadline_s)))
        except OSError as exc:  # the supervisor died just now: this request fails, the next one restarts it
            with self._lock:
                futures.pop(job_id, None)
            future.set_result(RuleOutcome("error", error=f"the rule pool's supervisor is gone: {exc}"))
        return future

    def worker_pids(self) -> list[int]:
        """The supervisor's and its workers' process ids (read from /proc; for tests and diagnostics)."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return []
        children = f"/proc/{proc.pid}/task/{proc.pid}/children"
        with open(children) as f:
            return [proc.pid, *(int(p) for p in f.read().split())]

    def close(self) -> None:
        """Stop the supervisor (which kills its workers) and fail what is still pending."""
        with self._lock:
            self._closed = True
            proc, self._proc = self._proc, None
        if proc is not None and self._finalizer is not None:
            self._finalizer()  # closes the pipe (the supervisor's signal to stop) and waits for it
        self._fail_pending("the rule pool was closed")

    def _ensure_running(self) -> int:
        if self._proc is not None and self._proc.poll() is None and self._to_supervisor is not None:
            return self._to_supervisor
        to_sup_r, to_sup_w = os.pipe()
        from_sup_r, from_sup_w = os.pipe()
        args = [str(to_sup_r), str(from_sup_w), str(self.num_workers), str(self.memory_limit_mb or 0)]
        proc = subprocess.Popen(
            [sys.executable, "-m", "yatt_multimodal.rule_workers", *args],
            pass_fds=(to_sup_r, from_sup_w),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # a rule's prints must not reach the caller's output
        )
        os.close(to_sup_r)
        os.close(from_sup_w)
        self._proc, self._to_supervisor = proc, to_sup_w
        self._futures = {}  # this supervisor's jobs: its reader fails only these when it exits
        self._finalizer = weakref.finalize(self, _stop_supervisor, proc, to_sup_w)
        reader = threading.Thread(
            target=self._read, args=(from_sup_r, self._futures), name="rule-pool-reader", daemon=True
        )
        reader.start()
        return to_sup_w

    def _read(self, from_supervisor: int, futures: dict[int, Future[RuleOutcome]]) -> None:
        """Completes `futures` from the supervisor's replies until its pipe closes."""
        try:
            while (message := _read_frame(from_supervisor)) is not None:
                job_id, status, value, error, restarted = message
                with self._lock:
                    future = futures.pop(job_id, None)
                    self.restarts += int(restarted)
                if future is not None:
                    future.set_result(RuleOutcome(status, value, error))
        finally:
            os.close(from_supervisor)
            self._fail_pending("the rule pool's supervisor exited", futures)

    def _fail_pending(self, why: str, futures: dict[int, Future[RuleOutcome]] | None = None) -> None:
        with self._lock:
            futures = self._futures if futures is None else futures
            pending = list(futures.values())
            futures.clear()
        for future in pending:
            if not future.done():
                future.set_result(RuleOutcome("error", error=why))


def _stop_supervisor(proc: subprocess.Popen[bytes], to_supervisor: int) -> None:
    with contextlib.suppress(OSError):  # already closed
        os.close(to_supervisor)  # EOF: the supervisor kills its workers and exits
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# --- framing -------------------------------------------------------------------------------------------


def _write_frame(fd: int, message: Any) -> None:
    data = pickle.dumps(message)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exactly(fd: int, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int) -> Any | None:
    header = _read_exactly(fd, _HEADER.size)
    if header is None:
        return None
    body = _read_exactly(fd, _HEADER.unpack(header)[0])
    return None if body is None else pickle.loads(body)


def _split_frames(buffer: bytearray) -> list[Any]:
    """Complete messages at the front of `buffer`, removed from it."""
    out = []
    while len(buffer) >= _HEADER.size:
        size = _HEADER.unpack_from(buffer)[0]
        if len(buffer) < _HEADER.size + size:
            break
        out.append(pickle.loads(bytes(buffer[_HEADER.size : _HEADER.size + size])))
        del buffer[: _HEADER.size + size]
    return out


# --- the supervisor process ----------------------------------------------------------------------------


MAX_QUEUED = 4  # jobs handed to one worker at once: it starts the next without a round trip through here


@dataclass
class _Slot:
    pid: int
    sock: socket.socket
    buffer: bytearray
    queue: deque[tuple[int, bytes, float]] = field(default_factory=deque)  # sent to it, not yet answered
    deadline: float = 0.0  # monotonic deadline of the queue's first job, the one the worker is running

    @property
    def job(self) -> int | None:
        """The id of the job the worker is running (the first one it has not answered), or None when idle."""
        return self.queue[0][0] if self.queue else None


class _Supervisor:
    """Hands jobs to idle workers, relays their results, kills and replaces late or dead workers.

    An idle worker gets up to MAX_QUEUED jobs at once (fewer when there are few per worker), as separate
    messages it runs in order: between two jobs it waits on no one, where a round trip through this process
    cost each job a wake-up on a busy machine. Each job keeps its own deadline, counted from when the worker
    took it: when its predecessor's answer arrived here (or when it was sent, for the first). A worker killed
    at a deadline or found dead takes only its running job with it; the jobs queued behind it go back to the
    front of the pending queue."""

    def __init__(self, from_caller: int, to_caller: int, num_workers: int, memory_limit_mb: int):
        self.from_caller, self.to_caller, self.memory_limit_mb = from_caller, to_caller, memory_limit_mb
        self.selector = selectors.DefaultSelector()
        self.selector.register(from_caller, selectors.EVENT_READ, None)
        self.inbox = bytearray()
        self.pending: deque[tuple[int, bytes, float]] = deque()
        self.slots = [self._fork_worker() for _ in range(num_workers)]

    def run(self) -> None:
        while True:
            self._dispatch()
            busy = [s.deadline for s in self.slots if s.job is not None]
            timeout = max(0.0, min(busy) - time.monotonic()) if busy else None
            for key, _ in self.selector.select(timeout):
                if key.data is None:
                    chunk = os.read(self.from_caller, 1 << 16)
                    if not chunk:  # the caller closed the pool or died
                        self._shutdown()
                        return
                    self.inbox += chunk
                    self.pending.extend(_split_frames(self.inbox))
                else:
                    self._on_worker(key.data)
            self._kill_late()

    def _dispatch(self) -> None:
        idle = [slot for slot in self.slots if not slot.queue]
        if not idle or not self.pending:
            return
        share = min(MAX_QUEUED, -(-len(self.pending) // len(idle)))  # ceil: spread over the idle workers
        for slot in idle:
            jobs = [self.pending.popleft() for _ in range(min(share, len(self.pending)))]
            if not jobs:
                return
            slot.queue.extend(jobs)
            slot.deadline = time.monotonic() + jobs[0][2]
            data = b"".join(_HEADER.pack(len(d)) + d for d in (pickle.dumps((p, dl)) for _, p, dl in jobs))
            # a worker that died idle raises here; its EOF, read next, fails the first job and replaces it
            with contextlib.suppress(OSError):
                slot.sock.sendall(data)

    def _on_worker(self, slot: _Slot) -> None:
        chunk = slot.sock.recv(1 << 16)
        if not chunk:  # it died mid-request: a crash, the memory limit, or its CPU limit (SIGXCPU)
            status = self._replace(slot, kill=False)
            if slot.job is None:
                return
            late = status == -signal.SIGXCPU
            why = f"rule worker died ({_describe(status)})"
            self._reply(slot, "timeout" if late else "error", 0.0, why, restarted=True)
            self._requeue(slot)
            return
        slot.buffer += chunk
        for status, value, error in _split_frames(slot.buffer):
            self._reply(slot, status, value, error, restarted=False)

    def _kill_late(self) -> None:
        now = time.monotonic()
        for slot in self.slots:
            if slot.job is not None and slot.deadline <= now:
                self._replace(slot, kill=True)
                self._reply(slot, "timeout", 0.0, "its worker was killed and replaced", restarted=True)
                self._requeue(slot)

    def _reply(self, slot: _Slot, status: str, value: float, error: str, *, restarted: bool) -> None:
        """Answer the slot's running job; the next one in its queue is running from now on."""
        assert slot.queue, "a worker answered without a job"
        job_id = slot.queue.popleft()[0]
        _write_frame(self.to_caller, (job_id, status, value, error, restarted))
        if slot.queue:
            slot.deadline = time.monotonic() + slot.queue[0][2]

    def _requeue(self, slot: _Slot) -> None:
        """The jobs a replaced worker had queued go back, in order, to the front of the pending queue."""
        self.pending.extendleft(reversed(slot.queue))
        slot.queue.clear()

    def _replace(self, slot: _Slot, *, kill: bool) -> int:
        """Kill (if asked) and reap the slot's worker, fork its successor into the slot; the old exit status."""
        if kill:
            os.kill(slot.pid, signal.SIGKILL)
        self.selector.unregister(slot.sock)
        slot.sock.close()
        _, raw = os.waitpid(slot.pid, 0)
        fresh = self._fork_worker()
        slot.pid, slot.sock, slot.buffer = fresh.pid, fresh.sock, fresh.buffer
        self.selector.modify(slot.sock, selectors.EVENT_READ, slot)  # events of the new socket find this slot
        return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)

    def _fork_worker(self) -> _Slot:
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # the worker: nothing of the supervisor's but its own socket
            try:
                keep = theirs.fileno()  # close the supervisor's pipes, selector and other workers' sockets
                os.closerange(3, keep)
                os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
                _worker(theirs, self.memory_limit_mb)
            finally:
                os._exit(0)
        theirs.close()
        slot = _Slot(pid, ours, bytearray())
        self.selector.register(ours, selectors.EVENT_READ, slot)
        return slot

    def _shutdown(self) -> None:
        for slot in self.slots:
            os.kill(slot.pid, signal.SIGKILL)
            os.waitpid(slot.pid, 0)


def _describe(status: int) -> str:
    return f"signal {signal.Signals(-status).name}" if status < 0 else f"exit code {status}"


def _die_with_parent() -> None:
    """SIGKILL this process when its parent (the supervisor, single-threaded) exits."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the supervisor's shutdown still kills its workers
        pass


def _worker(sock: socket.socket, memory_limit_mb: int) -> None:
    _die_with_parent()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU would otherwise dump core
    if memory_limit_mb:
        limit = memory_limit_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    fd = sock.fileno()
    while (message := _read_frame(fd)) is not None:
        payload, deadline_s = message
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu_limit = int(usage.ru_utime + usage.ru_stime + deadline_s) + _CPU_GRACE_S
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_limit, resource.getrlimit(resource.RLIMIT_CPU)[1]))
        try:
            fn, request = pickle.loads(payload)
            result = ("ok", float(fn(request)), "")
        except BaseException as exc:  # any failure of a rule (math-verify's are BaseExceptions) is an error
            result = ("error", 0.0, f"{type(exc).__name__}: {str(exc)[:500]}")
        _write_frame(fd, result)


def _warm_up() -> None:
    """Import the rules and run math_verify once, so every forked worker starts warm."""
    from yatt_multimodal import rules  # noqa: F401
    from yatt_multimodal.math_answers import verify_math

    # math-verify or sympy missing: the rules that need them say so per request
    with contextlib.suppress(Exception):
        verify_math("\\boxed{1}", "1")


def main(argv: list[str]) -> None:
    """The supervisor's entry point: `python -m yatt_multimodal.rule_workers FROM_CALLER TO_CALLER N MEM_MB`."""
    from_caller, to_caller, num_workers, memory_limit_mb = (int(a) for a in argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the caller, which closes the pool
    _warm_up()
    _Supervisor(from_caller, to_caller, num_workers, memory_limit_mb).run()


if __name__ == "__main__":
    main(sys.argv[1:])
