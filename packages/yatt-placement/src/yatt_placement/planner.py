"""The pure planner: `plan(cluster, roles, mode) -> PlacementPlan`. Imports no Ray.

Every role's `RolePlacement.replicas` is a list of model-parallel groups (each `tensor_parallel x
pipeline_parallel` global device ids): engines for a service role (rollout, reward, GenRM), data-parallel ranks
for a trained or SPMD role (actor, critic, reference). Device ids are global, node = id // devices_per_node.

Modes (WeChat-YATT, arXiv 2508.07970, and PAPERS.md "Placement"):
- colocated: every role spans all devices and time-shares them (sleep/offload between phases).
- partial / dynamic: the trainer-side roles span all devices; rollout takes [0, S), the GenRMs [S, N). S is the
  feasible split (a multiple of the rollout's model-parallel size, every GenRM engine inside one node) that
  minimises the predicted concurrent time max(work_r / S, work_g / G_g) from the profile: the profiled split
  N x w_r / (w_r + w_g) rounded to the best neighbouring model-parallel multiple. Several GenRMs: explicit
  counts first, then the rest round-robin, largest model-parallel size first (as the paper).
- disaggregated: consecutive disjoint slices in the order actor, critic, reference, rollout, GenRMs, reward,
  except that larger model-parallel groups go first so every group stays inside a node. Explicit `num_replicas` first; the rest water-fills one model-parallel chunk at a time to the role whose
  predicted time (work / devices) is largest. Departure: the paper leaves the sizes to the user.
Without a `JobProfile`, a role's work is approximated by its parameter count (x3 when trained: forward and
backward), a crude proxy; pass a profile.
A role with `RoleSpec.shares` takes no devices of its own in any mode: it gets a replica on each device of the
role it names (a rule reward beside the rollout engines, so a disaggregated rule-only job fits two devices).
"""

from __future__ import annotations

from yatt_placement.memory import check_memory
from yatt_placement.types import (
    ClusterSpec,
    JobProfile,
    PlacementMode,
    PlacementPlan,
    RolePlacement,
    RoleSpec,
)

SPLIT_ROLES = ("rollout", "genrm")  # in partial mode these share the devices; the rest span all of them
DISAGGREGATED_ORDER = ("actor", "critic", "reference", "rollout", "genrm", "reward")


def role_key(item: RoleSpec | RolePlacement) -> str:
    """The name a role goes by in plans, profiles and `PhaseStats`: its `name`, or the role when unnamed."""
    return item.name or item.role


def plan(
    cluster: ClusterSpec,
    roles: list[RoleSpec],
    mode: PlacementMode,
    *,
    profile: JobProfile | None = None,
    optimizer_overhead: float = 1.0,
    activation_gb: float = 4.0,
) -> PlacementPlan:
    """Place `roles` on `cluster` under `mode`; raise ValueError naming the role and the problem."""
    specs = _check_roles(cluster, roles)
    own = [spec for spec in specs if not spec.shares]  # the sharing roles follow theirs in `lay_out`
    if mode == "colocated":
        counts = dict.fromkeys((role_key(spec) for spec in own), cluster.num_devices)
        reason = "every role time-shares all devices"
    elif mode in ("partial", "dynamic"):
        counts, reason = _partial_counts(cluster, own, profile)
    elif mode == "disaggregated":
        counts, reason = _disaggregated_counts(cluster, own, profile)
    else:
        raise ValueError(f"mode must be one of colocated, partial, disaggregated, dynamic; got {mode!r}")
    result = lay_out(cluster, specs, mode, counts)
    result.reason = reason
    check_memory(result, cluster, specs, optimizer_overhead=optimizer_overhead, activation_gb=activation_gb)
    return result


