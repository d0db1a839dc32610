"""The Ray runtime with test doubles: worker groups, dispatch, parallel vs single controllers, driver bytes,
checkpoint resume after a crash, and health (a killed worker, a hang). One Ray session for the module."""

from __future__ import annotations

import dataclasses
import os
import re
import sys

import msgspec
import pytest
import ray
import yatt_controller_doubles as doubles  # loaded by conftest.py
import yatt_placement.realize as realize_mod
from yatt_controller.runner import ControllerFailure, Job, Services, run
from yatt_controller.types import ControllerSpec
from yatt_controller.worker_group import HostPool, WorkerGroup
from yatt_placement.types import PlacementPlan, RolePlacement

MEDIA = 4096  # bytes of media per sample
ROWS = 64


@pytest.fixture(scope="module")
def cluster():
    doubles.start_ray(sys.modules[__name__])
    plan = PlacementPlan(
        mode="colocated",
        num_devices=2,
        roles=[
            RolePlacement(role="actor", replicas=[[0], [1]], colocated_with=["rollout", "critic"]),
            RolePlacement(role="rollout", replicas=[[0], [1]], colocated_with=["actor", "critic"]),
            RolePlacement(role="critic", replicas=[[0], [1]], colocated_with=["actor", "rollout"]),
        ],
    )
    realized = realize_mod.realize(plan, cpus_per_device=1.0)
    yield realized
    realize_mod.release(realized)
    doubles.end_module()


def _rows() -> list[int]:
    return list(range(ROWS))


def _build(engine_kwargs: dict | None = None, learner_kwargs: dict | None = None, learner_cls=None):
    def build(pool: HostPool) -> Services:
        cls = learner_cls or doubles.CountingLearner
        learner = WorkerGroup.create(pool, "actor", cls, kwargs=learner_kwargs or {}, pass_worker_info=True)
        rollout = WorkerGroup.create(
            pool, "rollout", doubles.ScriptedEngine, kwargs={"media_bytes": MEDIA, **(engine_kwargs or {})}
        )
        return Services(groups={"actor": learner, "rollout": rollout}, learner="actor")

    return build


def _job(tmp_path=None, num_steps=3, **build_kwargs) -> Job:
    return Job(
        build=_build(**build_kwargs),
        step_fn=doubles.media_step,
        dataset=_rows,
        batch_size=8,
        num_steps=num_steps,
        checkpoint_dir=None if tmp_path is None else str(tmp_path / "ckpt"),
    )


def test_worker_group_dispatch_and_colocation(cluster):
    pool = HostPool(cluster)
    try:
        learner = WorkerGroup.create(pool, "actor", doubles.CountingLearner, pass_worker_info=True)
        rollout = WorkerGroup.create(
            pool, "rollout", doubles.ScriptedEngine, kwargs={"media_bytes": 1}, max_inflight=2
        )
        # roles the plan colocates share a process: one host per device
        assert ray.get(learner.broadcast("getpid")) == ray.get(rollout.broadcast("getpid"))
        assert len(set(ray.get(learner.broadcast("getpid")))) == 2
        # every host process starts with one malloc arena (HOST_ENV: calls hop threads)
        assert ray.get(learner.broadcast("malloc_env")) == [{"MALLOC_ARENA_MAX": "1"}] * 2
        assert ray.get(learner.broadcast("rank")) == [(0, 2), (1, 2)]
        # scatter: 5 prompts over 2 replicas -> [0, 1, 2] and [3, 4]; gather keeps both dp ranks in order
        outs = ray.get(rollout.gather(rollout.scatter("generate", [0, 1, 2, 3, 4])))
        assert [[s["prompt"] for s in chunk] for chunk in outs] == [[0, 1, 2], [3, 4]]
        assert ray.get(rollout.rank_zero("getpid")) == ray.get(learner.broadcast("getpid"))[0]
        # a view renumbers: dp rank 1 alone becomes rank 0 of a one-replica group
        assert ray.get(learner.view([1]).broadcast("rank")) == [(1, 2)]
        # bounded in flight: 6 calls of 0.2 s each through a window of 2 wait 4 times (6 - 2)
        view = rollout.view([0])
        for _ in range(6):
            view.broadcast("hold", 0.2)
        assert view.workers[0].window.waits == 4
        assert view.workers[0].window.num_pending <= 2
        with pytest.raises(ValueError, match="unknown dispatch mode 'shuffle'"):
            rollout.dispatch("shuffle", "generate", [1])
        with pytest.raises(ValueError, match="role 'reference' \\(name ''\\) is not in the placement plan"):
            WorkerGroup.create(pool, "reference", doubles.CountingLearner)
    finally:
        pool.shutdown()


