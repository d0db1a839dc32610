"""Asynchronous GRPO with bounded staleness (`algo.max_staleness`), on the real tiny job with its judge in a
disaggregated layout (learner 2, rollout 1, judge 1 of 4 logical devices) and with rule rewards only in the
smallest one (learner 1, rollout and reward 1 of 2), one shared Ray session."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import sys
import time

import msgspec
import pytest
from yatt_apps.cli.main import main
from yatt_apps.config import PRESETS, ControllerSpec, PlacementConfig, RunConfig
from yatt_apps.jobs.grpo import JOB
from yatt_apps.runtime.job import build_services
from yatt_apps.runtime.launch import placement_plan, run_job
from yatt_apps.runtime.workers import RolloutWorker
from yatt_placement.types import ClusterSpec


def async_config(k: int, num_steps: int, *, rules_only: bool = False, **run) -> RunConfig:
    """The judged layout of four devices; `rules_only`: no judge, the smallest async layout (learner on device
    0, the engine with the rule reward beside it on device 1, one controller), two host processes instead of
    four."""
    cfg = PRESETS["tiny_cpu"]()
    replace = msgspec.structs.replace
    run = {"prompts_per_step": 4, **run}
    if rules_only:
        cfg = replace(cfg, judge=None, rewards=[s for s in cfg.rewards if s.kind != "genrm"])
    return replace(
        cfg,
        run=replace(cfg.run, num_steps=num_steps, eval_every=0, progress=False, **run),
        sampling=replace(cfg.sampling, n=4),
        algo=replace(cfg.algo, max_staleness=k),
        controller=ControllerSpec(
            num_controllers=1 if rules_only else 2,
            heartbeat_interval_s=1.0,
            hang_timeout_s=240.0,
            checkpoint_every=2,
        ),
        placement=PlacementConfig(
            mode="disaggregated",
            cluster=ClusterSpec(num_nodes=1, devices_per_node=2 if rules_only else 4, device_memory_gb=16.0),
        ),
    )


def test_colocated_async_is_a_config_error(tmp_path, capsys):
    code = main(["grpo", "--set", "algo.max_staleness=1", "--run-dir", str(tmp_path / "run")])
    assert code == 2
    assert "algo.max_staleness > 0 needs placement.mode disaggregated" in capsys.readouterr().err
    assert main(["dapo", "--set", "algo.max_staleness=1", "--run-dir", str(tmp_path / "d")]) == 2
    assert "the dapo job trains on-policy only" in capsys.readouterr().err
    assert main(["grpo", "--set", "rollout.partial=true", "--run-dir", str(tmp_path / "p")]) == 2
    assert "rollout.partial=true needs algo.max_staleness > 0" in capsys.readouterr().err


class _RecordingSync:
    """A `WeightSync` stand-in recording the calls made on it; each push moves 1000 bytes."""

    remote, bucket_bytes = True, 4096

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.pending = False

    def push(self, version: int) -> int:
        self.calls.append(f"push {version}")
        return 1000

    def start(self, version: int) -> None:
        self.calls.append(f"start {version}")
        self.pending = True

    def settle(self) -> int:
        self.calls.append("settle")
        landed, self.pending = 1000 if self.pending else 0, False
        return landed


def test_a_background_push_lands_before_the_next_generation_and_counts_in_that_step():
    """One async controller with a DDP learner: the step starts its push and goes on; the next call to the
    rollout engines (or the learner) waits for it to land, and the step it lands in reports its bytes. The
    real path: the rule-only async runs below (`straight_k1`: each sample within the bound, and a resumed
    run's steps equal to the straight run's, `sync/bytes` included)."""
    from types import SimpleNamespace

    from yatt_apps.runtime.phases import (
        SyncBytes,
        background_push,
        initial_push,
        push_weights,
        submit_rollout,
    )

    cfg = async_config(1, 2, rules_only=True)
    assert background_push(cfg)
    assert not background_push(async_config(1, 2))  # two controllers: each push is waited for
    assert not background_push(PRESETS["tiny_cpu"]())  # on-policy
    sync = _RecordingSync()
    engine = SimpleNamespace(dp_size=1, call_one=lambda method, chunk: sync.calls.append(method) or chunk)
    ctx = SimpleNamespace(
        rank=0,
        world_size=1,
        policy_version=0,
        state={},
        weight_sync=sync,
        learner=SimpleNamespace(broadcast=lambda method, *args: [0]),  # DDP: no bucket to gather
        get=lambda refs: refs,
        services={"rollout": engine},
        barrier=lambda: None,
        before_push=lambda: None,
        phase=lambda name: contextlib.nullcontext(),
    )
    plan = placement_plan(cfg, JOB)

    def step(ctx, batch):
        submit_rollout(ctx, ["request"], per_replica=1)
        push_weights(ctx, cfg, plan)
        return {"loss": 0.0}

    initial_push(ctx, 0, background=True)
    assert sync.calls == ["start 0"] and sync.pending
    stepped = SyncBytes(step)
    assert stepped(ctx, []) == {"loss": 0.0, "sync/bytes": 1000.0}  # the first push landed in step 0
    assert sync.calls == ["start 0", "settle", "generate", "start 1"] and ctx.policy_version == 1
    assert stepped(ctx, []) == {"loss": 0.0, "sync/bytes": 1000.0}  # step 0's push landed in step 1
    assert sync.calls[4:] == ["settle", "generate", "start 2"] and ctx.policy_version == 2


def metrics(run_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}


@pytest.fixture(scope="module")
def straight_k1(ray_session, tmp_path_factory):
    """One 4-step k=1 run in the rule-only layout of two devices, shared by the bound test and the resume test
    (its straight reference)."""
    run_dir = tmp_path_factory.mktemp("async") / "straight"
    cfg = async_config(1, 4, rules_only=True)
    plan = {r.role: r.replicas for r in placement_plan(cfg, JOB).roles}
    assert plan == {"actor": [[0]], "rollout": [[1]], "reward": [[1]]}, plan  # the reward beside the engine
    run_job(cfg, run_dir, JOB)
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
def test_staleness_is_bounded_and_generation_overlaps_training(ray_session, request, tmp_path, k):
    if k == 1:
        run_dir = request.getfixturevalue("straight_k1")
    else:  # the judged layout of four devices
        run_dir = tmp_path / "run"
        run_job(async_config(k, 4), run_dir, JOB)
    steps = metrics(run_dir)
    assert sorted(steps) == [0, 1, 2, 3]
    # every trained sample was checked against the bound; the step's oldest reached it once the window filled
    assert all(s["async/staleness_max"] <= k for s in steps.values())
    assert steps[3]["async/staleness_max"] == k and steps[0]["async/staleness_max"] == 0
    assert steps[3]["async/staleness_mean"] > 0
    assert sum(s["async/rollout_train_overlap_s"] for s in steps.values()) > 0.0
    # every step reports one whole push: its own (k=2: two controllers wait for it), or with one controller
    # (k=1) the one that landed during it, the previous step's or at step 0 the run's first
    pushed = {s["sync/bytes"] for s in steps.values()}
    assert len(pushed) == 1 and pushed.pop() > 0


@pytest.mark.slow
def test_a_resumed_async_run_trains_the_same_next_batches(ray_session, straight_k1, tmp_path):
    """The straight run cut back to its checkpoint after step 1 (holding the batch generated for step 2, in
    flight) and resumed: steps 2 and 3 equal the straight run's (seeded sampling, same data cursor)."""
    import shutil

    shutil.copytree(straight_k1, tmp_path / "stopped", ignore=shutil.ignore_patterns("final"))
    ckpts = sorted(p for p in (tmp_path / "stopped" / "checkpoints").iterdir() if p.is_dir())
    assert [p.name for p in ckpts] == ["step-00000001", "step-00000003"]
    shutil.rmtree(ckpts[-1])
    run_job(async_config(1, 4, rules_only=True), tmp_path / "stopped", JOB)
    straight, resumed = metrics(straight_k1), metrics(tmp_path / "stopped")
    # steps 2 and 3 ran again, and were logged anew
    assert resumed[2]["time/step"] != straight[2]["time/step"]
    for step in (2, 3):
        a = {
            k: v for k, v in resumed[step].items() if not k.startswith(("time/", "throughput/", "async/roll"))
        }
        b = {
            k: v
            for k, v in straight[step].items()
            if not k.startswith(("time/", "throughput/", "async/roll"))
        }
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6), step


