"""The runtime on layouts beyond full colocation, with real Ray and test doubles: learner dispatch in single
and parallel mode (`shard_rows`). One Ray session for the module; each test realizes its own plan."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import yatt_placement.realize as realize_mod
from yatt_controller.runner import Job, Services, run
from yatt_controller.types import ControllerSpec
from yatt_controller.worker_group import HostPool, WorkerGroup
from yatt_placement.types import PlacementPlan, RolePlacement

pytest.importorskip("torch")


def _load_doubles():
    spec = importlib.util.spec_from_file_location(
        "yatt_controller_doubles", Path(__file__).with_name("doubles.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


doubles = _load_doubles()


@pytest.fixture(scope="module")
def session():
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(doubles)  # Ray workers cannot import test modules
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=8, num_gpus=16, include_dashboard=False, object_store_memory=512 * 2**20)
    yield
    ray.shutdown()


def _realize(*roles: RolePlacement, num_devices: int, mode: str = "disaggregated"):
    plan = PlacementPlan(mode=mode, num_devices=num_devices, roles=list(roles))
    return realize_mod.realize(plan, cpus_per_device=0.5)


def _rows() -> list[int]:
    return list(range(64))


def test_shard_rows_reaches_every_learner_rank_in_single_mode(session):
    realized = _realize(RolePlacement(role="actor", replicas=[[0], [1]]), num_devices=2)

    def build(pool: HostPool) -> Services:
        learner = WorkerGroup.create(pool, "actor", doubles.RowRecorder, pass_worker_info=True)
        return Services(groups={"actor": learner}, learner="actor")

    job = Job(build=build, step_fn=doubles.rows_step, dataset=_rows, batch_size=8, num_steps=2)
    try:
        single = run(ControllerSpec(mode="single", heartbeat_interval_s=0.5), job, realized)
        parallel = run(ControllerSpec(num_controllers=2, heartbeat_interval_s=0.5), job, realized)
    finally:
        realize_mod.release(realized)
    for step in range(2):
        (s,) = single.reports[step]
        # single: one controller, both DDP ranks joined the call, each with its contiguous half of 8 rows
        assert s.metrics["rank0_n"] == s.metrics["rank1_n"] == 4
        p0, p1 = parallel.reports[step]
        # parallel: each controller's one learner rank got that controller's whole shard (4 rows)
        assert set(p0.metrics) == {"rank0_n", "rank0_first", "rank0_sig"}
        assert set(p1.metrics) == {"rank1_n", "rank1_first", "rank1_sig"}
        assert p0.metrics["rank0_n"] == p1.metrics["rank1_n"] == 4
        # the same rows in the same order reach the same rank in both modes
        for r, p in ((0, p0), (1, p1)):
            assert s.metrics[f"rank{r}_sig"] == p.metrics[f"rank{r}_sig"]
            assert s.metrics[f"rank{r}_first"] == p.metrics[f"rank{r}_first"]