def test_hosts_inherit_their_environment_from_a_local_ray_and_else_get_it_by_runtime_env(cluster):
    """The module's Ray was started inside `host_env_inherited` (doubles.start_ray): its workers inherit
    HOST_ENV and hosts are made without a runtime_env (no setup_worker step; the hosts' own environment is
    checked in test_worker_group_dispatch_and_colocation). Without that record (a cluster started elsewhere) a
    pool makes its hosts with HOST_ENV as runtime_env. The driver's own environment is as before."""
    from ray.experimental import internal_kv
    from yatt_controller import worker_group

    before = os.environ.get("MALLOC_ARENA_MAX")
    with worker_group.host_env_inherited():  # what a start sees: the variables its raylet inherits
        assert os.environ.get("MALLOC_ARENA_MAX") == ("1" if before in (None, "1") else before)
    assert os.environ.get("MALLOC_ARENA_MAX") == before  # the driver's own environment as before
    assert worker_group._host_runtime_env() is None
    recorded = internal_kv._internal_kv_get(worker_group._HOST_ENV_KEY)
    internal_kv._internal_kv_del(worker_group._HOST_ENV_KEY)
    try:
        assert worker_group._host_runtime_env() == {"env_vars": worker_group.HOST_ENV}
        assert HostPool(cluster)._runtime_env == {"env_vars": worker_group.HOST_ENV}
    finally:
        internal_kv._internal_kv_put(worker_group._HOST_ENV_KEY, recorded)
    assert worker_group._host_runtime_env() is None


def test_parallel_carries_no_samples_through_the_driver(cluster):
    seen: list[tuple[int, list[int]]] = []  # on_step: once per step, with every controller's report
    job = dataclasses.replace(
        _job(), on_step=lambda step, reports: seen.append((step, [r.controller_rank for r in reports]))
    )
    parallel = run(
        ControllerSpec(num_controllers=2, heartbeat_interval_s=0.5, count_driver_bytes=True), job, cluster
    )
    assert seen == [(0, [0, 1]), (1, [0, 1]), (2, [0, 1])]
    single = run(
        ControllerSpec(mode="single", heartbeat_interval_s=0.5, count_driver_bytes=True), _job(), cluster
    )
    assert parallel.restarts == 0 and single.restarts == 0
    # single mode fetches every sample's media and sends it again to the learners: 2 x 8 x 4096 x 3 steps,
    # plus prompts, small fields, the learners' totals, host pings and launch arguments (each well under 1 kB)
    media = 2 * 8 * MEDIA * 3
    assert media <= single.driver_bytes <= media + 128 * 1024
    # reports, heartbeats and launch arguments only (heartbeats grow with wall time: ~0.5 kB a poll)
    assert 0 < parallel.driver_bytes < media
    assert sorted(parallel.reports) == sorted(single.reports) == [0, 1, 2]
    for step in range(3):
        p, s = parallel.reports[step], single.reports[step]
        assert [r.controller_rank for r in p] == [0, 1]
        assert p[0].metrics["num_samples"] == s[0].metrics["num_samples"] == 8
        assert p[0].num_samples == 4 and s[0].num_samples == 8
        # both learner ranks saw the same halves of the same global batch in both modes
        assert p[0].metrics["learner_total"] == s[0].metrics["learner_total"]
        assert set(p[0].timings_s) == {"rollout", "train", "step"}
    assert parallel.report_bytes > 0


