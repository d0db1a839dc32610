"""Host processes kept warm between jobs that run one after another in one driver and one Ray session (a
sweep, a notebook, a test suite). Opt in with `YATT_KEEP_HOSTS=1`.

A host's start is mostly imports (torch, transformers, Ray's worker: about 6-7 s of CPU on the project's 2-core
CI machine) before it builds its first model. With hosts kept, a job that finished parks its hosts, emptied
(`_Host.reset`: every hosted object closed and dropped, the process's torch.distributed group destroyed, its
environment as at its start), together with its placement group; the next job whose plan fits in that group
(no more devices than it has bundles, the same CPUs per device) takes it, device i on bundle i, and each of its
devices takes the parked host of that bundle when the host's device share and label match; the hosts of the
bundles it does not use stay parked for a later job. A plan with more devices drops the warm set first: one
warm set at most, so parked hosts never hold devices a bigger job needs. (A sweep or a test suite runs jobs of
one to a few devices in turn: the largest group made so far serves them all.)

The attempt's book (`yatt_controller.roster.AttemptBook`: the roster book and the controllers' rendezvous, a
small actor of its own, about 1 s of CPU to start) is kept the same way, whatever the next job's shape: the
next attempt takes it and starts it over with its own roster (`take_book`, `park_book`).

Never kept: the hosts and book of a failed or interrupted attempt (their state is suspect), a host whose
process set up state that cannot be undone in place (Megatron's parallel state, a vLLM engine's distributed
environment), or a host that does not answer its reset within `RESET_TIMEOUT_S`. `drop()` kills the parked
hosts and book and returns the group to the cluster (an embedding program calls it when it is done with
YATT)."""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, field
from typing import Any

import ray

ENV = "YATT_KEEP_HOSTS"
RESET_TIMEOUT_S = 30.0


def enabled() -> bool:
    """Whether this process keeps hosts between jobs (`YATT_KEEP_HOSTS` set to anything but "" or "0")."""
    return os.environ.get(ENV, "") not in ("", "0")


@dataclass
class _Warm:
    session: str  # the driver's Ray node id when parked: another session's handles are dead
    group: Any  # the placement group the hosts sit in
    bundles: tuple[int, float]  # (devices, CPUs per device)
    hosts: dict[int, tuple[float, str, Any]] = field(default_factory=dict)  # device -> (share, label, handle)
    owned: bool = False  # the group was handed over by `release` (else its owner still holds it)


@dataclass
class _Cache:
    """This process's warm set (at most one) and how many hosts were parked and reused."""

    warm: _Warm | None = None
    parked: int = 0
    reused: int = 0
    book: tuple[str, Any] | None = None  # (session, handle) of the parked attempt book
    books_reused: int = 0


@functools.cache
def cache() -> _Cache:
    """The process's one `_Cache` (a per-process cache of host processes, like a cached function's)."""
    return _Cache()


def _session() -> str:
    return ray.get_runtime_context().get_node_id()


def _current() -> _Warm | None:
    """The warm set, if it belongs to this Ray session (forgotten otherwise: its session ended)."""
    kept = cache()
    if kept.warm is not None and (
        not ray.is_initialized() or kept.warm.session != _session() or _removed(kept.warm.group)
    ):
        kept.warm = None
    return kept.warm


def _removed(group: Any) -> bool:
    """Whether the group is gone (released by its owner: Ray killed the hosts in it)."""
    from ray.util import placement_group_table

    try:
        return placement_group_table(group).get("state") in (None, "REMOVED")
    except Exception:
        return True


def realize(plan: Any, *, cpus_per_device: float) -> Any:
    """`yatt_placement.realize.realize`, or the warm placement group when the plan fits in it (no more devices
    than its bundles, the same CPUs per device; device i is bundle i, the bundles past the plan's devices keep
    their parked hosts). A warm set the plan does not fit is dropped first (its hosts hold devices the new
    plan may need)."""
    from yatt_placement.realize import RealizedPlan
    from yatt_placement.realize import realize as reserve

    warm = _current()
    devices, cpus = warm.bundles if warm is not None else (0, 0.0)
    if warm is not None and warm.owned and plan.num_devices <= devices and cpus == float(cpus_per_device):
        warm.owned = False  # the new job holds it until its own release
        return RealizedPlan(plan, warm.group, cpus_per_device)
    _drop_hosts()
    return reserve(plan, cpus_per_device=cpus_per_device)


