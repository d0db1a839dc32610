"""Rule rewards with hard limits: worker processes that can be killed, a deadline per request.

A rule that parses untrusted text can run unbounded: math_verify/sympy given `\\boxed{(x+1)^{100000}}` expands
the power for minutes (a numeric tower like `9^{9^{9}}` computes inside one C call that holds the GIL; those
`math_answers.oversized_answer` now refuses unevaluated), so neither a thread timeout nor `signal.alarm` can
stop it. Here each request runs in a worker process; the one that overruns its deadline is SIGKILLed and
replaced, and that request's outcome is "timeout". The rest of the batch runs on the other workers.

Layout (`RuleWorkerPool`, an object its caller holds and closes):

    caller process ── pipe ──> supervisor process ── socketpair each ──> N worker processes (forked)
          ^                                                                   │
          └──────────── one results pipe (writes of at most PIPE_BUF: atomic) ┘

A batch crosses each hop as one message, not one per request (each was a wake-up of a process on a busy
machine): the caller sends all of a `submit_many`'s jobs in one frame, the supervisor hands an idle worker a
chunk of them in one frame, and the worker writes the chunk's answers straight to the caller's results pipe
together (several writes only when they exceed PIPE_BUF). The supervisor hears from a worker once per chunk
("done"); it follows the running job through a small shared memory record the worker updates before each job
(its index in the chunk, how many answers it has written, and the job's start), so a job's deadline still
counts from when its worker took it. A worker killed at a deadline takes its running job with it (status
"timeout"); the chunk's other jobs whose answers it had not written go back to the queue and run again.

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
import mmap
import os
import pickle
import resource
import select
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
from collections.abc import Callable, Sequence
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
        return self.submit_many(fn, [request], deadline_s)[0]

    def submit_many(
        self, fn: Callable[[RewardRequest], float], requests: Sequence[RewardRequest], deadline_s: float
    ) -> list[Future[RuleOutcome]]:
        """`submit` for each request, sent to the supervisor as one message; one future per request, each
        with its own deadline. `gathered(futures)` waits for them all."""
        if deadline_s <= 0:
            raise ValueError(f"RuleWorkerPool.submit: deadline_s must be > 0, got {deadline_s}")
        futures: list[Future[RuleOutcome]] = [Future() for _ in requests]
        payloads: list[bytes | None] = []
        for request, future in zip(requests, futures, strict=True):
            try:
                payloads.append(pickle.dumps((fn, request)))
            except Exception as exc:  # lambdas, closures, bound methods of unpicklable objects
                why = f"rule {fn!r} cannot be sent to a worker: {exc}"
                future.set_result(RuleOutcome("error", error=why))
                payloads.append(None)
        sendable = [(future, p) for future, p in zip(futures, payloads, strict=True) if p is not None]
        if not sendable:
            return futures
        with self._lock:
            if self._closed:
                raise RuntimeError("RuleWorkerPool.submit after close()")
            to_supervisor = self._ensure_running()
            first, self._next_id = self._next_id, self._next_id + len(sendable)
            pending = self._futures
            pending.update((first + i, future) for i, (future, _) in enumerate(sendable))
        jobs = [(first + i, payload, float(deadline_s)) for i, (_, payload) in enumerate(sendable)]
        try:
            with self._write_lock:
                _write_frame(to_supervisor, jobs)
        except OSError as exc:  # the supervisor died just now: these fail, the next submit restarts it
            with self._lock:
                for job_id, _, _ in jobs:
                    pending.pop(job_id, None)
            for future, _ in sendable:
                future.set_result(RuleOutcome("error", error=f"the rule pool's supervisor is gone: {exc}"))
        return futures

    def worker_pids(self) -> list[int]:
        """The supervisor's and its workers' process ids (read from /proc; for tests and diagnostics)."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return []
        children = f"/proc/{proc.pid}/task/{proc.pid}/children"
        with open(children) as f:
            return [proc.pid, *(int(p) for p in f.read().split())]

    @property
    def closed(self) -> bool:
        """Whether `close()` was called (a closed pool takes no more work)."""
        return self._closed

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
        """Completes `futures` from the answers on the results pipe (the workers' and the supervisor's) until
        it closes; an answer for a job already answered (a worker's, just before its kill) is dropped."""
        buffer = bytearray()
        try:
            while chunk := os.read(from_supervisor, 1 << 16):
                buffer += chunk
                answers = [_loaded(a) for frame in _split_frames(buffer) for a in frame]
                with self._lock:
                    done = [(futures.pop(answer[0], None), answer) for answer in answers]
                    self.restarts += sum(int(answer[4]) for answer in answers)
                for future, (_, status, value, error, _) in done:
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