def test_driver_bytes_count_what_a_driver_side_step_fetches(cluster):
    # single mode runs the step in the driver: its fetch of a 10 MiB array is counted, twice (the driver is no
    # host process, so the fetch goes through Ray; a parallel controller's fetch from the rollout role beside
    # it runs in process, which is why the step fetches with `local_calls.get`, not a plain `ray.get`)
    job = dataclasses.replace(_job(num_steps=2), step_fn=doubles.blob_step)
    single = run(
        ControllerSpec(mode="single", heartbeat_interval_s=0.5, count_driver_bytes=True), job, cluster
    )
    assert [r[0].metrics["blob_bytes"] for r in single.reports.values()] == [doubles.BLOB_BYTES] * 2
    assert 2 * doubles.BLOB_BYTES <= single.driver_bytes <= 2 * doubles.BLOB_BYTES + 128 * 1024
    # parallel: each controller fetches it in its own process; the driver sees reports only
    parallel = run(
        ControllerSpec(num_controllers=2, heartbeat_interval_s=0.5, count_driver_bytes=True), job, cluster
    )
    assert 0 < parallel.driver_bytes < 200 * 1024


def test_driver_bytes_in_parallel_mode_are_report_sized(cluster):
    # 8 samples x 256 KiB of media a step move controller -> engine -> controller -> learner, 3 steps: 12 MiB
    job = _job(num_steps=3, engine_kwargs={"media_bytes": 2**18})
    result = run(
        ControllerSpec(num_controllers=2, heartbeat_interval_s=0.5, count_driver_bytes=True), job, cluster
    )
    assert result.reports[2][0].metrics["learner_total"] > 8 * 2**18 * 3  # the media did reach the learners
    assert 0 < result.driver_bytes < 200 * 1024
    assert result.driver_bytes > result.report_bytes / 4  # the report bytes are among what was counted


def test_driver_byte_counter_restores_ray_even_on_error(cluster):
    import ray.actor
    from yatt_controller.ledger import count_driver_ray_bytes

    before = (ray.get, ray.put, ray.actor.ActorMethod._remote)
    with pytest.raises(RuntimeError, match="boom"), count_driver_ray_bytes() as ledger:
        ref = ray.put(b"x" * 1000)
        assert ray.get(ref) == b"x" * 1000
        raise RuntimeError("boom")
    assert (ray.get, ray.put, ray.actor.ActorMethod._remote) == before
    assert (ledger.sent, ledger.received) == (1000, 1000)


@pytest.mark.slow
def test_crash_mid_checkpoint_resumes_with_identical_batches(cluster, tmp_path):
    spec = ControllerSpec(num_controllers=2, heartbeat_interval_s=0.5, checkpoint_every=2, keep_checkpoints=2)
    baseline = run(spec, _job(tmp_path / "a", num_steps=6), cluster)
    assert baseline.driver_bytes is None  # counting is opt-in (ControllerSpec.count_driver_bytes)
    # learner rank processes die inside their 2nd checkpoint write (after step 3); steps 2-3 rerun from step 1
    learner_kwargs = {"crash_in_checkpoint": 2, "marker": str(tmp_path / "fired")}
    logged: dict[int, list] = {}  # what the driver logs, per step (a step the restart reruns: again)
    job = _job(tmp_path / "b", num_steps=6, learner_kwargs=learner_kwargs)
    job = dataclasses.replace(job, on_step=lambda step, reports: logged.setdefault(step, []).append(reports))
    crashed = run(spec, job, cluster)
    assert crashed.restarts == 1
    assert "dead actors: device-" in crashed.failures[0] and "actor-" in crashed.failures[0]
    # a controller lives in its learner rank's process and dies with it: the reports a heartbeat had not
    # carried out yet come back from the checkpoint the restart resumes from; every step is logged with all
    # ranks' reports, the last time as in the straight run
    assert sorted(logged) == list(range(6))
    for step in range(6):
        assert [r.metrics for r in logged[step][-1]] == [r.metrics for r in baseline.reports[step]]
    # keep_checkpoints=2: steps 3 and 5 remain, no staging directory is left
    assert sorted(p.name for p in (tmp_path / "b" / "ckpt").iterdir()) == ["step-00000003", "step-00000005"]


