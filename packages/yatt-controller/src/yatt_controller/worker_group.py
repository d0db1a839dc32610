"""Worker groups: any class hosted as Ray actors on the bundles of a realized placement plan.

One host process per device (`_Host`), created on that device's bundle. Every role the plan puts on a device
lives in that device's host, so roles the plan colocates share a process (and can hand weights over in
memory). A `WorkerGroup` is one role: one worker per device of each replica, with `dp_rank` = replica index
and `tp_rank` = position inside the replica. Calls go through the explicit dispatch functions of
`yatt_controller.dispatch` and a bounded in-flight window.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import inspect
import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import ray

from yatt_controller import dispatch, local_calls, warm
from yatt_controller.types import Heartbeat, WorkerInfo

HOST_THREADS = 32  # calls a host runs at once (different roles; each role's calls hold its lock)
# A host's calls run on whichever of its threads is free, and glibc gives each thread its own malloc arena:
# a learner's step on another thread than the last one found that arena's freed heaps returned to the
# system and faulted every activation page in again (75-100k minor faults per call measured, the update 2.7x
# slower than in one thread). One arena keeps freed memory reusable whichever thread allocates next.
HOST_ENV = {"MALLOC_ARENA_MAX": "1"}
_HOST_ENV_KEY = "yatt/host_env"  # in a Ray session's internal KV: its workers start with this environment


@contextlib.contextmanager
def host_env_inherited() -> Iterator[None]:
    """Around the `ray.init` that starts a local Ray: its raylet, and so every worker the raylet starts,
    inherits HOST_ENV (the driver's own environment is as before afterwards), and the session records it, so
    its hosts need no runtime_env of their own. A worker with a runtime_env starts through Ray's setup_worker,
    one more interpreter that imports Ray before the worker's own: about 0.6 s of CPU and 0.3-0.5 s of wall
    more per host on the 2-core CI machine. When the driver's environment sets one of HOST_ENV's variables to
    another value, nothing changes (hosts get HOST_ENV by runtime_env, as on a cluster started elsewhere)."""
    before = {key: os.environ.get(key) for key in HOST_ENV}
    ours = all(value in (None, HOST_ENV[key]) for key, value in before.items())
    if ours:
        os.environ.update(HOST_ENV)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if ours and ray.is_initialized():
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(_HOST_ENV_KEY, json.dumps(HOST_ENV))


def _host_runtime_env() -> dict[str, Any] | None:
    """The runtime_env a host is created with: none when the session's workers inherit HOST_ENV (recorded by
    `host_env_inherited`), else HOST_ENV's variables (read by glibc when the process starts)."""
    from ray.experimental import internal_kv

    with contextlib.suppress(Exception):
        if internal_kv._internal_kv_get(_HOST_ENV_KEY) == json.dumps(HOST_ENV).encode():
            return None
    return {"env_vars": HOST_ENV}


def _freeze_heap() -> None:
    """Collect once, then move every object now alive (torch, transformers, Ray, the models built so far) to
    the collector's permanent generation. Without it the full collections that the first steps' allocations
    set off walk that whole heap: 0.21-0.24 s each, measured in both host processes of the tiny two-controller
    job during its second step (its reward call took 0.25-0.3 s against 0.04-0.05 s after). Frozen objects
    are still freed when their last reference goes; only cycles among them wait for `gc.unfreeze()`, which
    `destroy` calls before it collects."""
    gc.collect()
    gc.freeze()