def lay_out(
    cluster: ClusterSpec, roles: list[RoleSpec], mode: PlacementMode, counts: dict[str, int]
) -> PlacementPlan:
    """Turn device counts per role into a plan. Raises ValueError if a model-parallel group would cross a
    node (a group no larger than a node stays inside one; a larger one starts on a node boundary). A role
    with `shares` gets the replicas of the role it names and needs no count."""
    n = cluster.num_devices
    sharing, roles = [s for s in roles if s.shares], [s for s in roles if not s.shares]
    sized = [
        role_key(s)
        for s in roles
        if mode == "disaggregated" or (mode != "colocated" and s.role in SPLIT_ROLES)
    ]
    missing = [key for key in sized if key not in counts]
    if missing:
        raise ValueError(f"counts has no device count for {missing}")
    starts: dict[str, int] = {}
    if mode == "colocated":
        starts = dict.fromkeys(counts, 0)
    elif mode in ("partial", "dynamic"):
        cursor = 0
        for spec in sorted((s for s in roles if s.role in SPLIT_ROLES), key=lambda s: s.role != "rollout"):
            starts[role_key(spec)], cursor = cursor, cursor + counts[role_key(spec)]
        starts.update({role_key(s): 0 for s in roles if s.role not in SPLIT_ROLES})
    else:
        cursor = 0
        for spec in sorted(roles, key=_disaggregated_rank):
            starts[role_key(spec)], cursor = cursor, cursor + counts[role_key(spec)]
    placements = []
    for spec in roles:
        key = role_key(spec)
        spans_all = mode == "colocated" or (mode != "disaggregated" and spec.role not in SPLIT_ROLES)
        placements.append(_place(cluster, spec, starts[key], n if spans_all else counts[key]))
    by_key = {role_key(p): p for p in placements}
    for spec in sharing:
        host = by_key[spec.shares]
        replicas = [[device] for replica in host.replicas for device in replica]  # one per host device
        placements.append(RolePlacement(role=spec.role, replicas=replicas, name=spec.name))
    _mark_sharing(placements)
    return PlacementPlan(mode=mode, num_devices=n, roles=placements)


def _disaggregated_rank(spec: RoleSpec) -> tuple[int, int]:
    # Largest model-parallel groups first keep every group node-aligned when sizes are powers of two.
    return (-spec.model_parallel_size, DISAGGREGATED_ORDER.index(spec.role))


def _place(cluster: ClusterSpec, spec: RoleSpec, start: int, num_devices: int) -> RolePlacement:
    mp = spec.model_parallel_size
    if start + num_devices > cluster.num_devices:
        raise ValueError(
            f"role {role_key(spec)!r} would need devices up to {start + num_devices - 1}, but the cluster "
            f"has {cluster.num_devices}"
        )
    if spec.role in ("actor", "critic", "reference") and num_devices % mp:
        raise ValueError(
            f"role {role_key(spec)!r}: model-parallel size {mp} does not divide the {num_devices} devices "
            "it spans (data parallel must be whole)"
        )
    num_groups = num_devices // mp
    if spec.num_replicas and spec.role not in ("actor", "critic", "reference"):
        num_groups = min(num_groups, spec.num_replicas)
    replicas = [list(range(start + g * mp, start + (g + 1) * mp)) for g in range(num_groups)]
    dpn = cluster.devices_per_node
    for replica in replicas:
        inside_node = replica[0] // dpn == replica[-1] // dpn
        if (mp <= dpn and not inside_node) or (mp > dpn and replica[0] % dpn):
            raise ValueError(
                f"role {role_key(spec)!r}: model-parallel group {replica[0]}..{replica[-1]} crosses a node "
                f"boundary ({dpn} devices per node); choose counts that are multiples of {min(mp, dpn)}"
            )
    return RolePlacement(role=spec.role, replicas=replicas, name=spec.name)


def _mark_sharing(placements: list[RolePlacement]) -> None:
    devices = [{d for replica in p.replicas for d in replica} for p in placements]
    for i, placement in enumerate(placements):
        placement.colocated_with = [
            role_key(other) for j, other in enumerate(placements) if j != i and devices[i] & devices[j]
        ]


def _check_roles(cluster: ClusterSpec, roles: list[RoleSpec]) -> list[RoleSpec]:
    if not roles:
        raise ValueError("roles must not be empty")
    seen: set[str] = set()
    for spec in roles:
        key = role_key(spec)
        if key in seen:
            raise ValueError(f"two roles go by {key!r}: give each a distinct RoleSpec.name")
        seen.add(key)
        if spec.model_parallel_size > cluster.num_devices:
            raise ValueError(
                f"role {key!r} needs {spec.model_parallel_size} devices per model-parallel group, "
                f"but the cluster has {cluster.num_devices}"
            )
    owners = sorted(role_key(spec) for spec in roles if not spec.shares)
    for spec in roles:
        if spec.shares and spec.shares not in owners:
            raise ValueError(
                f"role {role_key(spec)!r} shares {spec.shares!r}, which is not a role with devices of its own "
                f"in this plan (those are {owners})"
            )
        if spec.shares and spec.model_parallel_size != 1:
            raise ValueError(
                f"role {role_key(spec)!r} shares {spec.shares!r} but spans {spec.model_parallel_size} devices "
                "per group; a sharing role runs one replica on each device of its host"
            )
    if not any(spec.role == "actor" for spec in roles):
        raise ValueError("roles must include an 'actor' (the policy trainer)")
    return list(roles)