def test_hosted_controllers_run_beside_their_learner_and_match_own_processes(cluster):
    """Each parallel controller lives in its learner rank's host process (no process of its own) and gives
    the reports, bit for bit, that controllers in processes of their own give (`hosted=False`)."""
    spec = ControllerSpec(num_controllers=2, heartbeat_interval_s=0.5)
    step = {"step_fn": doubles.pid_step}
    hosted = run(spec, dataclasses.replace(_job(num_steps=2), **step), cluster)
    own = run(
        msgspec.structs.replace(spec, hosted=False), dataclasses.replace(_job(num_steps=2), **step), cluster
    )
    assert [r.metrics["in_learner_process"] for r in hosted.reports[1]] == [2.0, 2.0]  # both controllers
    assert [r.metrics["in_learner_process"] for r in own.reports[1]] == [0.0, 0.0]
    # a hosted controller's calls to the roles beside it run in process (`local_calls`), the others via Ray
    assert [r.metrics["called_in_process"] for r in hosted.reports[1]] == [2.0, 2.0]
    assert [r.metrics["called_in_process"] for r in own.reports[1]] == [0.0, 0.0]
    where = {"in_learner_process", "called_in_process"}
    for s in (0, 1):
        a = [{k: v for k, v in r.metrics.items() if k not in where} for r in hosted.reports[s]]
        b = [{k: v for k, v in r.metrics.items() if k not in where} for r in own.reports[s]]
        assert a == b


def test_get_and_wait_take_object_refs_and_calls_in_process_together(cluster):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from yatt_controller import local_calls

    with ThreadPoolExecutor(2) as threads:
        gate = threading.Event()
        local, remote = local_calls.LocalRef(threads.submit(gate.wait, 5), "gate"), ray.put("stored")
        assert local_calls.wait([local, remote], num_returns=1) == ([remote], [local])
        assert local_calls.wait([local, remote], num_returns=2, timeout=0.05) == ([remote], [local])
        gate.set()
        assert local_calls.get([local, remote]) == [True, "stored"]
        assert local_calls.wait([local, remote], num_returns=2) == ([local, remote], [])


def test_a_finished_run_keeps_its_hosts_for_the_next_run_on_the_same_bundles(cluster):
    """`keep_hosts`: the run that finishes parks its host processes, emptied (no hosted object, busy times from
    zero); the next run on the same bundles takes them (same pids) and reports exactly what a run in fresh
    hosts reports. A run that fails, or whose hosts hold process-wide state a reset cannot undo, parks none."""
    from yatt_controller import warm

    def parked_pids() -> list[int]:
        kept = warm.cache().warm
        handles = [] if kept is None else [handle for _, _, handle in kept.hosts.values()]
        pids = ray.get([h.create.remote("probe", doubles.CountingLearner, (), {}) for h in handles])
        ray.get([h.destroy.remote("probe") for h in handles])
        return pids

    warm.drop()  # hosts an earlier test of this module parked (the suite keeps hosts: conftest.py)
    spec = ControllerSpec(num_controllers=2, heartbeat_interval_s=0.5)
    job = dataclasses.replace(_job(num_steps=2), step_fn=doubles.pid_step)
    fresh = run(spec, job, cluster, keep_hosts=False)
    assert parked_pids() == []
    before = dataclasses.replace(warm.cache())
    first = run(spec, job, cluster, keep_hosts=True)
    pids = parked_pids()
    assert len(set(pids)) == 2 and warm.cache().parked == before.parked + 2
    kept = warm.cache().warm
    assert kept is not None and kept.bundles == (2, 1.0)
    beats = ray.get([handle.ping.remote() for _, _, handle in kept.hosts.values()])
    assert [beat.busy_s for beat in beats] == [{}, {}]  # nothing hosted, nothing counted
    book = warm.cache().book
    assert book is not None  # the finished attempt's book is kept too
    second = run(spec, job, cluster, keep_hosts=True)
    assert warm.cache().reused == before.reused + 2 and parked_pids() == pids
    assert warm.cache().books_reused == before.books_reused + 1 and warm.cache().book == book
    for step in (0, 1):
        assert [r.metrics for r in first.reports[step]] == [r.metrics for r in fresh.reports[step]]
        assert [r.metrics for r in second.reports[step]] == [r.metrics for r in fresh.reports[step]]
    # a failed run takes the parked hosts and kills them with its others
    failing = dataclasses.replace(_job(num_steps=3), step_fn=doubles.failing_step)
    with pytest.raises(ControllerFailure, match="bad reward"):
        run(ControllerSpec(mode="single", heartbeat_interval_s=0.5), failing, cluster, keep_hosts=True)
    assert parked_pids() == [] and warm.cache().book is None
    # hosts whose process a reset cannot clean are killed, not parked
    run(spec, _job(num_steps=1, learner_cls=doubles.ProcessWideLearner), cluster, keep_hosts=True)
    assert parked_pids() == []


