"""The runtime on layouts beyond full colocation, with real Ray and test doubles: learner dispatch in single
and parallel mode (`shard_rows`). One Ray session for the module; each test realizes its own plan."""

from __future__ import annotations

import sys

import pytest
import ray
import yatt_controller_doubles as doubles  # loaded by conftest.py
import yatt_placement.realize as realize_mod
from yatt_controller.runner import Job, Services, run
from yatt_controller.stream import Stage, run_stream
from yatt_controller.sync import WeightSync
from yatt_controller.types import ControllerSpec
from yatt_controller.worker_group import HostPool, WorkerGroup
from yatt_placement.types import PlacementPlan, RolePlacement

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def session():
    doubles.start_ray(sys.modules[__name__])
    yield
    doubles.end_module()


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


class Handshake:
    """Test double: its constructor writes `mine` and then waits up to 20 s for `theirs`; raises if it never
    appears. Two groups of it, each waiting for the other's file, exist only if they are built at once."""

    def __init__(self, mine: str, theirs: str) -> None:
        import time
        from pathlib import Path

        Path(mine).touch()
        deadline = time.monotonic() + 20
        while not Path(theirs).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{theirs} never appeared")
            time.sleep(0.05)


class FailsToStart:
    def __init__(self) -> None:
        raise RuntimeError("no device memory left (test double)")


def test_groups_created_without_waiting_start_at_once_and_ready_raises_their_failure(session, tmp_path):
    realized = _realize(
        RolePlacement(role="actor", replicas=[[0]]),
        RolePlacement(role="rollout", replicas=[[1]]),
        RolePlacement(role="reward", replicas=[[2]]),
        num_devices=3,
    )
    pool = HostPool(realized)
    a, b = str(tmp_path / "actor"), str(tmp_path / "rollout")
    try:
        # each constructor waits for the other's: created one after the other (wait=True) the first would
        # time out; created without waiting both are under way at once
        actor = WorkerGroup.create(pool, "actor", Handshake, args=(a, b), wait=False)
        rollout = WorkerGroup.create(pool, "rollout", Handshake, args=(b, a), wait=False)
        assert actor.ready() is actor and rollout.ready() is rollout
        assert actor.ready() is actor  # nothing left to wait for
        broken = WorkerGroup.create(pool, "reward", FailsToStart, wait=False)
        with pytest.raises(Exception, match="no device memory left"):
            broken.ready()
    finally:
        pool.shutdown()
        realize_mod.release(realized)


class Closing:
    """Test double: `close()` appends "closed" to `marker` (and raises afterwards when `fails`); it holds a
    reference cycle (only the cycle collector frees it), and appends "collected" when it is freed."""

    def __init__(self, marker: str, fails: bool = False) -> None:
        self.marker, self.fails = marker, fails
        self.cycle = [self]

    def ping(self) -> str:
        return "here"

    def frozen(self) -> int:
        import gc

        return gc.get_freeze_count()

    def _note(self, what: str) -> None:
        from pathlib import Path

        with Path(self.marker).open("a") as out:
            out.write(what + "\n")

    def close(self) -> None:
        self._note("closed")
        if self.fails:
            raise RuntimeError("close failed (test double)")

    def __del__(self) -> None:
        self._note("collected")


def test_a_host_closes_what_it_destroys_and_drops_it_even_when_close_fails(session, tmp_path):
    """A role moving away is destroyed in its host: its `close()` runs first (an engine's thread would keep
    the engine, and its memory, alive otherwise), once; a `close()` that raises still lets it go. The host
    froze its heap after each create (no full collection walks it in a step); a destroyed object is
    collected all the same, reference cycles included."""
    realized = _realize(
        RolePlacement(role="rollout", replicas=[[0], [1]]),
        RolePlacement(role="reward", replicas=[[2]]),
        num_devices=3,
    )
    pool = HostPool(realized)
    marker = tmp_path / "closed"
    try:
        group = WorkerGroup.create(pool, "rollout", Closing, args=(str(marker),))
        failing = WorkerGroup.create(pool, "reward", Closing, args=(str(marker),), kwargs={"fails": True})
        for worker in (group.workers[0], failing.workers[0]):
            ray.get(worker.host.destroy.remote(worker.key))
            with pytest.raises(Exception, match="KeyError"):
                ray.get(worker.host.call.remote(worker.key, "ping", (), {}))
        assert marker.read_text() == "closed\ncollected\nclosed\ncollected\n"
        assert ray.get(group.workers[1].host.call.remote(group.workers[1].key, "ping", (), {})) == "here"
        assert ray.get(group.workers[1].host.call.remote(group.workers[1].key, "frozen", (), {})) > 1000
    finally:
        pool.shutdown()
        realize_mod.release(realized)