# the concurrency group gives `ping` its own thread
@ray.remote(concurrency_groups={"health": 1})
class _Host:
    """The process of one device. Each hosted role belongs to a lock group (`WorkerGroup.create(lock=...)`):
    calls of one group run one at a time; calls of different groups run concurrently (threads). Roles in the
    default "host" group (engines: two engines in one process must not run at once) are serialized; a learner
    in its own group ("learner") blocked in a collective never holds up the engine beside it that another
    controller is waiting on (partial colocation shares processes across controllers). `ping` has its own
    thread, so a host busy in long calls still answers the health monitor."""

    def __init__(self, label: str, device: int) -> None:
        self._label, self._device = label, device
        self._objects: dict[str, Any] = {}
        self._locks: dict[str, threading.Lock] = {}  # lock group -> its lock
        self._groups: dict[str, str] = {}  # hosted key -> its lock group
        self._guard = threading.Lock()
        self._busy: dict[str, tuple[str, float]] = {}  # hosted key -> (the call it is in, since)
        self._busy_s: dict[str, float] = {}  # hosted key -> cumulative seconds in its calls (kept on destroy)
        self._sync_groups: dict[str, Any] = {}
        self._environ = dict(os.environ)  # what `reset` puts back
        # the threads of this process's calls to itself (`local_calls`: a hosted controller's calls to the
        # roles beside it), made on first use
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._here = local_calls.Here(ray.get_runtime_context().get_actor_id(), self)

    def _lock(self, *keys: str) -> contextlib.ExitStack:
        """The locks of `keys`' groups, taken in a fixed order (no two callers can wait on each other)."""
        with self._guard:
            groups = sorted({self._groups.get(key, "host") for key in keys})
            locks = [self._locks.setdefault(group, threading.Lock()) for group in groups]
        stack = contextlib.ExitStack()
        for lock in locks:
            stack.enter_context(lock)
        return stack

    def create(self, key: str, cls: type, args: tuple, kwargs: dict, lock: str = "host") -> int:
        with self._guard:
            self._groups[key] = lock
        with self._lock(key):
            self._objects[key] = hosted = cls(*args, **kwargs)
            adopt = getattr(hosted, "hosted_by", None)
            if callable(adopt):  # a hosted controller: its calls to this process run in process
                adopt(self._here)
            _freeze_heap()
        return os.getpid()

    def destroy(self, key: str) -> None:
        """Drop a hosted object (its role moves elsewhere), after its `close()` when it has one; the process
        stays for the roles it still hosts. An engine's running thread keeps the engine alive whatever drops
        it: its `close()` is what stops the thread and frees its weights and cache (device memory that the
        role moving in needs). A `close()` that raises is reported on stderr and the object dropped anyway."""
        import sys
        import traceback

        with self._lock(key):
            hosted = self._objects.pop(key, None)
            close = getattr(hosted, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:
                    print(f"{self._label}: closing {key} failed:", file=sys.stderr)
                    traceback.print_exc()
            del hosted, close
        gc.unfreeze()  # the departed object was frozen with the rest: its reference cycles are garbage now
        _freeze_heap()

    def reset(self) -> bool:
        """Empty this process for another job (`yatt_controller.warm`): every hosted object closed and dropped
        (`destroy`), the weight-sync groups and busy times forgotten, the torch.distributed group a learner
        set up destroyed, the environment as at the start. False when the process cannot be reused: Megatron's
        parallel state or a vLLM engine's distributed environment was set up in it (neither undoes in place)."""
        import sys

        if "vllm" in sys.modules or "megatron.core" in sys.modules:
            return False  # before any close: the caller kills this process anyway
        for key in list(self._objects):
            self.destroy(key)
        self._sync_groups.clear()
        self._busy_s.clear()
        os.environ.clear()
        os.environ.update(self._environ)
        if "torch.distributed" in sys.modules:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()  # every group, the default one last
        return True

    def call(self, key: str, method: str, args: tuple, kwargs: dict) -> Any:
        with self._lock(key):
            self._busy[key] = (f"{key}.{method}", time.time())
            start = time.perf_counter()
            try:
                return getattr(self._objects[key], method)(*args, **kwargs)
            finally:
                self._busy_s[key] = self._busy_s.get(key, 0.0) + time.perf_counter() - start
                self._busy.pop(key, None)

    def call_here(self, method: str, *args: Any) -> local_calls.LocalRef:
        """`method(*args)` of this host (`call`, `sync_local`...) run on one of its own threads: the call this
        process would otherwise send itself through Ray (`local_calls`)."""
        with self._guard:
            if self._threads is None:
                self._threads = concurrent.futures.ThreadPoolExecutor(
                    HOST_THREADS, thread_name_prefix="host-here"
                )
            threads = self._threads
        what = f"{self._label}: {method}({args[0] if args else ''})"
        return local_calls.LocalRef(threads.submit(getattr(self, method), *args), what)

    def serve(self, key: str, method: str, args: tuple) -> Any:
        """A long call of a hosted driver-side object (a controller's `run`), under its key's lock. Not
        counted as busy: it spends its time waiting on the roles' calls, which are."""
        with self._lock(key):
            return getattr(self._objects[key], method)(*args)

    @ray.method(concurrency_group="health")
    def peek(self, key: str, method: str, args: tuple) -> Any:
        """A quick call on the health thread, without the key's lock: a hosted controller's heartbeat while
        its `run` holds the lock."""
        return getattr(self._objects[key], method)(*args)

    @ray.method(concurrency_group="health")
    def ping(self) -> Heartbeat:
        """Liveness, the longest call this host is in (`phase`, since `time_unix`; "" when idle) and the
        cumulative busy seconds of each hosted key (role)."""
        busy, since = longest_call(self._busy)
        node = ray.get_runtime_context().get_node_id()
        return Heartbeat(
            actor=self._label, node_id=node, step=0, phase=busy, time_unix=since, busy_s=dict(self._busy_s)
        )

    # Weight sync: the torch side lives in yatt_controller.weight_sync, imported only where it runs.
    def sync_open(self, group: str) -> tuple[str, int]:
        from yatt_controller import weight_sync

        return weight_sync.open_store(self._sync_groups, group)

    def sync_join(self, group: str, addr: str, port: int, rank: int, world: int, backend: str) -> None:
        from yatt_controller import weight_sync

        weight_sync.join_group(self._sync_groups, group, addr, port, rank, world, backend)

    def sync_plan(self, key: str, bucket_bytes: int) -> list:
        from yatt_controller import weight_sync

        with self._lock(key):
            return weight_sync.plan_buckets(self._objects[key].named_weights(), bucket_bytes)

    def sync_send(self, group: str, key: str, buckets: list) -> int:
        from yatt_controller import weight_sync

        with self._lock(key):
            return weight_sync.send(self._sync_groups[group], self._objects[key].named_weights(), buckets)

    def sync_recv(self, group: str, keys: str | list[str], buckets: list, version: int) -> int:
        """Receive one broadcast and load it into every hosted target in `keys` (one rank per process)."""
        from yatt_controller import weight_sync

        named = weight_sync.receive(self._sync_groups[group], buckets)
        for key in [keys] if isinstance(keys, str) else keys:
            target = self._objects[key]
            if getattr(target, "loads_while_generating", False):  # partial rollouts: the engine pauses
                target.load_weights(named, version)  # its own running batch, loads, and resumes it
                continue
            with self._lock(key):  # after the calls in flight on that engine
                target.load_weights(named, version)
        return sum(b.nbytes for b in buckets)

    def sync_close(self, group: str) -> None:
        """Forget a broadcast group (and its store) this process took part in."""
        self._sync_groups.pop(group, None)
        self._sync_groups.pop(f"{group}/store", None)

    def sync_local(self, src_key: str, dst_key: str, version: int) -> int:
        from yatt_controller import weight_sync

        with self._lock(src_key, dst_key):
            return weight_sync.copy_local(self._objects[src_key], self._objects[dst_key], version)


def longest_call(busy: dict[str, tuple[str, float]]) -> tuple[str, float]:
    """The (call, since) of the call in `busy` (a host's, written by its call threads) that began first;
    ("", now) when none. It reads a copy: the threads add and remove calls while the health thread asks, and
    `list` copies in C, where no other thread runs (iterating the dict itself raised "dictionary changed size
    during iteration" in a live ping, which the health monitor took for a failed controller)."""
    calls = list(busy.values())
    return min(calls, key=lambda call: call[1], default=("", time.time()))


def _device_share(realized: Any, device: int) -> float:
    """The device share of a host: the sum of the shares of the roles the plan puts on `device`."""
    share = sum(
        realized.gpu_fraction(p.role, p.name)
        for p in realized.plan.roles
        if any(device in replica for replica in p.replicas)
    )
    return min(share, 1.0)


def host_id(handle: Any) -> str:
    """A host actor's id (hex): how a process is named across controllers and the driver."""
    return handle._actor_id.hex()


@dataclass
class HostRecord:
    handle: Any  # ray.actor.ActorHandle of a _Host
    device: int
    label: str
    roles: list[str] = field(default_factory=list)


class HostPool:
    """The host processes of one realized plan, one per device, created on first use."""

    def __init__(self, realized: Any, *, num_cpus_per_host: float = 0.0, label_prefix: str = "") -> None:
        self.realized = realized
        self.num_cpus_per_host = num_cpus_per_host
        self.label_prefix = label_prefix
        self.hosts: dict[int, HostRecord] = {}
        self._own: set[str] = set()  # ids of the hosts this pool made or took from the warm set
        self._runtime_env = _host_runtime_env()

    def host(self, device: int, role_label: str) -> HostRecord:
        if device not in self.hosts:
            label, share = f"{self.label_prefix}device-{device}", _device_share(self.realized, device)
            handle = warm.take(self.realized, device, share, label)
            if handle is None:
                handle = _Host.options(  # type: ignore[attr-defined]  # a ray.remote class: stubs lack it
                    num_cpus=self.num_cpus_per_host,
                    num_gpus=share,
                    scheduling_strategy=self.realized.scheduling_strategy(device),
                    max_restarts=0,
                    max_concurrency=HOST_THREADS,  # a thread per concurrent call; a role's own calls are ordered
                    runtime_env=self._runtime_env,
                ).remote(label, device)
            self._own.add(host_id(handle))
            self.hosts[device] = HostRecord(handle, device, label)
        record = self.hosts[device]
        record.roles.append(role_label)
        return record

    def shutdown(self, *, park: bool = False) -> None:
        """Kill every host (their bundles stay reserved for the next pool), or with `park` keep them, emptied,
        for the next job on the same bundles (`yatt_controller.warm`; all of them or none). A pool that adopted
        hosts a controller started (replacements) parks none: such a host lives only while its creator holds it."""
        parked = [
            (r.device, _device_share(self.realized, r.device), r.label, r.handle) for r in self.hosts.values()
        ]
        own = {host_id(r.handle) for r in self.hosts.values()} <= self._own
        if not (park and own and warm.park(self.realized, parked)):
            for record in self.hosts.values():
                ray.kill(record.handle, no_restart=True)
        self.hosts.clear()


@dataclass
class Worker:
    """One hosted instance: `host.call(key, ...)` reaches it."""

    host: Any
    key: str
    dp_rank: int
    tp_rank: int
    device: int
    label: str  # e.g. "rollout-1.0 on device-3": how failures name it
    group_dp_rank: int = -1  # dp rank in the whole group; a view renumbers dp_rank, never this
    traffic: dispatch.Traffic | None = None  # its view's window and call counts (pickles fresh)

    @property
    def window(self) -> dispatch.InflightWindow | None:
        return None if self.traffic is None else self.traffic.window

    def submit(self, method: str, args: tuple, kwargs: dict) -> ray.ObjectRef | local_calls.LocalRef:
        """The call through Ray, or in process (a `LocalRef`) when the worker's host is the process of the
        controller whose view this worker is in (`Traffic.here`)."""

        def go() -> ray.ObjectRef | local_calls.LocalRef:
            here = None if self.traffic is None else self.traffic.here
            return local_calls.call(here, self.host, "call", self.key, method, args, kwargs)

        return self.traffic.window.admit(go) if self.traffic is not None else go()


@dataclass(frozen=True)
class Spawn:
    """How a group's workers were made: what a live move needs to start one more in its new place."""

    hosted: type
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    pass_worker_info: bool = False
    lock: str = "host"  # the host lock group its calls take (see _Host)

    def start(self, record: HostRecord, key: str, info: WorkerInfo) -> ray.ObjectRef:
        """Create the hosted object on `record`'s host (returns the ref of its pid)."""
        kw = {**self.kwargs, **({"worker_info": info} if self.pass_worker_info else {})}
        return record.handle.create.remote(key, self.hosted, self.args, kw, self.lock)


def start_replica(
    pool: HostPool, spawn: Spawn, role: str, name: str, replica: Sequence[int], dp_rank: int, dp_size: int
) -> tuple[list[Worker], list[ray.ObjectRef]]:
    """Start one replica's workers (one per device, tp order) on the pool's hosts; (workers, creation refs)."""
    key = f"{role}:{name}" if name else role
    workers, refs = [], []
    for tp_rank, device in enumerate(replica):
        label = f"{key}-{dp_rank}.{tp_rank}"
        record = pool.host(device, label)
        info = WorkerInfo(
            role=role,
            name=name,
            dp_rank=dp_rank,
            dp_size=dp_size,
            tp_rank=tp_rank,
            tp_size=len(replica),
            device=device,
        )
        refs.append(spawn.start(record, key, info))
        workers.append(
            Worker(record.handle, key, dp_rank, tp_rank, device, f"{label} on {record.label}", dp_rank)
        )
    return workers, refs


class WorkerGroup:
    """One role of the plan hosted as workers: `WorkerGroup.create(pool, "rollout", MyEngine, ...)`. Its
    workers may be swapped in place (`rebind`) when the roster replaces replicas: a step holding the view
    sends its next call to the new replicas."""

    def __init__(
        self,
        role: str,
        name: str,
        workers: Sequence[Worker],
        max_inflight: int = 8,
        spawn: Spawn | None = None,
    ) -> None:
        if not workers:
            raise ValueError(f"WorkerGroup {role!r} needs at least one worker")
        self.role, self.name, self.max_inflight, self.spawn = role, name, max_inflight, spawn
        self.key = f"{role}:{name}" if name else role  # its workers' hosted key (also its busy-time key)
        self._starting: list = []  # the creation calls `ready` waits for (`create(..., wait=False)`)
        self.traffic = dispatch.Traffic(max_inflight)
        self.rebind(workers)

    def rebind(self, workers: Sequence[Worker]) -> None:
        """These workers, on this view's own traffic (window, call counts, dispatcher)."""
        self.workers = [replace(w, traffic=self.traffic) for w in workers]

    def replicas(self) -> list[list[int]]:
        """Devices of each data-parallel rank, in rank order (tp order inside)."""
        by_rank: dict[int, list[Worker]] = {}
        for w in self.workers:
            by_rank.setdefault(w.dp_rank, []).append(w)
        return [[w.device for w in sorted(by_rank[r], key=lambda w: w.tp_rank)] for r in sorted(by_rank)]

    @classmethod
    def create(
        cls,
        pool: HostPool,
        role: str,
        hosted: type,
        *,
        name: str = "",
        args: tuple = (),
        kwargs: dict | None = None,
        max_inflight: int = 8,
        pass_worker_info: bool = False,
        lock: str = "host",
        wait: bool = True,
    ) -> WorkerGroup:
        """Instantiate `hosted(*args, **kwargs)` on every device of every replica the plan gives `role`. Calls
        of roles in one `lock` group on a host run one at a time; groups run concurrently: give learners that
        block in collectives their own group ("learner"), keep engines in the default one.

        `wait=False` returns once the objects are asked for, before they exist: groups on disjoint devices
        then start (load models, start engines) at the same time. Call `ready()` before the group's first
        call, and before creating another group on any of its devices (its hosts' processes are shared)."""
        if not inspect.isclass(hosted):
            raise ValueError(f"WorkerGroup.create needs a class to host, got {hosted!r}")
        placement = next((p for p in pool.realized.plan.roles if p.role == role and p.name == name), None)
        if placement is None:
            raise ValueError(f"role {role!r} (name {name!r}) is not in the placement plan")
        spawn = Spawn(hosted, tuple(args), dict(kwargs or {}), pass_worker_info, lock)
        workers, created = [], []
        for dp_rank, replica in enumerate(placement.replicas):
            made, refs = start_replica(pool, spawn, role, name, replica, dp_rank, len(placement.replicas))
            workers += made
            created += refs
        group = cls(role, name, workers, max_inflight, spawn)
        group._starting = created  # all at once: hosted classes may rendezvous with each other in __init__
        return group.ready() if wait else group

    def ready(self) -> WorkerGroup:
        """This group, once every hosted object of `create(..., wait=False)` exists; a failed one raises."""
        starting, self._starting = self._starting, []
        ray.get(starting)
        return self

    @property
    def dp_size(self) -> int:
        return 1 + max(w.dp_rank for w in self.workers)

    def view(self, dp_ranks: Sequence[int], *, max_inflight: int | None = None) -> WorkerGroup:
        """The workers of some data-parallel ranks, renumbered from 0 (what one controller is routed to),
        with a window of its own."""
        ranks = list(dp_ranks)
        if not ranks or any(not 0 <= r < self.dp_size for r in ranks):
            raise ValueError(f"view of {self.role!r} needs dp ranks in [0, {self.dp_size}), got {ranks}")
        renumber = {r: i for i, r in enumerate(ranks)}
        picked = [replace(w, dp_rank=renumber[w.dp_rank]) for w in self.workers if w.dp_rank in renumber]
        return WorkerGroup(self.role, self.name, picked, max_inflight or self.max_inflight, self.spawn)

    def broadcast(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        return dispatch.broadcast(self.workers, method, *args, **kwargs)

    def scatter(self, method: str, items: Sequence[Any], **kwargs: Any) -> list[ray.ObjectRef]:
        return dispatch.scatter(self.workers, method, items, **kwargs)

    def shard_rows(self, method: str, batch: dict[str, Any], **kwargs: Any) -> list[ray.ObjectRef]:
        """Row chunk r of `batch` (a dict of tensors [B, ...] / lists of length B; other values go to every
        rank unchanged) to every worker of data-parallel rank r of this view; one ref per rank, in order.
        What a step uses to train: in single mode the view holds every learner rank, so all join the SPMD
        call; in parallel mode a controller's learner view is its one rank, which gets the whole batch."""
        return dispatch.shard_rows(self.workers, method, batch, **kwargs)

    def call_one(self, method: str, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        """One call to the least-loaded data-parallel rank of this view (fewest `call_one` calls not yet
        finished; ties go round-robin), sent to all its tp peers; returns the tp_rank-0 worker's ref."""
        workers = self.workers
        rank, ref = self.traffic.least_loaded(
            self.dp_size, lambda r: dispatch.to_rank(workers, r, method, args, kwargs)
        )
        dispatcher = self.traffic.dispatcher
        # a dead replica is replaced and the call sent again (replace.py); a call in process has none to lose
        if dispatcher is not None and not local_calls.is_local(ref):
            dispatcher.track(self, rank, ref, method, args, kwargs)
        return ref

    def rank_zero(self, method: str, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        """Worker 0 of this view only. Not for training calls: in single mode the other DDP ranks would never
        join (use `shard_rows`)."""
        return dispatch.rank_zero(self.workers, method, *args, **kwargs)[0]

    def gather(self, refs: Sequence[ray.ObjectRef]) -> list[ray.ObjectRef]:
        return dispatch.gather(self.workers, refs)

    def dispatch(self, mode: str, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        if mode not in dispatch.DISPATCH:
            raise ValueError(f"unknown dispatch mode {mode!r}; known: {sorted(dispatch.DISPATCH)}")
        return dispatch.DISPATCH[mode](self.workers, method, *args, **kwargs)


def routed_views(
    groups: dict[str, WorkerGroup],
    learner: str | None,
    rank: int,
    world: int,
    max_inflight: int,
    *,
    single: bool = False,
    uneven: bool = False,
) -> dict[str, WorkerGroup]:
    """What one controller calls: its own block of learner ranks (one rank when there are as many controllers
    as ranks; the controller splits its rows over them otherwise), and the service replicas `dispatch.route`
    gives it (every replica of every group in single mode). Service replicas may split unevenly over the
    controllers (blocks that differ by one); `uneven` allows it for the learner too (never needed)."""
    if single:
        return {name: g.view(range(g.dp_size), max_inflight=max_inflight) for name, g in groups.items()}
    return {
        name: g.view(
            dispatch.route(g.dp_size, world, rank, uneven=uneven or name != learner),
            max_inflight=max_inflight,
        )
        for name, g in groups.items()
    }