def _colocated(num_devices: int) -> PlacementPlan:
    replicas = [[d] for d in range(num_devices)]
    return PlacementPlan(
        mode="colocated",
        num_devices=num_devices,
        roles=[
            RolePlacement(role="actor", replicas=replicas, colocated_with=["rollout"]),
            RolePlacement(role="rollout", replicas=replicas, colocated_with=["actor"]),
        ],
    )


def test_a_warm_group_serves_smaller_plans_and_a_bigger_plan_replaces_it(cluster):
    """The warm placement group takes any plan it fits (no more devices, same CPUs per device): a 1-device job
    after a 2-device one runs in the same group on the parked host of bundle 0 (same pid, same reports as that
    job in a fresh group), and bundle 1's parked host waits for the next job; a 3-device plan drops them all
    and reserves a group of its own."""
    from yatt_controller import warm

    def parked() -> dict[int, int]:
        kept = warm.cache().warm
        hosts = {} if kept is None else {device: handle for device, (_, _, handle) in kept.hosts.items()}
        pids = ray.get([h.create.remote("probe", doubles.CountingLearner, (), {}) for h in hosts.values()])
        ray.get([h.destroy.remote("probe") for h in hosts.values()])
        return dict(zip(hosts, pids, strict=True))

    warm.drop()
    job = dataclasses.replace(_job(num_steps=2), step_fn=doubles.pid_step)
    one, single = _colocated(1), ControllerSpec(num_controllers=1, heartbeat_interval_s=0.5)
    fresh_group = realize_mod.realize(one, cpus_per_device=1.0)
    try:
        fresh = run(single, job, fresh_group, keep_hosts=False)
    finally:
        realize_mod.release(fresh_group)

    two = warm.realize(_colocated(2), cpus_per_device=1.0)
    run(ControllerSpec(num_controllers=2, heartbeat_interval_s=0.5), job, two, keep_hosts=True)
    warm.release(two)
    pids = parked()
    assert sorted(pids) == [0, 1] and len(set(pids.values())) == 2

    reused = warm.cache().reused
    small = warm.realize(one, cpus_per_device=1.0)
    assert small.placement_group.id == two.placement_group.id and small.plan.num_devices == 1
    again = run(single, job, small, keep_hosts=True)
    warm.release(small)
    assert warm.cache().reused == reused + 1 and parked() == pids  # bundle 0's host ran it, bundle 1's waited
    for step in (0, 1):
        assert [r.metrics for r in again.reports[step]] == [r.metrics for r in fresh.reports[step]]

    bigger = warm.realize(_colocated(3), cpus_per_device=1.0)
    assert bigger.placement_group.id != two.placement_group.id
    assert parked() == {} and ray.util.placement_group_table(two.placement_group)["state"] == "REMOVED"
    realize_mod.release(bigger)