WEIGHT_BYTES = 64 * 32 * 4 + 32 * 4 + 16 * 2  # WeightsDouble: float32 w and b, float16 h


def test_auto_weight_sync_serves_a_mixed_layout_in_one_push(session):
    # targets A (device 0) and B (device 1) share a process with source ranks 0 and 1; C (device 2) is alone
    realized = _realize(
        RolePlacement(role="actor", replicas=[[0], [1]], colocated_with=["rollout"]),
        RolePlacement(role="rollout", replicas=[[0], [1], [2]], colocated_with=["actor"]),
        num_devices=3,
        mode="partial",
    )
    pool = HostPool(realized)
    try:
        source = WorkerGroup.create(pool, "actor", doubles.WeightsDouble, kwargs={"seed": 0})
        targets = WorkerGroup.create(pool, "rollout", doubles.WeightsDouble, kwargs={"seed": 1})
        sync = WeightSync(source, [targets])  # mode="auto"
        sync.setup()
        assert sync.group_name == "yatt-weights"
        assert sync.push(7) == 3 * WEIGHT_BYTES
        assert (sync.last_local_bytes, sync.last_broadcast_bytes) == (2 * WEIGHT_BYTES, WEIGHT_BYTES)
        src = ray.get(source.broadcast("state"))
        a, b, c = ray.get(targets.broadcast("state"))
        assert [t["version"] for t in (a, b, c)] == [7, 7, 7]
        assert a["digest"] == b["digest"] == c["digest"] == src[0]["digest"] == src[1]["digest"]
        # A was handed source rank 0's own tensors in its process, B source rank 1's; C got a broadcast buffer
        assert a["pid"] == src[0]["pid"] and a["handed"] == src[0]["own"]
        assert b["pid"] == src[1]["pid"] and b["handed"] == src[1]["own"]
        assert c["pid"] not in (src[0]["pid"], src[1]["pid"])
        assert set(c["handed"].values()).isdisjoint({*src[0]["own"].values(), *src[1]["own"].values()})

        # a push left under way (`start`): `settle` waits and returns its bytes; a second `start` settles the
        # first one before it begins and carries its bytes into the next `settle`
        ray.get(source.broadcast("perturb", 0.5))
        sync.start(10)
        assert sync.pending
        sync.start(11)
        assert sync.settle() == 2 * 3 * WEIGHT_BYTES and not sync.pending and sync.settle() == 0
        src = ray.get(source.broadcast("state"))
        a, b, c = ray.get(targets.broadcast("state"))
        assert [t["version"] for t in (a, b, c)] == [11, 11, 11]
        assert a["digest"] == b["digest"] == c["digest"] == src[0]["digest"]
        # a target that fails while the push lands: the failure is raised by the settle, once
        ray.get(
            targets.workers[2].host.call.remote(targets.workers[2].key, "refuse_next_load", ("full",), {})
        )
        sync.start(12)
        with pytest.raises(ValueError, match="full"):
            sync.settle()
        assert not sync.pending and sync.settle() == 0
        assert sync.push(12) == 3 * WEIGHT_BYTES  # the group still serves the next push

        # a move: the targets are now A and C; a fresh broadcast group, then the next version reaches both
        ray.get(source.broadcast("perturb", 1.0))
        sync.retarget([targets.view([0, 2])])
        assert sync.group_name == "yatt-weights-1"
        assert sync.push(8) == 2 * WEIGHT_BYTES
        src = ray.get(source.broadcast("state"))
        a, b, c = ray.get(targets.broadcast("state"))
        assert [t["version"] for t in (a, b, c)] == [8, 12, 8]
        assert a["digest"] == c["digest"] == src[0]["digest"] != b["digest"]
        sync.retarget([targets.view([1])])  # in process only: no broadcast group at all
        assert sync.group_name == "" and sync.push(9) == WEIGHT_BYTES and sync.last_broadcast_bytes == 0
        with pytest.raises(ValueError, match=r"broadcast weight sync: \['rollout-0.0 on device-0'\] share"):
            WeightSync(source, [targets], mode="broadcast").setup()
    finally:
        pool.shutdown()
        realize_mod.release(realized)