def gathered(futures: Sequence[Future[RuleOutcome]]) -> Future[list[RuleOutcome]]:
    """One future of every outcome, in order, done when the last one is (one wake-up for a batch's waiter)."""
    whole: Future[list[RuleOutcome]] = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future[RuleOutcome]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            whole.set_result([f.result() for f in futures])

    if not futures:
        whole.set_result([])
    for future in futures:
        future.add_done_callback(one_done)
    return whole


def _loaded(answer: Any) -> tuple[int, OutcomeStatus, float, str, bool]:
    """An answer in a frame: a worker's, pickled on its own (`_answer`), or the supervisor's tuple."""
    return pickle.loads(answer) if isinstance(answer, bytes) else answer


def _stop_supervisor(proc: subprocess.Popen[bytes], to_supervisor: int) -> None:
    with contextlib.suppress(OSError):  # already closed
        os.close(to_supervisor)  # EOF: the supervisor kills its workers and exits
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# --- framing -------------------------------------------------------------------------------------------


def _frame(message: Any) -> bytes:
    data = pickle.dumps(message)
    return _HEADER.pack(len(data)) + data


def _write_frame(fd: int, message: Any) -> None:
    view = memoryview(_frame(message))
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


MAX_CHUNK = 8  # jobs handed to one worker in one message; it runs them without a word to the supervisor
# Shared with a worker: the index in its chunk of the job it runs, how many of the chunk's answers it has
# written to the caller, and when the running job started (time.monotonic); after a sequence number that is
# odd while a write is under way (a seqlock: the reader retries until it reads one even number on both
# sides). Native formats: each field is one aligned 8-byte store, never torn itself.
_SEQ = struct.Struct("@Q")
_PROGRESS = struct.Struct("@qqd")


def _set_progress(progress: mmap.mmap, index: int, written: int, started: float) -> None:
    seq = _SEQ.unpack_from(progress)[0]
    _SEQ.pack_into(progress, 0, seq + 1)
    _PROGRESS.pack_into(progress, _SEQ.size, index, written, started)
    _SEQ.pack_into(progress, 0, seq + 2)


_DONE = b"d"  # a worker's one message to the supervisor: its chunk is done


# eq=False: a slot is compared by identity. The selector keeps each worker socket's slot as its key's data and
# `selectors.modify` replaces that data only when it compares unequal: with field equality, a replacement
# worker's socket kept pointing at a copy of its slot, and the supervisor never saw it finish a chunk again.
@dataclass(eq=False)
class _Slot:
    pid: int
    sock: socket.socket
    progress: mmap.mmap  # _PROGRESS, written by the worker before each job of its chunk
    chunk: list[tuple[int, bytes, float]] = field(default_factory=list)  # sent to it; [] when idle

    def running(self) -> tuple[int, int, float] | None:
        """(index in the chunk of the job the worker runs (len(chunk) once all ran), answers written, the
        running job's start); None while the worker is between the two halves of a write (read again)."""
        for _ in range(100):
            seq = _SEQ.unpack_from(self.progress)[0]
            if seq % 2 == 0:
                record = _PROGRESS.unpack_from(self.progress, _SEQ.size)
                if _SEQ.unpack_from(self.progress)[0] == seq:
                    return record
        return None  # the worker was stopped mid-write; it finishes it first thing when it runs again

    def deadline(self) -> float | None:
        """When the running job is late; None when the chunk has run; soon when the record is unreadable."""
        record = self.running()
        if record is None:
            return time.monotonic() + 0.01
        index, _, started = record
        return started + self.chunk[index][2] if index < len(self.chunk) else None