@pytest.mark.slow
def test_resume_takes_the_newest_complete_checkpoint(cluster, tmp_path):
    spec = ControllerSpec(num_controllers=2, heartbeat_interval_s=0.5, checkpoint_every=1, keep_checkpoints=3)
    whole = run(spec, _job(tmp_path / "a", num_steps=5), cluster)
    first = run(spec, _job(tmp_path / "b", num_steps=3), cluster)
    # a crashed half-written checkpoint after step 3: staging only, never loaded
    (tmp_path / "b" / "ckpt" / ".staging-step-00000003").mkdir()
    (tmp_path / "b" / "ckpt" / ".staging-step-00000003" / "controller-0.msgpack").write_bytes(b"partial")
    rest = run(spec, _job(tmp_path / "b", num_steps=5), cluster)
    assert sorted(first.reports) == [0, 1, 2] and sorted(rest.reports) == [3, 4]
    for step in (3, 4):
        assert [r.metrics for r in rest.reports[step]] == [r.metrics for r in whole.reports[step]]


@pytest.mark.slow
def test_sharded_background_checkpoints_commit_after_the_write_and_resume(cluster, tmp_path):
    """A learner with the sharded protocol writes its own files (learner/total-R.bin) in the background; each
    checkpoint commits once written, the last before the run returns, and a resume loads them."""
    from yatt_controller import checkpoint

    spec = ControllerSpec(num_controllers=2, heartbeat_interval_s=0.5, checkpoint_every=2, keep_checkpoints=3)
    sharded = {"learner_cls": doubles.ShardedCountingLearner, "learner_kwargs": {"write_s": 0.3}}
    whole = run(spec, _job(tmp_path / "a", num_steps=5), cluster)
    first = run(spec, _job(tmp_path / "b", num_steps=3, **sharded), cluster)
    root = tmp_path / "b" / "ckpt"
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000002"]
    manifest = checkpoint.verify(root / "step-00000002")
    assert sorted(manifest.files) == [
        "controller-0.msgpack",
        "controller-1.msgpack",
        "learner/total-0.bin",
        "learner/total-1.bin",
    ]
    rest = run(spec, _job(tmp_path / "b", num_steps=5, **sharded), cluster)
    assert sorted(first.reports) == [0, 1, 2] and sorted(rest.reports) == [3, 4]
    for step in (3, 4):  # the learners' totals were restored from their shard files
        assert [r.metrics for r in rest.reports[step]] == [r.metrics for r in whole.reports[step]]
    sync = msgspec.structs.replace(spec, checkpoint_async=False)
    run(sync, _job(tmp_path / "c", num_steps=2, **sharded), cluster)
    assert (
        sorted(checkpoint.verify(tmp_path / "c" / "ckpt" / "step-00000001").files)[-1]
        == "learner/total-1.bin"
    )


@pytest.mark.slow
def test_resume_with_another_number_of_controllers_draws_the_same_rows(cluster, tmp_path):
    """Saved by 2 parallel controllers, resumed by 1 (driving both learner ranks): the global data cursor gives
    the same rows at steps 3 and 4 as the straight 2-controller run, so the learners' totals agree. A worker
    with one bytes file per controller's rank cannot re-split: refused, naming the count to use."""
    two = ControllerSpec(num_controllers=2, heartbeat_interval_s=0.5, checkpoint_every=1)
    one = msgspec.structs.replace(two, num_controllers=1)
    sharded = {"learner_cls": doubles.ShardedCountingLearner}
    whole = run(two, _job(tmp_path / "a", num_steps=5), cluster)
    run(two, _job(tmp_path / "b", num_steps=3, **sharded), cluster)
    rest = run(one, _job(tmp_path / "b", num_steps=5, **sharded), cluster)
    assert sorted(rest.reports) == [3, 4] and rest.restarts == 0
    for step in (3, 4):
        (got,), want = rest.reports[step], whole.reports[step][0]
        for key in ("num_samples", "learner_total"):
            assert got.metrics[key] == want.metrics[key], (step, key)
    with pytest.raises(ControllerFailure, match=re.escape("resume with controller.num_controllers=2")):
        run(msgspec.structs.replace(one, on_failure="fail"), _job(tmp_path / "a", num_steps=6), cluster)