def release(realized: Any) -> None:
    """`yatt_placement.realize.release`, unless the plan's group holds the warm hosts (it stays with them)."""
    from yatt_placement.realize import release as give_back

    warm = _current()
    if warm is not None and warm.group.id == realized.placement_group.id:
        if warm.hosts:
            warm.owned = True
            return
        cache().warm = None  # its hosts went (a failed attempt kills what it took): the group goes too
    give_back(realized)


def take(realized: Any, device: int, share: float, label: str) -> Any | None:
    """The parked host of `device`'s bundle when it was made for the same share and label (None otherwise:
    a mismatched one is killed, so its share of the bundle is free for the host made instead)."""
    warm = _current()
    if warm is None or warm.group.id != realized.placement_group.id or device not in warm.hosts:
        return None
    parked_share, parked_label, handle = warm.hosts.pop(device)
    if (parked_share, parked_label) == (share, label):
        cache().reused += 1
        return handle
    ray.kill(handle, no_restart=True)
    return None


def park(realized: Any, hosts: list[tuple[int, float, str, Any]]) -> bool:
    """Reset `hosts` ((device, share, label, handle) each) and keep them with `realized`'s group for the next
    job. False, with nothing kept, when any host cannot be reused: the caller kills them all."""
    refs = [handle.reset.remote() for _, _, _, handle in hosts]
    try:
        ready = ray.get(refs, timeout=RESET_TIMEOUT_S)
    except Exception:
        return False
    if not all(ready):
        return False
    warm = _current()
    if warm is not None and warm.group.id != realized.placement_group.id:
        _drop_hosts()
        warm = None
    if warm is None:
        bundles = (realized.plan.num_devices, float(realized.cpus_per_device))
        warm = cache().warm = _Warm(_session(), realized.placement_group, bundles)
    for device, share, label, handle in hosts:
        old = warm.hosts.get(device)
        if old is not None and old[2] != handle:
            ray.kill(old[2], no_restart=True)
        warm.hosts[device] = (share, label, handle)
    cache().parked += len(hosts)
    return True


def take_book(roster: Any, world_size: int) -> Any | None:
    """The parked attempt book, started over with `roster` and `world_size` (None when none is parked in this
    session, or it does not answer)."""
    book = _take_parked_book()
    if book is None:
        return None
    try:
        ray.get(book.reset.remote(roster, world_size), timeout=RESET_TIMEOUT_S)
    except Exception:
        with contextlib.suppress(Exception):
            ray.kill(book, no_restart=True)
        return None
    cache().books_reused += 1
    return book


def _take_parked_book() -> Any | None:
    """The parked book, out of the cache: its handle when it belongs to this Ray session (None otherwise)."""
    kept = cache()
    parked, kept.book = kept.book, None
    if parked is None or not ray.is_initialized() or parked[0] != _session():
        return None
    return parked[1]


def park_book(handle: Any) -> None:
    """Keep a finished attempt's book for the next attempt (one at most: an older one is killed)."""
    kept = cache()
    if kept.book is not None and kept.book[1] != handle:
        with contextlib.suppress(Exception):
            ray.kill(kept.book[1], no_restart=True)
    kept.book = (_session(), handle)


def drop() -> None:
    """Kill the parked hosts and book, and return the hosts' placement group to the cluster when it was handed
    over by `release` (a group its owner still holds stays)."""
    book = _take_parked_book()
    if book is not None:
        with contextlib.suppress(Exception):
            ray.kill(book, no_restart=True)
    _drop_hosts()


def _drop_hosts() -> None:
    warm = _current()
    cache().warm = None
    if warm is None:
        return
    from ray.util.placement_group import remove_placement_group

    for _, _, handle in warm.hosts.values():
        with contextlib.suppress(Exception):
            ray.kill(handle, no_restart=True)
    if warm.owned:
        with contextlib.suppress(Exception):
            remove_placement_group(warm.group)
