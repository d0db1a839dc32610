"""One example of every Struct in yatt_controller.types, with non-default values, for the wire contract test
(tests/test_wire_contract.py at the workspace root) and its golden fixtures in golden/."""

from yatt_controller.types import (
    BucketLayout,
    CheckpointManifest,
    ControllerSpec,
    Heartbeat,
    StepReport,
    WorkerInfo,
)

EXAMPLES = [
    ControllerSpec(num_controllers=4, seed=1, hang_timeout_s=120.0, checkpoint_every=10, keep_checkpoints=3),
    StepReport(
        step=5,
        controller_rank=1,
        metrics={"reward_mean": 0.5},
        timings_s={"rollout": 1.5, "train": 0.75},
        num_samples=64,
    ),
    Heartbeat(actor="controller-1", node_id="node-0", step=5, phase="rollout", time_unix=1_790_000_000.5),
    Heartbeat(
        actor="device-2",
        node_id="node-0",
        step=0,
        phase="",
        time_unix=1.5,
        busy_s={"rollout": 2.25, "reward": 0.5},
    ),
    CheckpointManifest(
        step=10,
        created_unix=1_790_000_100.0,
        files={"learner.pt": "0" * 64},
        sizes={"learner.pt": 1024},
        policy_version=10,
    ),
    WorkerInfo(role="rollout", dp_rank=1, dp_size=2, tp_rank=1, tp_size=2, device=3, name="judge"),
    BucketLayout(dtype="bfloat16", names=["lm_head.weight", "norm.weight"], shapes=[[8, 4], [4]], nbytes=72),
]