def test_killed_worker_fails_fast_naming_actor_and_node(cluster, tmp_path):
    node = ray.get_runtime_context().get_node_id()
    spec = ControllerSpec(num_controllers=2, heartbeat_interval_s=0.5, hang_timeout_s=60.0, on_failure="fail")
    engine_kwargs = {"crash_at_call": 1, "marker": str(tmp_path / "fired")}
    with pytest.raises(ControllerFailure) as failure:
        run(spec, _job(num_steps=3, engine_kwargs=engine_kwargs), cluster)
    message = str(failure.value)
    # detected by the death of the process, not by the 60 s hang timer
    assert "died" in message and "hang" not in message
    assert "rollout-" in message and f"node {node}" in message


@pytest.mark.slow
def test_killed_worker_restarts_when_configured(cluster, tmp_path):
    spec = ControllerSpec(num_controllers=2, heartbeat_interval_s=0.5, checkpoint_every=1, max_restarts=1)
    engine_kwargs = {"crash_at_call": 2, "marker": str(tmp_path / "fired")}
    logged: list[tuple[int, list]] = []
    job = dataclasses.replace(
        _job(tmp_path, num_steps=4, engine_kwargs=engine_kwargs),
        on_step=lambda step, reports: logged.append((step, reports)),
    )
    result = run(spec, job, cluster)
    # every step is logged once. A step whose reports had not all reached the driver when the engine died
    # is logged from the checkpoint that carries them (`replay_saved_reports`), and is then not among this
    # attempt's `result.reports`: how many steps that is depends on timing, so the log is what is compared
    assert result.restarts == 1 and [step for step, _ in logged] == [0, 1, 2, 3]
    assert {1, 2, 3} <= set(result.reports)
    assert [r.metrics["num_samples"] for r in logged[3][1]] == [8, 8]


@pytest.mark.slow
def test_hang_is_reported_never_silent(cluster):
    node = ray.get_runtime_context().get_node_id()
    spec = ControllerSpec(num_controllers=2, heartbeat_interval_s=0.25, hang_timeout_s=2.0, max_restarts=0)
    with pytest.raises(ControllerFailure) as failure:
        run(spec, _job(num_steps=3, engine_kwargs={"hang_at_call": 1}), cluster)
    message = str(failure.value)
    assert message.startswith("hang: controller-")
    assert f"on node {node} made no progress" in message
    assert "phase 'rollout'" in message and "in rollout.generate" in message
    assert "(after 0 restarts)" in message


def test_an_error_in_the_step_function_fails_fast_without_restarts(cluster, tmp_path):
    spec = ControllerSpec(mode="single", heartbeat_interval_s=0.5, max_restarts=3)
    job = _job(num_steps=3)
    job.step_fn = doubles.failing_step
    with pytest.raises(ControllerFailure, match=r"^controller-0 failed: ValueError: bad reward in row \d+$"):
        run(spec, job, cluster)


def test_samples_of_an_unexpected_version_are_never_trained_on(cluster):
    # the engines still hold version 4's weights while the controllers expect version 0
    spec = ControllerSpec(num_controllers=2, heartbeat_interval_s=0.5, max_restarts=3)
    with pytest.raises(
        ControllerFailure, match=re.escape("samples of policy versions [4] in a step that expects version 0")
    ):
        run(spec, _job(num_steps=2, engine_kwargs={"version": 4}), cluster)


@pytest.mark.slow
def test_single_controller_resumes_with_identical_batches(cluster, tmp_path):
    spec = ControllerSpec(mode="single", heartbeat_interval_s=0.5, checkpoint_every=1)
    whole = run(spec, _job(tmp_path / "a", num_steps=4), cluster)
    run(spec, _job(tmp_path / "b", num_steps=2), cluster)
    rest = run(spec, _job(tmp_path / "b", num_steps=4), cluster)
    assert sorted(rest.reports) == [2, 3]
    for step in (2, 3):
        # same rows in the same order (signature), same learner state, same RNG draw, same buffers
        assert rest.reports[step][0].metrics == whole.reports[step][0].metrics