@pytest.fixture(scope="module")
def stream_groups(session):
    """Two slow stage-0 replicas (devices 0, 1) and one stage-1 replica on its own device (2)."""
    realized = _realize(
        RolePlacement(role="rollout", replicas=[[0], [1]]),
        RolePlacement(role="reward", replicas=[[2]]),
        RolePlacement(role="reference", replicas=[[3]]),
        num_devices=4,
    )
    pool = HostPool(realized)
    try:
        gen = WorkerGroup.create(pool, "rollout", doubles.SleepyStage)
        judge = WorkerGroup.create(pool, "reward", doubles.SleepyStage)
        failing = WorkerGroup.create(pool, "reference", doubles.SleepyStage, kwargs={"fail_on": 3})
        yield gen, judge, failing
    finally:
        pool.shutdown()
        realize_mod.release(realized)


def _max_concurrency(intervals: list[tuple[float, float]]) -> int:
    events = sorted(
        [(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1])
    )
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


def test_stream_overlaps_stages_and_keeps_item_order(stream_groups):
    gen, judge, _ = stream_groups
    stages = [
        Stage("rollout", lambda item, _: gen.call_one("work", item, None, 0.4)),
        Stage("reward", lambda item, prev: judge.call_one("work", item, prev, 0.1)),
    ]
    items = [10, 11, 12, 13, 14, 15]
    out = run_stream(items, stages, max_inflight=2, fetch=ray.get)
    assert [v[0]["item"] for v in out.values] == items and [v[1]["item"] for v in out.values] == items
    assert [v[1]["previous"] for v in out.values] == [v[0] for v in out.values]  # stage 1 got stage 0's value
    # call_one spread stage 0 over both replicas (least loaded, ties round-robin): 3 items each
    pids = [v[0]["pid"] for v in out.values]
    assert len(set(pids)) == 2 and pids.count(pids[0]) == 3
    # the judge started its first item (host clock) before stage 0's last call finished, and both were busy
    first_judged = min(v[1]["start"] for v in out.values)
    assert first_judged < max(v[0]["end"] for v in out.values)
    assert out.overlap_s("rollout", "reward") > 0
    assert out.first_submit["reward"] < out.last_done["rollout"]
    assert _max_concurrency(out.intervals["rollout"]) == 2  # max_inflight reached, never exceeded
    assert len(out.intervals["rollout"]) == len(out.intervals["reward"]) == 6
    assert out.busy_s("rollout") >= 3 * 0.4  # 6 calls of 0.4 s, 2 at a time


def test_stream_bounds_inflight_and_raises_the_first_error(stream_groups):
    gen, _, failing = stream_groups
    one = run_stream(
        [1, 2, 3],
        [Stage("rollout", lambda item, _: gen.call_one("work", item, None, 0.1))],
        max_inflight=1,
        fetch=ray.get,
    )
    assert _max_concurrency(one.intervals["rollout"]) == 1 and one.busy_s("rollout") >= 0.3
    stages = [
        Stage("rollout", lambda item, _: gen.call_one("work", item, None, 0.05)),
        Stage("check", lambda item, prev: failing.call_one("work", item, prev, 0.0)),
    ]
    with pytest.raises(ValueError, match="bad item 3"):
        run_stream([1, 2, 3, 4], stages, fetch=ray.get)
    with pytest.raises(ValueError, match=r"stage names must be distinct, got \['a', 'a'\]"):
        run_stream([1], [Stage("a", stages[0].call), Stage("a", stages[0].call)], fetch=ray.get)


