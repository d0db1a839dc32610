"""`realize` on a real local Ray cluster with 8 logical GPUs: actors land on the bundles the plan names, and
colocated roles share a device through fractional GPUs."""

import os

import pytest

ray = pytest.importorskip("ray")

from yatt_placement.realize import PlacementTimeoutError, realize, release  # noqa: E402
from yatt_placement.types import PlacementPlan, RolePlacement  # noqa: E402

PARTIAL = PlacementPlan(
    mode="partial",
    num_devices=8,
    roles=[
        RolePlacement(role="actor", replicas=[list(range(8))], colocated_with=["rollout", "genrm"]),
        RolePlacement(role="rollout", replicas=[[0, 1], [2, 3]], colocated_with=["actor"]),
        RolePlacement(role="genrm", replicas=[[4, 5, 6, 7]], name="judge", colocated_with=["actor"]),
    ],
)


@pytest.fixture(scope="module")
def ray_session():
    # No auth token under $HOME, no usage stats (also set by the workspace conftest; this package runs alone too).
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # A session left by an earlier module (e.g. one Ray auto-started on a bare ray.put) has other resources.
    if ray.is_initialized():
        ray.shutdown()
    # Generous logical CPUs: a placement group cannot take CPUs that live actors hold.
    ray.init(
        address="local", num_cpus=32, num_gpus=8, include_dashboard=False, object_store_memory=512 * 2**20
    )
    yield
    ray.shutdown()


@ray.remote
class Probe:
    """Reports which logical GPU, what share of it, and which placement group Ray gave it."""

    def where(self):
        context = ray.get_runtime_context()
        gpu_ids = [int(i) for i in ray.get_gpu_ids()]
        return gpu_ids, context.get_assigned_resources()["GPU"], context.get_placement_group_id()


def test_actors_land_on_the_planned_bundles(ray_session):
    realized = realize(PARTIAL, cpus_per_device=2.0, timeout_s=30)
    try:
        # actor + rollout on 0..3 and actor + judge on 4..7: every device is shared by two roles.
        assert realized.gpu_fraction("actor") == 0.5
        assert realized.gpu_fraction("rollout") == 0.5
        assert realized.gpu_fraction("genrm", "judge") == 0.5
        # The trainer on the first and last device of each slice, and rollout and judge beside it there.
        probe_devices = {"actor": (0, 3, 4, 7), "rollout": (0, 3), "genrm": (4, 7)}
        probes = {}
        for placement in PARTIAL.roles:
            fraction = realized.gpu_fraction(placement.role, placement.name)
            for device in probe_devices[placement.role]:
                probes[(placement.role, device)] = Probe.options(
                    num_gpus=fraction, num_cpus=1.0, scheduling_strategy=realized.scheduling_strategy(device)
                ).remote()
        where = {key: ray.get(probe.where.remote()) for key, probe in probes.items()}
        pg_id = realized.placement_group.id.hex()
        for (role, device), (gpu_ids, share, actor_pg) in where.items():
            assert (len(gpu_ids), share, actor_pg) == (1, 0.5, pg_id), (role, device)
        # A bundle holds exactly one logical GPU, so: the roles that share device d see the same GPU, and
        # different devices are different GPUs.
        gpu_of = {device: where[("actor", device)][0][0] for device in (0, 3, 4, 7)}
        assert len(set(gpu_of.values())) == 4
        for (role, device), (gpu_ids, _, _) in where.items():
            assert gpu_ids[0] == gpu_of[device], (role, device)
        for probe in probes.values():
            ray.kill(probe)
    finally:
        release(realized)


def test_bad_lookups_name_the_problem(ray_session):
    realized = realize(PARTIAL, timeout_s=30)
    try:
        with pytest.raises(ValueError, match=r"device must be in \[0, 8\), got 8"):
            realized.bundle_index(8)
        with pytest.raises(ValueError, match=r"role 'genrm' with name '' is not in the plan; the plan has "):
            realized.gpu_fraction("genrm")
    finally:
        release(realized)


def test_a_plan_larger_than_the_cluster_times_out_naming_the_shortfall(ray_session):
    big = PlacementPlan(
        mode="disaggregated", num_devices=16, roles=[RolePlacement(role="actor", replicas=[])]
    )
    with pytest.raises(
        PlacementTimeoutError,
        match=r"could not reserve 16 bundles .* needed \{'GPU': 16.0.*the cluster has too little GPU$",
    ):
        realize(big, timeout_s=1.0)
    # The failed group was removed: the whole cluster is free again.
    realized = realize(PARTIAL, timeout_s=30)
    release(realized)