class _Supervisor:
    """Hands chunks of jobs to idle workers, kills and replaces late or dead workers.

    An idle worker gets up to MAX_CHUNK jobs in one message (fewer when there are few per worker) and runs
    them in order, writing each answer to the caller's results pipe itself: nothing passes through here per
    job. Each job keeps its own deadline, counted from when its worker took it (the start the worker records
    in the slot's shared progress; the first job's is when the chunk was sent). A worker killed at a deadline
    or found dead takes only its running job with it: the jobs after it go back to the front of the queue."""

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
            deadlines = [d for s in self.slots if s.chunk and (d := s.deadline()) is not None]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            for key, _ in self.selector.select(timeout):
                if key.data is None:
                    chunk = os.read(self.from_caller, 1 << 16)
                    if not chunk:  # the caller closed the pool or died
                        self._shutdown()
                        return
                    self.inbox += chunk
                    for jobs in _split_frames(self.inbox):
                        self.pending.extend(jobs)
                else:
                    self._on_worker(key.data)
            self._kill_late()

    def _dispatch(self) -> None:
        idle = [slot for slot in self.slots if not slot.chunk]
        if not idle or not self.pending:
            return
        share = min(MAX_CHUNK, -(-len(self.pending) // len(idle)))  # ceil: spread over the idle workers
        for slot in idle:
            jobs = [self.pending.popleft() for _ in range(min(share, len(self.pending)))]
            if not jobs:
                return
            slot.chunk = jobs
            _set_progress(slot.progress, 0, 0, time.monotonic())  # job 0's deadline counts from now
            # a worker that died idle raises here; its EOF, read next, fails the first job and replaces it
            with contextlib.suppress(OSError):
                slot.sock.sendall(_frame(jobs))

    def _on_worker(self, slot: _Slot) -> None:
        if slot.sock.recv(1 << 10):  # _DONE: every job of its chunk was answered
            slot.chunk = []
            return
        # it died: a crash, the memory limit, or its CPU limit (SIGXCPU)
        status, lost = self._replace(slot, kill=False)
        late = status == -signal.SIGXCPU
        self._lose_running(*lost, "timeout" if late else "error", f"rule worker died ({_describe(status)})")

    def _kill_late(self) -> None:
        now = time.monotonic()
        for slot in self.slots:
            if slot.chunk and (deadline := slot.deadline()) is not None and deadline <= now:
                _, lost = self._replace(slot, kill=True)
                self._lose_running(*lost, "timeout", "its worker was killed and replaced")

    def _lose_running(
        self, chunk: list[tuple[int, bytes, float]], index: int, written: int, status: str, why: str
    ) -> None:
        """A dead worker's `chunk` (it ran job `index` and had written `written` answers): the running job
        gets `status`; the others whose answers it had not written yet (those it ran before, held for one
        write, and those after) go back, in order, to the front of the pending queue."""
        if index < len(chunk):
            _write_frame(self.to_caller, [(chunk[index][0], status, 0.0, why, True)])
        self.pending.extendleft(reversed(chunk[written:index] + chunk[index + 1 :]))

    def _replace(
        self, slot: _Slot, *, kill: bool
    ) -> tuple[int, tuple[list[tuple[int, bytes, float]], int, int]]:
        """Kill (if asked) and reap the slot's worker and fork its successor into the slot; the old exit
        status, and the dead worker's chunk with how far it got (for `_lose_running`)."""
        if kill:
            os.kill(slot.pid, signal.SIGKILL)
        self.selector.unregister(slot.sock)
        slot.sock.close()
        _, raw = os.waitpid(slot.pid, 0)
        # final, the worker being gone; it died mid-write only as a job ended (at its deadline): each field
        # is whole, from one write or the other
        index, written, _ = slot.running() or _PROGRESS.unpack_from(slot.progress, _SEQ.size)
        lost = (slot.chunk, index, written)
        slot.progress.close()
        fresh = self._fork_worker()
        slot.pid, slot.sock, slot.progress, slot.chunk = fresh.pid, fresh.sock, fresh.progress, []
        self.selector.modify(slot.sock, selectors.EVENT_READ, slot)  # events of the new socket find this slot
        return (-os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)), lost

    def _fork_worker(self) -> _Slot:
        ours, theirs = socket.socketpair()
        progress = mmap.mmap(-1, _SEQ.size + _PROGRESS.size)  # anonymous and shared with the child
        pid = os.fork()
        if pid == 0:  # the worker: nothing of the supervisor's but its socket and the results pipe
            try:
                keep = sorted((theirs.fileno(), self.to_caller))
                os.closerange(3, keep[0])
                os.closerange(keep[0] + 1, keep[1])
                os.closerange(keep[1] + 1, os.sysconf("SC_OPEN_MAX"))
                _worker(theirs, self.to_caller, progress, self.memory_limit_mb)
            finally:
                os._exit(0)
        theirs.close()
        slot = _Slot(pid, ours, progress)
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


def _worker(sock: socket.socket, to_caller: int, progress: mmap.mmap, memory_limit_mb: int) -> None:
    _die_with_parent()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU would otherwise dump core
    if memory_limit_mb:
        limit = memory_limit_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    fd = sock.fileno()
    while (chunk := _read_frame(fd)) is not None:
        held: list[bytes] = []  # answers not yet written: one write for the chunk, unless they fill a pipe
        written = 0
        for index, (job_id, payload, deadline_s) in enumerate(chunk):
            _set_progress(progress, index, written, time.monotonic())
            usage = resource.getrusage(resource.RUSAGE_SELF)
            cpu_limit = int(usage.ru_utime + usage.ru_stime + deadline_s) + _CPU_GRACE_S
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_limit, resource.getrlimit(resource.RLIMIT_CPU)[1]))
            try:
                fn, request = pickle.loads(payload)
                status, value, error = "ok", float(fn(request)), ""
            except (
                BaseException
            ) as exc:  # any failure of a rule (math-verify's are BaseExceptions) is an error
                status, value, error = "error", 0.0, f"{type(exc).__name__}: {str(exc)[:500]}"
            answer = _answer(job_id, status, value, error)
            if len(_frame([*held, answer])) > select.PIPE_BUF:
                os.write(to_caller, _frame(held))
                written, held = index, []
            held.append(answer)
        os.write(to_caller, _frame(held))
        _set_progress(progress, len(chunk), len(chunk), time.monotonic())
        sock.sendall(_DONE)