def _partial_plan(rollout: list[list[int]], judge: list[list[int]]) -> PlacementPlan:
    """4 devices: the learner on 0-1 time-sharing with rollout replicas there; the judge on its own devices."""
    return PlacementPlan(
        mode="partial",
        num_devices=4,
        roles=[
            RolePlacement(role="actor", replicas=[[0], [1]], colocated_with=["rollout"]),
            RolePlacement(role="rollout", replicas=rollout, colocated_with=["actor"]),
            RolePlacement(role="reward", replicas=judge),
        ],
    )


def _move_build(pool: HostPool) -> Services:
    learner = WorkerGroup.create(
        pool, "actor", doubles.WeightsLearner, kwargs={"seed": 0}, pass_worker_info=True
    )
    rollout = WorkerGroup.create(
        pool, "rollout", doubles.VersionedEngine, kwargs={"seed": 1}, pass_worker_info=True
    )
    judge = WorkerGroup.create(
        pool, "reward", doubles.SlowJudge, kwargs={"seconds": 0.3}, pass_worker_info=True
    )
    return Services(
        groups={"actor": learner, "rollout": rollout, "reward": judge},
        learner="actor",
        weight_sync=WeightSync(learner, [rollout]),
    )


# parallel controllers; a live move in single mode: test_replacement's move-and-repair test (and the apps'
# dynamic placement job in both modes)
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["parallel"])
def test_a_live_move_gives_the_next_steps_a_new_rollout_replica_with_current_weights(session, mode):
    start = _partial_plan([[0], [1]], [[2], [3]])
    moved = _partial_plan([[0], [1], [2]], [[3]])  # device 2: judge -> rollout
    realized = realize_mod.realize(start, cpus_per_device=0.5)
    calls: list[tuple[int, dict[str, float]]] = []

    def replan(step: int, busy_s: dict[str, float], step_s: float):
        calls.append((step, busy_s))
        return moved if step == 0 else None

    num_steps = 5
    job = Job(
        build=_move_build,
        step_fn=doubles.move_step,
        dataset=_rows,
        batch_size=8,
        num_steps=num_steps,
        replan=replan,
    )
    try:
        spec = ControllerSpec(
            mode=mode, num_controllers=2 if mode == "parallel" else 1, heartbeat_interval_s=0.25
        )
        result = run(spec, job, realized)
    finally:
        realize_mod.release(realized)
    assert len(result.moves) == 1
    ((applied, plan),) = result.moves
    assert plan == moved and 1 <= applied < num_steps  # posted after step 0, applied at a later step start
    assert sorted(result.reports) == list(range(num_steps)) and result.restarts == 0  # no step lost
    for step, (r0, *others) in result.reports.items():
        after = step >= applied
        assert r0.metrics["num_samples"] == 8
        assert r0.metrics["rollout_devices"] == (3 if after else 2)
        assert r0.metrics["judge_devices"] == (1 if after else 2)
        # every sample of step s was made by version s (pushed at launch and after every step), the moved
        # replica included: it got the current weights when it started
        assert r0.metrics["min_version"] == r0.metrics["max_version"] == step
        assert r0.metrics["placement/moves"] == (1 if after else 0)
        assert all("placement/moves" not in r.metrics for r in others)  # rank 0 reports it
    # the hook saw per-role busy seconds: 2 judge calls of 0.3 s in step 0 (one per controller or per replica)
    assert [step for step, _ in calls] == list(range(num_steps))
    assert calls[0][1]["reward"] >= 0.6 and calls[0][1]["rollout"] > 0 and calls[0][1]["actor"] > 0
