"""The runtime with real tiny transformers models: weight sync over a gloo broadcast group (bit for bit),
colocated in-process sync, and two parallel controllers running RL steps with 0 sample bytes through the
driver. One Ray session for the module."""

from __future__ import annotations

import socket
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import ray
import yatt_controller_doubles as doubles  # loaded by conftest.py
import yatt_controller_tiny_models as tiny
import yatt_placement.realize as realize_mod
from yatt_controller.runner import Job, Services, run
from yatt_controller.sync import WeightSync
from yatt_controller.types import ControllerSpec
from yatt_controller.worker_group import HostPool, WorkerGroup
from yatt_placement.types import PlacementPlan, RolePlacement


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    doubles.start_ray(tiny, sys.modules[__name__])
    plan = PlacementPlan(
        mode="disaggregated",
        num_devices=3,
        roles=[
            RolePlacement(role="actor", replicas=[[0], [1]]),
            RolePlacement(role="rollout", replicas=[[2]]),
        ],
    )
    realized = realize_mod.realize(plan, cpus_per_device=1.0)
    yield realized
    realize_mod.release(realized)
    doubles.end_module()


def _build(pool: HostPool) -> Services:
    learner = WorkerGroup.create(pool, "actor", tiny.TinyLearner, args=(_free_port(),), pass_worker_info=True)
    engine = WorkerGroup.create(pool, "rollout", tiny.TinyEngine)
    sync = WeightSync(learner, [engine], mode="broadcast", backend="gloo", bucket_bytes=64 * 1024)
    return Services(groups={"actor": learner, "rollout": engine}, learner="actor", weight_sync=sync)


def _prompts() -> list[list[int]]:
    return [[1, 2 + i % 10, 3 + i % 7] for i in range(32)]


@pytest.mark.slow
def test_two_controllers_train_tiny_models_with_broadcast_weight_sync(cluster):
    job = Job(build=_build, step_fn=tiny.rl_step, dataset=_prompts, batch_size=8, num_steps=2)
    spec = ControllerSpec(num_controllers=2, heartbeat_interval_s=0.5, count_driver_bytes=True)  # asserted
    result = run(spec, job, cluster)
    assert (
        result.driver_bytes is not None and result.driver_bytes < 200 * 1024 and result.restarts == 0
    )  # reports and heartbeats only
    assert sorted(result.reports) == [0, 1]
    for step, reports in result.reports.items():
        assert [r.controller_rank for r in reports] == [0, 1]
        for report in reports:
            # the engine starts at version 0 (pushed at launch) and each step pushes the next
            assert report.metrics["version"] == step + 1
            assert report.metrics["weights_equal"] == 1.0
            assert report.metrics["num_samples"] == 8 and report.num_samples == 4
            assert set(report.timings_s) == {"rollout", "train", "sync", "step"}
        assert reports[0].metrics["loss"] == reports[1].metrics["loss"]  # all-reduced


def test_broadcast_and_colocated_sync_are_bit_exact(cluster):
    pool = HostPool(cluster)
    try:
        learner = WorkerGroup.create(
            pool, "actor", tiny.TinyLearner, args=(_free_port(),), pass_worker_info=True
        )
        engine = WorkerGroup.create(pool, "rollout", tiny.TinyEngine, kwargs={"seed": 5})
        before = ray.get([learner.rank_zero("weights_digest"), engine.rank_zero("weights_digest")])
        assert before[0] != before[1]  # different seeds: a sync has something to do
        sync = WeightSync(learner, [engine], mode="broadcast", bucket_bytes=32 * 1024)
        sync.setup()
        sent = sync.push(version=7)
        # every parameter of the tiny Llama, float32: embed 64x64, 2 x (4 attn 64x64 + mlp 3 x 64x128 + 2 norms
        # of 64), final norm 64, lm_head 64x64
        per_layer = 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64
        assert sent == 4 * (64 * 64 + 2 * per_layer + 64 + 64 * 64)
        after = ray.get([learner.rank_zero("weights_digest"), engine.rank_zero("weights_digest")])
        assert after[0] == after[1]  # bit for bit
        assert ray.get(engine.rank_zero("generate", [[1, 2, 3]]))[0]["version"] == 7
        with pytest.raises(ValueError, match="no 'actor' worker on device 2, where a target worker runs"):
            WeightSync(learner, [engine], mode="colocated")
    finally:
        pool.shutdown()


def test_a_pairwise_push_loads_only_the_engines_beside_its_sources(cluster):
    """Two devices, a learner rank and an engine on each (one process per device): a push limited to one
    rank's label (what each controller of a pairwise push sends) copies into that rank's engine alone, bit for
    bit, and counts its bytes; the other rank's share completes the push. Labels that are no source move
    nothing. A colocated-mode push loads both engines in process; a broadcast to them is refused."""
    plan = PlacementPlan(
        mode="colocated",
        num_devices=2,
        roles=[
            RolePlacement(role="actor", replicas=[[0], [1]]),
            RolePlacement(role="rollout", replicas=[[0], [1]]),
        ],
    )
    realized = realize_mod.realize(plan, cpus_per_device=1.0)
    pool = HostPool(realized)
    try:
        learner = WorkerGroup.create(
            pool, "actor", tiny.TinyLearner, args=(_free_port(),), pass_worker_info=True
        )
        engine = WorkerGroup.create(pool, "rollout", tiny.TinyEngine, kwargs={"seed": 5})
        sync = WeightSync(learner, [engine])  # auto: both targets load in process
        assert len(sync.pairs) == 2 and not sync.remote

        def digests() -> list:
            return ray.get([w.host.call.remote(w.key, "weights_digest", (), {}) for w in engine.workers])

        source = ray.get(learner.rank_zero("weights_digest"))
        assert digests()[0] != source and digests()[1] != source
        assert sync.push(version=4, sources={"no such worker"}) == 0
        one = sync.push(version=4, sources={learner.workers[0].label})
        per_layer = 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64  # the tiny Llama's float32 parameters (as above)
        assert one == 4 * (64 * 64 + 2 * per_layer + 64 + 64 * 64)
        assert digests()[0] == source and digests()[1] != source
        assert sync.push(version=4, sources={learner.workers[1].label}) == one
        assert digests() == [source, source]
        # the whole push in colocated mode: each engine loads in its learner rank's process (nothing to form),
        # every engine's bytes counted; a broadcast cannot reach an engine in the sender's own process
        assert len(pool.hosts) == 2  # a learner rank and an engine share each device's process
        colocated = WeightSync(learner, [engine], mode="colocated")
        colocated.setup()
        assert colocated.push(version=5) == 2 * one
        assert digests() == [source, source]
        assert [g["version"] for g in ray.get(engine.rank_zero("generate", [[1, 2, 3]]))] == [5]
        with pytest.raises(ValueError, match="share the sender's process; use mode='colocated'"):
            WeightSync(learner, [engine], mode="broadcast").setup()
    finally:
        pool.shutdown()
        realize_mod.release(realized)
