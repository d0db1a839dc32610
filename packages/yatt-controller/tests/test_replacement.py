"""Replacing replicas (roster.py, replace.py, replicas.py): the roster's one rule of what may be replaced,
its book's grants, views adopting a new version in place, and, with real Ray hosts, one `replace_replicas`
serving a live move and the repair of a dead replica; a rollout replica whose process dies mid-call in a
disaggregated layout: the call is sent again to its replacement and the run ends without a restart, with the
reports of an uninterrupted run."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yatt_controller_doubles as doubles  # loaded by conftest.py
from yatt_controller.roster import Change, Roster, RosterBook
from yatt_controller.worker_group import Worker, WorkerGroup


class _Handle:
    """A host handle double: only its actor id is read."""

    def __init__(self, hexid: str) -> None:
        self._actor_id = SimpleNamespace(hex=lambda: hexid)


def _worker(host: str, dp: int, tp: int = 0, view_dp: int | None = None, device: int | None = None) -> Worker:
    return Worker(
        _Handle(host),
        "rollout",
        dp if view_dp is None else view_dp,
        tp,
        dp if device is None else device,
        f"w{dp}.{tp}",
        dp,
    )


def _group(role: str, *hosts: str, name: str = "") -> WorkerGroup:
    return WorkerGroup(role, name, [_worker(h, dp, device=10 * len(role) + dp) for dp, h in enumerate(hosts)])


def _roster() -> Roster:
    groups = {
        "actor": _group("actor", "a0", "a1"),
        "critic": _group("critic", "c0"),
        "rollout": _group("rollout", "r0", "a1"),  # its replica 1 shares learner rank 1's process
        "judge": _group("reward", "j0", name="judge"),
    }
    return Roster(groups, learner="actor", checkpointed=("critic",))


def test_the_roster_alone_decides_which_groups_may_be_replaced():
    from yatt_controller.replace import changed_roles, replace_replicas

    roster = _roster()
    assert [name for name in roster.groups if roster.replaceable(name)] == ["rollout", "judge"]
    assert [roster.fixed_because(n) for n in roster.groups] == ["the learner", "checkpointed", None, None]
    assert not roster.replaceable("nonexistent")
    # a host holding any worker of a fixed group is fixed, whoever else it hosts (rollout replica 1)
    assert roster.fixed_hosts() == {"a0", "a1", "c0"}
    assert roster.on_host("a1") == ["actor", "rollout"] and roster.on_host("j0") == ["judge"]
    # the one operation refuses them before touching any process
    for name, why in (("actor", "the learner"), ("critic", "checkpointed")):
        with pytest.raises(ValueError, match=f"replace_replicas: group '{name}' is {why}; never replaced"):
            replace_replicas(
                None,
                roster,
                {name: [[0]]},
                cause="move",
                step=0,
                learner=None,  # type: ignore[arg-type]
                weight_sync=None,
                version=0,
            )
    # and so does the re-planner's check, with the roster's reason
    plan = SimpleNamespace(
        num_devices=100,
        roles=[
            SimpleNamespace(role=g.role, name=g.name, replicas=g.replicas()) for g in roster.groups.values()
        ],
    )
    moved = SimpleNamespace(
        num_devices=100,
        roles=[*plan.roles[:1], SimpleNamespace(role="critic", name="", replicas=[[3]]), *plan.roles[2:]],
    )
    with pytest.raises(ValueError, match="replan: role 'critic' cannot move: it is checkpointed"):
        changed_roles(plan, moved, roster)
    learner_only = Roster({"actor": roster.groups["actor"]}, learner="actor")
    assert [n for n in learner_only.groups if learner_only.replaceable(n)] == []


def test_roster_book_grants_one_replacement_at_a_time_and_counts_history():
    roster = _roster()
    book = RosterBook(roster)
    assert book.claim("j0") == ("mine", roster)
    assert book.claim("j0") == ("wait", None)  # another controller asks while the repair runs
    assert book.claim("move") == ("wait", None)  # one replacement at a time, moves included
    repaired = roster.after(Change(1, 3, "repair", ("judge",), 1, dead="j0"), {}, [])
    book.finish(repaired)
    assert book.claim("j0") == ("done", repaired)  # the others adopt its result
    assert book.newer(0) is repaired and book.newer(1) is None
    assert book.claim("move") == ("mine", repaired)
    book.abandon("move")  # the replacing controller failed: the next asker may try
    moved = repaired.after(Change(2, 4, "move", ("rollout",), 2, plan="P"), {}, [])
    book.finish(moved)
    assert (moved.version, moved.moves, moved.replicas_replaced) == (2, [(4, "P")], 1)
    assert [c.cause for c in moved.history] == ["repair", "move"] and roster.version == 0  # never edited
    with pytest.raises(AssertionError, match="a roster version follows the one it replaces"):
        roster.after(Change(2, 0, "move", (), 0), {}, [])


def test_the_attempt_book_is_also_the_controllers_rendezvous():
    """One actor per attempt: the roster book's calls and the controllers' all-gathers are served by the same
    object (on Ray's event loop). Every rank gets all values in rank order; a rank that never arrives fails
    the others' exchange naming it, and the book still answers after."""
    import asyncio

    from yatt_controller.roster import AttemptBook

    roster = _roster()
    book = AttemptBook(roster, 3)

    async def three() -> list:
        return await asyncio.gather(*(book.exchange(7, r, f"v{r}", 5.0) for r in (2, 0, 1)))

    assert asyncio.run(three()) == [["v0", "v1", "v2"]] * 3
    assert book._values == {} and book._done == {}  # the last reader cleaned the key up

    async def two_of_three() -> list:
        return await asyncio.gather(*(book.exchange(8, r, r, 0.2) for r in (0, 2)), return_exceptions=True)

    errors = asyncio.run(two_of_three())
    assert [str(e) for e in errors] == ["collective 8: ranks [1] did not arrive within 0.2 s"] * 2
    assert book.claim("j0") == ("mine", roster) and book.newer(0) is None


def test_a_view_adopts_a_new_version_in_place_keeping_its_ranks_and_window():
    from yatt_controller.replicas import Replacements, controller_routes

    # a controller routed to group ranks 2 and 3 of a 4-replica rollout group (renumbered 0 and 1)
    whole = WorkerGroup("rollout", "", [_worker(f"h{dp}", dp) for dp in range(4)])
    roster = Roster({"actor": _group("actor", "a0", "a1"), "rollout": whole}, learner="actor")
    route = controller_routes("actor", 1, 2, 8, False)
    views = {"rollout": route(roster.groups)["rollout"]}
    view = views["rollout"]
    window = view.workers[1].window
    keeper = Replacements(None, roster, SimpleNamespace(hosts={}), views, None, route)  # type: ignore[arg-type]
    fresh = WorkerGroup("rollout", "", [*whole.workers[:3], _worker("new", 3)])
    keeper._use(roster.after(Change(1, 0, "repair", ("rollout",), 1, dead="h3"), {"rollout": fresh}, []))
    assert [w.host._actor_id.hex() for w in view.workers] == ["h2", "new"]  # the same view object
    assert [(w.dp_rank, w.group_dp_rank) for w in view.workers] == [(0, 2), (1, 3)]
    assert view.workers[1].window is window  # the view's own in-flight window
    assert keeper.roster.version == 1


@pytest.fixture(scope="module")
def disaggregated():
    """Learner ranks on devices 0 and 2, one rollout replica on device 1 (no process shared with a learner):
    in parallel mode both controllers call the one replica, so both see its death."""
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
    doubles.end_module()


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
    whole = run(spec, _job({}), disaggregated)  # first: its hosts are kept for the faulty run
    faulty = run(spec, _job(crashing), disaggregated)
    assert Path(crashing["marker"]).exists()
    assert faulty.restarts == 0 and faulty.failures == []  # on_failure="fail": any failure would raise
    assert faulty.replicas_replaced == 1  # once, though every controller saw the death
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


class DyingEngine(doubles.VersionedEngine):
    """Test double: a VersionedEngine whose samples carry its process id; its process dies (os._exit) in its
    second `generate` when it sits on device `crash_device`, once per test (a marker file)."""

    def __init__(self, seed: int = 1, worker_info=None, crash_device: int = -1, marker: str = "") -> None:
        super().__init__(seed, worker_info)
        self.crash_device, self.marker, self.calls = crash_device, marker, 0

    def generate(self, prompts: list[int]) -> list[dict]:
        self.calls += 1
        if self.info.device == self.crash_device and self.calls == 2 and doubles._fire_once(self.marker):
            os._exit(1)  # a real crash of this replica's process, with the step's calls in flight
        return [{**s, "pid": os.getpid()} for s in super().generate(prompts)]


def replace_step(ctx, batch: list[int]) -> dict[str, float]:
    """Retryable rollout calls, only current-version samples, a train, and the next version pushed."""
    rollout = ctx.services["rollout"]
    parts = ctx.get([rollout.call_one("generate", batch[i::CHUNKS]) for i in range(CHUNKS)])
    samples = [s for part in parts for s in part]
    ctx.check_versions([s["version"] for s in samples])
    ctx.get(ctx.own_learner.shard_rows("train", {"prompt": [s["prompt"] for s in samples]}))
    ctx.sync_weights()
    moved = [s for s in samples if s["device"] == 2]
    return {
        "num_samples": float(len(samples)),
        "version": float(samples[0]["version"]),
        "device2_samples": float(len(moved)),
        "device2_pid": float(moved[0]["pid"]) if moved else 0.0,
    }


def test_a_live_move_and_a_repair_are_one_replacement_operation(disaggregated, tmp_path, monkeypatch):
    """Single mode (the controller runs in this process, so a spy sees its calls): the re-planner moves a
    second rollout replica onto device 2; that replica's process then dies mid-call and is repaired. Both go
    through `replace_replicas` (roster versions 1 and 2), and the pushes after both reach the new replicas:
    every sample of step s was made by version s."""
    import yatt_controller.replicas as replicas_mod
    import yatt_placement.realize as realize_mod
    from yatt_controller.runner import Job, Services, run
    from yatt_controller.sync import WeightSync
    from yatt_controller.types import ControllerSpec
    from yatt_placement.types import PlacementPlan, RolePlacement

    real, calls = replicas_mod.replace_replicas, []

    def spy(pool, roster, wanted, **kw):
        new = real(pool, roster, wanted, **kw)
        calls.append(
            (kw["cause"], roster.version, new.version, kw["step"], {n: r for n, r in wanted.items()})
        )
        calls[-1] += ({s.device: s.host for s in new.seats() if s.group == "rollout"},)
        return new

    monkeypatch.setattr(replicas_mod, "replace_replicas", spy)

    def plan(rollout: list[list[int]]) -> PlacementPlan:
        roles = [RolePlacement(role="actor", replicas=[[0]]), RolePlacement(role="rollout", replicas=rollout)]
        return PlacementPlan(mode="disaggregated", num_devices=3, roles=roles)

    moved = plan([[1], [2]])
    marker = str(tmp_path / "crashed")

    def build(pool):
        learner = WorkerGroup.create(pool, "actor", doubles.WeightsLearner, pass_worker_info=True)
        rollout = WorkerGroup.create(
            pool, "rollout", DyingEngine, kwargs={"crash_device": 2, "marker": marker}, pass_worker_info=True
        )
        return Services({"actor": learner, "rollout": rollout}, "actor", WeightSync(learner, [rollout]))

    num_steps = 8
    job = Job(
        build=build,
        step_fn=replace_step,
        dataset=lambda: list(range(64)),
        batch_size=8,
        num_steps=num_steps,
        replan=lambda step, busy, step_s: moved if step == 0 else None,
    )
    realized = realize_mod.realize(plan([[1]]), cpus_per_device=0.5)
    spec = ControllerSpec(mode="single", heartbeat_interval_s=0.25, hang_timeout_s=60.0, on_failure="fail")
    try:
        result = run(spec, job, realized)
    finally:
        realize_mod.release(realized)
    assert Path(marker).exists()
    assert [(c[0], c[1], c[2]) for c in calls] == [("move", 0, 1), ("repair", 1, 2)]
    (_, _, _, move_step, move_wanted, after_move), (_, _, _, repair_step, repair_wanted, after_repair) = calls
    assert move_wanted == {"rollout": [[1], [2]]} and repair_wanted == {"rollout": [[1], [2]]}
    assert after_repair[1] == after_move[1] and after_repair[2] != after_move[2]  # device 2: a new process
    assert result.moves == [(move_step, moved)] and result.replicas_replaced == 1
    assert result.restarts == 0 and 1 <= move_step <= repair_step < num_steps - 1
    metrics = [result.reports[s][0].metrics for s in range(num_steps)]
    assert [m["num_samples"] for m in metrics] == [8.0] * num_steps  # calls in flight were sent again
    assert [m["version"] for m in metrics] == [float(s) for s in range(num_steps)]  # pushes reached all
    assert [m["faults/replicas_replaced"] for m in metrics] == [
        float(s >= repair_step) for s in range(num_steps)
    ]
    assert [m["placement/moves"] for m in metrics] == [float(s >= move_step) for s in range(num_steps)]
    late = [m for s, m in enumerate(metrics) if s > repair_step]
    assert all(m["device2_samples"] > 0 for m in late)  # the repaired replica serves the steps after
    assert len({m["device2_pid"] for m in late}) == 1
    assert all(
        m["device2_pid"] != metrics[s]["device2_pid"] for s in range(move_step, repair_step) for m in late
    )