def _critic_job(tmp_path, num_steps: int) -> Job:
    """The media job plus a second stateful service, "critic" (a CountingLearner double), checkpointed."""

    def build(pool: HostPool) -> Services:
        services = _build()(pool)
        critic = WorkerGroup.create(pool, "critic", doubles.CountingLearner, pass_worker_info=True)
        return dataclasses.replace(
            services, groups={**services.groups, "critic": critic}, checkpointed=("critic",)
        )

    return Job(
        build=build,
        step_fn=doubles.critic_step,
        dataset=_rows,
        batch_size=8,
        num_steps=num_steps,
        checkpoint_dir=str(tmp_path / "ckpt"),
    )


@pytest.mark.slow
def test_checkpointed_services_resume_with_their_state(cluster, tmp_path):
    """A critic's running total survives a stop after step 1 and a resume: steps 2-3 match a straight run."""
    spec = ControllerSpec(num_controllers=2, heartbeat_interval_s=0.5, checkpoint_every=2)
    straight = run(spec, _critic_job(tmp_path / "a", 4), cluster)
    run(spec, _critic_job(tmp_path / "b", 2), cluster)
    resumed = run(spec, _critic_job(tmp_path / "b", 4), cluster)
    assert sorted(resumed.reports) == [2, 3]
    for step in (2, 3):
        assert [r.metrics for r in resumed.reports[step]] == [r.metrics for r in straight.reports[step]]
    assert straight.reports[3][0].metrics["critic_total"] > straight.reports[1][0].metrics["critic_total"] > 0
    names = sorted(p.name for p in next((tmp_path / "b" / "ckpt").iterdir()).iterdir())
    assert "critic-0.0.bin" in names and "critic-1.0.bin" in names


def test_checkpointed_service_must_exist(cluster, tmp_path):
    def build(pool: HostPool) -> Services:
        return dataclasses.replace(_build()(pool), checkpointed=("critic",))

    job = Job(build=build, step_fn=doubles.media_step, dataset=_rows, batch_size=8, num_steps=1)
    with pytest.raises(
        ValueError, match=r"Services.checkpointed names \['critic'\], not among \['actor', 'rollout'\]"
    ):
        run(
            ControllerSpec(num_controllers=2, heartbeat_interval_s=0.5, count_driver_bytes=True), job, cluster
        )


def test_a_checkpoint_carries_the_reports_a_dead_driver_never_logged(cluster, tmp_path):
    """Controllers run ahead of the driver's heartbeat: a checkpoint can be written before the driver has the
    reports of its steps. It carries every controller's reports of the steps the driver had not logged, and a
    run resumed from it (a new driver: nothing received) hands them to on_step before running on."""
    from yatt_controller.checkpoint import latest
    from yatt_controller.controller import saved_reports

    spec = ControllerSpec(num_controllers=2, heartbeat_interval_s=0.5, checkpoint_every=2)
    logged: dict[int, list] = {}
    first = run(spec, dataclasses.replace(_job(tmp_path, num_steps=4), on_step=logged.__setitem__), cluster)
    path, manifest = latest(str(tmp_path / "ckpt"))
    assert manifest.step == 3
    saved = saved_reports(path)
    # the last step's reports from both controllers at least; none the driver had acknowledged before
    assert {(r.step, r.controller_rank) for r in saved} >= {(3, 0), (3, 1)}
    # a step the driver had not logged is carried by both controllers (one that only one carries was logged:
    # the other controller's heartbeat had already said so)
    pairs = {(r.step, r.controller_rank) for r in saved}
    steps = sorted({s for s, _ in pairs if {(s, 0), (s, 1)} <= pairs})
    assert [r.metrics for r in saved if r.step == 3] == [r.metrics for r in first.reports[3]]
    # a new driver resuming from it: the run is done, but on_step gets each carried step, all ranks, in order
    recovered: list[tuple[int, list]] = []
    rest = run(
        spec,
        dataclasses.replace(_job(tmp_path, num_steps=4), on_step=lambda s, r: recovered.append((s, r))),
        cluster,
    )
    assert rest.reports == {}  # recovered reports are not this run's
    assert [s for s, _ in recovered] == steps and recovered[-1][0] == 3
    assert [r.metrics for r in recovered[-1][1]] == [r.metrics for r in logged[3]]
