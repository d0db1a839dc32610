"""One example of every Struct in yatt_placement.types, with non-default values, for the wire contract test
(tests/test_wire_contract.py at the workspace root) and its golden fixtures in golden/."""

from yatt_placement.types import (
    ClusterSpec,
    JobProfile,
    PhaseStats,
    PlacementPlan,
    ReplanConfig,
    RolePlacement,
    RoleSpec,
)

EXAMPLES = [
    ClusterSpec(num_nodes=8, devices_per_node=8, device_memory_gb=96.0),
    RoleSpec(role="genrm", num_params=72e9, tensor_parallel=8, num_replicas=1, name="judge"),
    RolePlacement(role="rollout", replicas=[[0, 1], [2, 3]], colocated_with=["actor"]),
    PlacementPlan(
        mode="partial",
        num_devices=8,
        roles=[
            RolePlacement(role="actor", replicas=[[0, 1, 2, 3, 4, 5, 6, 7]]),
            RolePlacement(role="rollout", replicas=[[0, 1], [2, 3]]),
            RolePlacement(role="genrm", replicas=[[4, 5, 6, 7]], name="judge"),
        ],
        version=3,
        reason="rollout busy 0.91 vs genrm 0.42 for 3 steps",
    ),
    PhaseStats(step=7, step_time_s=12.5, busy_s={"rollout": 9.0, "genrm": 4.0}, num_devices={"rollout": 4}),
    JobProfile(device_seconds={"rollout": 96.0, "judge": 410.5}, num_steps=4),
    ReplanConfig(gap_threshold=0.2, patience=4, min_gain=0.1, ema_decay=0.3, cooldown=2),
]