def _answer(job_id: int, status: str, value: float, error: str) -> bytes:
    """A job's answer, pickled, short enough that a frame of it alone is at most PIPE_BUF bytes: every frame
    on the results pipe is one write, never interleaved with another writer's."""
    data = pickle.dumps((job_id, status, value, error, False))
    while len(_frame([data])) > select.PIPE_BUF:
        error = error[: len(error) // 2]
        data = pickle.dumps((job_id, status, value, error, False))
    return data


# answers of each shape math_verify parses by a path of its own (boxed, an expression, an equation, a fraction
# in text, a number with words): the first of each costs 5-30 ms (lazy imports, compiled patterns, sympy's
# caches) in the process that runs it, so the supervisor runs them before it forks its workers
_WARM_UP_ANSWERS = [
    ("\\boxed{1}", "1"),
    ("7 + 3", "10"),
    ("x = -5", "-5"),
    ("it is 1/2", "0.5"),
    ("12 apples", "12"),
]


def _warm_up() -> None:
    """Import the rules, share sympy's parse namespace (`math_answers.share_sympy_namespace`) and run math_verify on
    each shape of answer, so every forked worker starts warm."""
    from yatt_multimodal import rules  # noqa: F401
    from yatt_multimodal.math_answers import share_sympy_namespace, verify_math

    # math-verify or sympy missing: the rules that need them say so per request
    with contextlib.suppress(ImportError):  # first: its own name for parse_expr is replaced too
        import math_verify.parser  # noqa: F401
    with contextlib.suppress(Exception):
        share_sympy_namespace()  # every parse here skips `from sympy import *` (a process of our own)
        for response, reference in _WARM_UP_ANSWERS:
            verify_math(response, reference)


def main(argv: list[str]) -> None:
    """The supervisor's entry point: `python -m yatt_multimodal.rule_workers FROM_CALLER TO_CALLER N MEM_MB`."""
    from_caller, to_caller, num_workers, memory_limit_mb = (int(a) for a in argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the caller, which closes the pool
    _warm_up()
    _Supervisor(from_caller, to_caller, num_workers, memory_limit_mb).run()


if __name__ == "__main__":
    main(sys.argv[1:])
