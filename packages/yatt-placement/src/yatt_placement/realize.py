"""Realize a `PlacementPlan` as one Ray placement group: bundle i is global device i (extra `ray`).

This is the only module of yatt-placement that imports Ray. Each bundle holds one device (`GPU: 1`, or the
cluster's device kind) plus `cpus_per_device` CPUs. Roles that the plan colocates on a device share its bundle
through fractional resources: when k roles use a device, each asks for 1/k of it (`gpu_fraction`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from yatt_placement.types import PlacementPlan, RolePlacement

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup


class PlacementTimeoutError(TimeoutError):
    """The cluster could not provide a plan's bundles in time; the message names what was missing."""


class RealizedPlan:
    """A plan with its reserved placement group. Bundle i is device i (invariant kept by `realize`)."""

    def __init__(self, plan: PlacementPlan, placement_group: PlacementGroup, cpus_per_device: float) -> None:
        self.plan = plan
        self.placement_group = placement_group
        self.cpus_per_device = cpus_per_device

    def bundle_index(self, device: int) -> int:
        """The bundle of a global device id (0..num_devices-1)."""
        if not 0 <= device < self.plan.num_devices:
            raise ValueError(f"device must be in [0, {self.plan.num_devices}), got {device}")
        return device

    def gpu_fraction(self, role: str, name: str = "") -> float:
        """The share of a device one worker of `role` (and `name`) asks for: 1/k when k roles time-share its
        busiest device, so that all colocated workers fit in one bundle."""
        placement = _find(self.plan, role, name)
        users = _device_users(self.plan)
        sharing = max(users[device] for replica in placement.replicas for device in replica)
        return 1.0 / sharing

    def scheduling_strategy(self, device: int) -> PlacementGroupSchedulingStrategy:
        """A Ray scheduling strategy that pins a task or actor to the bundle of `device`."""
        return PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group,
            placement_group_bundle_index=self.bundle_index(device),
            placement_group_capture_child_tasks=False,
        )


def realize(plan: PlacementPlan, *, cpus_per_device: float = 1.0, timeout_s: float = 60.0) -> RealizedPlan:
    """Reserve one bundle per device of `plan` and wait for it.

    Raises `PlacementTimeoutError` naming the requested and the available resources when the group is not
    ready within `timeout_s`; the half-made group is removed so it holds nothing.
    """
    if cpus_per_device < 0:
        raise ValueError(f"cpus_per_device must be >= 0, got {cpus_per_device}")
    if plan.num_devices < 1:
        raise ValueError(f"plan.num_devices must be >= 1, got {plan.num_devices}")
    bundle = {"GPU": 1.0}
    if cpus_per_device > 0:
        bundle["CPU"] = float(cpus_per_device)
    group = placement_group([dict(bundle) for _ in range(plan.num_devices)], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        needed = {key: value * plan.num_devices for key, value in bundle.items()}
        available = {key: ray.available_resources().get(key, 0.0) for key in bundle}
        total = {key: ray.cluster_resources().get(key, 0.0) for key in bundle}
        short = [key for key in bundle if total[key] < needed[key]]
        why = (
            f"the cluster has too little {', '.join(short)}"
            if short
            else "live actors and other placement groups hold the rest"
        )
        raise PlacementTimeoutError(
            f"could not reserve {plan.num_devices} bundles of {bundle} within {timeout_s} s: "
            f"needed {needed}, available {available} of cluster total {total}; {why}"
        )
    return RealizedPlan(plan, group, cpus_per_device)


def release(realized: RealizedPlan) -> None:
    """Return the plan's bundles to the cluster. Actors still scheduled in them are killed by Ray."""
    remove_placement_group(realized.placement_group)


def _find(plan: PlacementPlan, role: str, name: str) -> RolePlacement:
    for placement in plan.roles:
        if placement.role == role and placement.name == name:
            return placement
    known = [f"{p.role}:{p.name}" if p.name else p.role for p in plan.roles]
    raise ValueError(f"role {role!r} with name {name!r} is not in the plan; the plan has {known}")


def _device_users(plan: PlacementPlan) -> dict[int, int]:
    """Device id -> number of role placements that use it."""
    users = dict.fromkeys(range(plan.num_devices), 0)
    for placement in plan.roles:
        for device in {d for replica in placement.replicas for d in replica}:
            users[device] += 1
    return users
