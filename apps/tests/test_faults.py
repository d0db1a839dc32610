"""A rollout replica's process killed mid-step: the run replaces it on its device with the current weights,
sends its in-flight requests again and finishes every step without a restart, with the metrics of an
uninterrupted run (sampling is seeded: the requests sent again carry their seeds).

The kill is scripted by a test double, `DyingRollout`: a RolloutWorker whose process SIGKILLs itself at its
first `generate` call under policy version 1 (step 1, after a weight push), once per test (a marker file made
exclusively: of the two rollout replicas, one dies).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import sys
from pathlib import Path

import msgspec
import pytest
from yatt_apps.config import PRESETS, ControllerSpec, PlacementConfig
from yatt_apps.jobs import find
from yatt_apps.runtime.job import build_services
from yatt_apps.runtime.launch import placement_plan, run_job
from yatt_apps.runtime.workers import RolloutWorker
from yatt_placement.types import ClusterSpec

pytestmark = pytest.mark.slow


class DyingRollout(RolloutWorker):
    """Test double: a rollout worker whose process dies (SIGKILL) in its first `generate` of policy version
    1, when the file `marker` does not exist yet (it creates it first: the fault fires once)."""

    marker = ""

    def generate(self, requests: list) -> list:
        if self.engine is not None and self.engine.policy_version >= 1 and self._first():
            os.kill(os.getpid(), signal.SIGKILL)
        return super().generate(requests)

    def _first(self) -> bool:
        """Whether this call made the marker: created exclusively, so of two replicas in their first
        generate of version 1 at once, one dies."""
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True


def config(num_steps: int):
    """tiny_cpu without its judge (rule rewards), disaggregated over 3 logical devices (the learner on one,
    a rollout replica with the rule reward beside it on each of the others), one controller. (Two controllers
    seeing one death and replacing it once: yatt-controller's test_replacement.)"""
    cfg = PRESETS["tiny_cpu"]()
    replace = msgspec.structs.replace
    return replace(
        cfg,
        judge=None,
        rewards=[r for r in cfg.rewards if r.kind != "genrm"],
        run=replace(cfg.run, num_steps=num_steps, prompts_per_step=4, eval_every=0, progress=False),
        sampling=replace(cfg.sampling, n=4),
        controller=ControllerSpec(
            mode="parallel", num_controllers=1, heartbeat_interval_s=1.0, hang_timeout_s=240.0, max_restarts=1
        ),
        placement=PlacementConfig(
            mode="disaggregated",
            cluster=ClusterSpec(num_nodes=1, devices_per_node=3, device_memory_gb=16.0),
        ),
    )


def _compared(summary: dict) -> dict:
    """The step's learning metrics (timings and the fault count differ between the runs by design)."""
    skip = ("time/", "throughput/", "faults/", "seconds")
    return {k: v for k, v in summary.items() if isinstance(v, float) and not k.startswith(skip)}


def test_killed_rollout_replica_is_replaced_without_a_restart(ray_session, tmp_path):
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import test modules
    DyingRollout.marker = str(tmp_path / "killed")
    cfg = config(num_steps=3)
    job = find(cfg.app)
    plan = {r.role: r.replicas for r in placement_plan(cfg, job).roles}
    assert plan == {"actor": [[0]], "rollout": [[1], [2]], "reward": [[1], [2]]}, plan
    dying = dataclasses.replace(job, build=functools.partial(build_services, rollout_cls=DyingRollout))
    # the uninterrupted run first: its hosts are kept for the faulty run (a run that replaced a replica keeps none)
    whole = run_job(cfg, tmp_path / "whole", job)
    faulty = run_job(cfg, tmp_path / "faulty", dying)
    assert Path(DyingRollout.marker).exists()  # the replica's process was killed mid-step
    assert faulty["restarts"] == 0, faulty["failures"]
    # the killed process held a rollout replica and the rule reward replica beside it (a rule reward has no
    # device of its own): both are replaced
    assert faulty["faults/replicas_replaced"] == 2.0
    assert faulty["step"] == cfg.run.num_steps - 1
    assert whole["restarts"] == 0 and whole["faults/replicas_replaced"] == 0.0
    assert _compared(faulty) == _compared(whole)
    logs = [(tmp_path / name / "metrics.jsonl").read_text().splitlines() for name in ("faulty", "whole")]
    assert [msgspec.json.decode(line)["step"] for line in logs[0]] == [0, 1, 2]
    records = [[_compared(msgspec.json.decode(line)) for line in lines] for lines in logs]
    assert records[0] == records[1]  # every step, the faulty step 1 included