class SlowDecodeRollout(RolloutWorker):
    """Test double: the real rollout worker (HF engine, partial updates) whose model sleeps 10 ms before every
    forward (each decode step), so that a batch's generation outlasts the step's training and a weight push
    lands while it runs. Without it the tiny job's generation is a fraction of its training step on an idle
    machine and whether a push meets a running batch is luck (CI's run: 0 resumed)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        forward = self.engine.model.forward

        def slow_forward(*a, **kw):
            time.sleep(0.01)
            return forward(*a, **kw)

        self.engine.model.forward = slow_forward


@pytest.mark.slow
def test_partial_rollouts_resume_generations_across_weight_pushes(ray_session, tmp_path):
    """rollout.partial=true, k=1: generations of the batch launched at step s are still running when step s
    pushes its weights; the engine loads them between two decode steps and resumes, so completions trained at
    later steps span two versions (step 0's batch was made before any push), and the staleness of their oldest
    token stays within the bound.

    Long generations: an untrained policy (a random tiny model seldom samples eos: most completions run to the
    cap) under the slow-decode test double; the engines' partial updates are asserted exactly (tokens of two
    versions, recorded as version runs) in yatt-rollout's test_hf_engine and test_vllm_engine."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import test modules
    cfg = async_config(1, 4, rules_only=True, prompts_per_step=2)
    replace = msgspec.structs.replace
    cfg = replace(
        cfg,
        model=replace(cfg.model, warm_start="none", warm_start_steps=0),
        rollout=replace(cfg.rollout, partial=True),
        sampling=replace(cfg.sampling, max_new_tokens=64),
    )
    slow = dataclasses.replace(JOB, build=functools.partial(build_services, rollout_cls=SlowDecodeRollout))
    run_job(cfg, tmp_path / "run", slow)
    steps = metrics(tmp_path / "run")
    assert sorted(steps) == [0, 1, 2, 3]
    assert all(s["rollout/response_len_mean"] > 30 for s in steps.values())  # the long generations asked for
    assert all(s["async/staleness_max"] <= 1 for s in steps.values())
    assert steps[0]["async/partial_resumed"] == 0  # step 0 trains samples made before any push
    assert sum(s["async/partial_resumed"] for s in steps.values()) > 0
