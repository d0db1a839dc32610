"""Replica faults without a restart (faults.py): the repair book, the swap of replaced workers into a view,
and, with Ray and the runtime's test doubles, a rollout replica whose process dies mid-call in a
disaggregated layout: the call is sent again to its replacement and the run ends without a restart, with the
reports of an uninterrupted run."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yatt_controller_doubles as doubles  # loaded by conftest.py
from yatt_controller.faults import Repair, RepairBook, swap_workers
from yatt_controller.worker_group import Worker, WorkerGroup


class _Handle:
    """A host handle double: only its actor id is read."""

    def __init__(self, hexid: str) -> None:
        self._actor_id = SimpleNamespace(hex=lambda: hexid)


def _worker(host: str, dp: int, tp: int = 0, view_dp: int | None = None) -> Worker:
    return Worker(_Handle(host), "rollout", dp if view_dp is None else view_dp, tp, dp, f"w{dp}.{tp}", dp)


def test_repair_book_grants_one_repair_at_a_time_and_remembers_it():
    book = RepairBook()
    assert book.claim("dead-a") == ("mine", [])
    assert book.claim("dead-a") == ("wait", None)  # another controller asks while the repair runs
    assert book.claim("dead-b") == ("wait", None)  # one repair at a time (a device's new host is shared)
    repair = Repair("dead-a", hosts=["host-1"], workers={"rollout": []}, replicas=2)
    book.finish(repair)
    assert book.claim("dead-a") == ("done", repair)
    assert book.claim("dead-b") == ("mine", ["host-1"])  # hosts earlier repairs made
    book.abandon("dead-b")  # the repairing controller failed: the next asker may try
    assert book.claim("dead-b") == ("mine", ["host-1"])
    assert book.replaced() == 2 and book.log(0) == [repair] and book.log(1) == []


def test_swap_replaces_only_the_restarted_replicas_and_keeps_view_ranks():
    # a view of group ranks 2 and 3 (renumbered 0 and 1); rank 3's host died and was restarted on "new"
    view = WorkerGroup("rollout", "", [_worker("h2", 2, view_dp=0), _worker("h3", 3, view_dp=1)])
    window = view.workers[1].window
    repair = Repair("h3", hosts=[], workers={"rollout": [_worker("new", 3)]}, replicas=1)
    assert swap_workers(view, "rollout", repair)
    hosts = [w.host._actor_id.hex() for w in view.workers]
    assert hosts == ["h2", "new"]
    assert [(w.dp_rank, w.group_dp_rank) for w in view.workers] == [(0, 2), (1, 3)]
    assert view.workers[1].window is window  # the view's own in-flight window
    assert not swap_workers(view, "rollout", repair)  # idempotent
    assert not swap_workers(view, "reward", repair)  # another group's repair leaves it alone


@pytest.fixture(scope="module")
def disaggregated():
    """Learner ranks on devices 0 and 2, one rollout replica on device 1 (no process shared with a learner):
    in parallel mode both controllers call the one replica, so both see its death."""
    import ray
    import yatt_placement.realize as realize_mod
    from yatt_placement.types import PlacementPlan, RolePlacement

    doubles.start_ray(sys.modules[__name__])
    plan = PlacementPlan(
        mode="disaggregated",
        num_devices=3,
        roles=[
            RolePlacement(role="actor", replicas=[[0], [2]]),
            RolePlacement(role="rollout", replicas=[[1]]),
        ],
    )
    realized = realize_mod.realize(plan, cpus_per_device=1.0)
    yield realized
    realize_mod.release(realized)
    ray.shutdown()


CHUNKS = 4  # rollout calls per controller and step


def one_call_per_chunk_step(ctx, batch: list[int]) -> dict[str, float]:
    """Four chunks, each one `call_one` (the retryable service call), then train on every sample."""
    rollout = ctx.services["rollout"]
    with ctx.phase("rollout"):
        chunks = ctx.get([rollout.call_one("generate", batch[i::CHUNKS]) for i in range(CHUNKS)])
    samples = [s for chunk in chunks for s in chunk]
    ctx.check_versions([s["version"] for s in samples])
    totals = ctx.get(ctx.learner.gather(ctx.learner.scatter("train", samples)))
    x_sum = ctx.all_reduce({"x": float(sum(s["x"] for s in samples))})["x"]
    return {"num_samples": float(len(samples)), "x_sum": x_sum, "total": float(sum(totals))}


def _job(engine_kwargs: dict, num_steps: int = 3):
    from yatt_controller.runner import Job, Services
    from yatt_controller.worker_group import HostPool

    def build(pool: HostPool) -> Services:
        learner = WorkerGroup.create(pool, "actor", doubles.CountingLearner, pass_worker_info=True)
        rollout = WorkerGroup.create(pool, "rollout", doubles.ScriptedEngine, kwargs=engine_kwargs)
        return Services(groups={"actor": learner, "rollout": rollout}, learner="actor")

    return Job(
        build=build,
        step_fn=one_call_per_chunk_step,
        dataset=lambda: list(range(64)),
        batch_size=8,
        num_steps=num_steps,
    )


@pytest.mark.parametrize(
    ("mode", "controllers"), [("parallel", 2), pytest.param("single", 1, marks=pytest.mark.slow)]
)
def test_dead_rollout_replica_is_replaced_and_its_calls_sent_again(
    disaggregated, tmp_path, mode, controllers
):
    from yatt_controller.runner import run
    from yatt_controller.types import ControllerSpec

    spec = ControllerSpec(
        mode=mode,
        num_controllers=controllers,
        heartbeat_interval_s=0.5,
        hang_timeout_s=60.0,
        on_failure="fail",
    )
    # the replica's process dies (os._exit) in the first call of step 1, with that step's calls in flight
    crashing = {"crash_at_call": CHUNKS * controllers, "marker": str(tmp_path / "crashed")}
    faulty = run(spec, _job(crashing), disaggregated)
    assert Path(crashing["marker"]).exists()
    assert faulty.restarts == 0 and faulty.failures == []  # on_failure="fail": any failure would raise
    assert faulty.replicas_replaced == 1  # once, though every controller saw the death
    whole = run(spec, _job({}), disaggregated)
    assert whole.replicas_replaced == 0
    counts = [faulty.reports[s][0].metrics.pop("faults/replicas_replaced") for s in range(3)]
    assert counts == [0.0, 1.0, 1.0]  # rank 0's running count: the replacement happened in step 1
    assert all(whole.reports[s][0].metrics.pop("faults/replicas_replaced") == 0.0 for s in range(3))
    # the calls sent again made the same samples: every step trained on all 8 rows, as without the fault
    assert [r.metrics for s in range(3) for r in faulty.reports[s]] == [
        r.metrics for s in range(3) for r in whole.reports[s]
    ]
    assert all(faulty.reports[s][0].metrics["num_samples"] == 8 / controllers for s in range(3))


@pytest.mark.slow
def test_a_rollout_replica_sharing_a_learner_process_is_a_learner_death(disaggregated, tmp_path):
    """Colocated: the rollout replica's process is learner rank 0's, so its death is not repaired: the attempt
    fails (on_failure="fail") naming the dead process, as before replica repairs existed."""
    import yatt_placement.realize as realize_mod
    from yatt_controller.runner import ControllerFailure, run
    from yatt_controller.types import ControllerSpec
    from yatt_placement.types import PlacementPlan, RolePlacement

    plan = PlacementPlan(
        mode="colocated",
        num_devices=2,
        roles=[
            RolePlacement(role="actor", replicas=[[0], [1]], colocated_with=["rollout"]),
            RolePlacement(role="rollout", replicas=[[0], [1]], colocated_with=["actor"]),
        ],
    )
    realized = realize_mod.realize(plan, cpus_per_device=1.0)
    spec = ControllerSpec(num_controllers=2, heartbeat_interval_s=0.5, hang_timeout_s=60.0, on_failure="fail")
    crashing = {"crash_at_call": CHUNKS, "marker": str(tmp_path / "crashed")}
    try:
        with pytest.raises(ControllerFailure) as failure:
            run(spec, _job(crashing), realized)
    finally:
        realize_mod.release(realized)
    assert Path(crashing["marker"]).exists()
    assert "died" in str(failure.value) and "hang" not in str(failure.value)