def work(spec: RoleSpec, profile: JobProfile | None) -> float:
    """Device-seconds of work per step: from the profile, else the parameter-count proxy."""
    if profile is None:
        return spec.num_params * (3.0 if spec.trainable else 1.0)
    if role_key(spec) not in profile.device_seconds:
        raise ValueError(
            f"JobProfile.device_seconds has no entry for role {role_key(spec)!r}; "
            f"it has {sorted(profile.device_seconds)}"
        )
    return profile.device_seconds[role_key(spec)]


def _partial_counts(
    cluster: ClusterSpec, specs: list[RoleSpec], profile: JobProfile | None
) -> tuple[dict[str, int], str]:
    rollouts = [s for s in specs if s.role == "rollout"]
    genrms = [s for s in specs if s.role == "genrm"]
    if len(rollouts) != 1 or not genrms:
        raise ValueError(
            "partial placement needs exactly one 'rollout' role and at least one 'genrm' role "
            f"(got {len(rollouts)} rollout, {len(genrms)} genrm); use colocated or disaggregated instead"
        )
    rollout, n = rollouts[0], cluster.num_devices
    mp = rollout.model_parallel_size
    options = [rollout.num_replicas * mp] if rollout.num_replicas else range(mp, n, mp)
    best: tuple[float, dict[str, int]] | None = None
    for s in options:
        split = split_genrms(n - s, genrms)
        if split is None:
            continue
        counts = {role_key(rollout): s, **split}
        try:
            lay_out(cluster, specs, "partial", counts)
        except ValueError:
            continue  # a GenRM group would cross a node: not a feasible S
        predicted = max(work(spec, profile) / counts[role_key(spec)] for spec in [rollout, *genrms])
        unused = n - sum(counts.values())  # on a tie, leave no device idle
        if best is None or (predicted, unused) < (best[0], n - sum(best[1].values())):
            best = (predicted, counts)
    if best is None:
        raise ValueError(
            f"partial placement: no split of {n} devices gives rollout {role_key(rollout)!r} a multiple of "
            f"{mp} devices and every GenRM whole engines inside nodes; check num_replicas and model-parallel sizes"
        )
    predicted, counts = best
    shares = ", ".join(f"{key} {count}" for key, count in counts.items())
    if profile is None:  # the parameter-count proxy: a load, not a time
        figure = f"predicted concurrent load {predicted:.4g} parameters per device (no profile: a proxy)"
    else:
        figure = f"predicted concurrent time {predicted:.4g} s per step (profiled)"
    return {**counts, **_spanning(specs, n)}, f"split {shares}: {figure}"


def split_genrms(num_devices: int, genrms: list[RoleSpec]) -> dict[str, int] | None:
    """GenRM device counts on `num_devices`: explicit counts first, then one engine at a time round-robin,
    largest model-parallel size first. None when an explicit count does not fit or a GenRM gets nothing."""
    counts = {role_key(s): s.num_replicas * s.model_parallel_size for s in genrms if s.num_replicas}
    left = num_devices - sum(counts.values())
    free = sorted((s for s in genrms if not s.num_replicas), key=lambda s: -s.model_parallel_size)
    if left < 0:
        return None
    counts.update({role_key(s): 0 for s in free})
    progress = True
    while progress:
        progress = False
        for spec in free:
            if spec.model_parallel_size <= left:
                counts[role_key(spec)] += spec.model_parallel_size
                left -= spec.model_parallel_size
                progress = True
    if any(counts[role_key(s)] == 0 for s in free):
        return None
    return {role_key(s): counts[role_key(s)] for s in genrms}


def _spanning(specs: list[RoleSpec], n: int) -> dict[str, int]:
    return {role_key(s): n for s in specs if s.role not in SPLIT_ROLES}


def _disaggregated_counts(
    cluster: ClusterSpec, specs: list[RoleSpec], profile: JobProfile | None
) -> tuple[dict[str, int], str]:
    counts = {role_key(s): s.num_replicas * s.model_parallel_size for s in specs}
    free = [s for s in specs if not s.num_replicas]
    for spec in free:
        counts[role_key(spec)] = spec.model_parallel_size
    left = cluster.num_devices - sum(counts.values())
    if left < 0:
        raise ValueError(
            f"disaggregated placement needs at least {sum(counts.values())} devices "
            f"(explicit replicas plus one model-parallel group per other role), the cluster has "
            f"{cluster.num_devices}"
        )
    while True:
        fits = [s for s in free if s.model_parallel_size <= left]
        if not fits:
            break
        spec = max(fits, key=lambda s: work(s, profile) / counts[role_key(s)])
        counts[role_key(spec)] += spec.model_parallel_size
        left -= spec.model_parallel_size
    shares = ", ".join(f"{key} {count}" for key, count in counts.items())
    return counts, f"disjoint slices: {shares}" + (f" ({left} devices unused)" if left else "")
