"""The facts a job reads from a plan (`PlacementPlan.devices`, `shares_device`, `num_replicas`, `sleeps`,
`streams_into_judge`, `movable`), checked against hand-laid-out plans of every mode."""

import pytest
from yatt_placement.planner import plan
from yatt_placement.types import ClusterSpec, JobProfile, PlacementPlan, RolePlacement, RoleSpec

FOUR = ClusterSpec(num_nodes=1, devices_per_node=4, device_memory_gb=80.0)
ACTOR = RoleSpec(role="actor", num_params=1e8, trainable=True)
ROLLOUT = RoleSpec(role="rollout", num_params=1e8)
JUDGE = RoleSpec(role="genrm", num_params=1e8)
REWARD = RoleSpec(role="reward", num_params=1e6)
EVEN = JobProfile(device_seconds={"actor": 1.0, "rollout": 1.0, "genrm": 1.0})


def _facts(result: PlacementPlan) -> tuple:
    return (
        result.shares_device("actor", "rollout"),
        result.shares_device("rollout", "genrm"),
        result.sleeps,
        result.streams_into_judge,
        result.movable,
    )


@pytest.mark.parametrize(
    ("mode", "devices", "facts"),
    [
        # actor-rollout shared, rollout-judge shared, sleeps, streams, movable
        (
            "colocated",
            {"actor": [0, 1, 2, 3], "rollout": [0, 1, 2, 3], "genrm": [0, 1, 2, 3]},
            (True, True, True, False, False),
        ),
        (
            "partial",
            {"actor": [0, 1, 2, 3], "rollout": [0, 1], "genrm": [2, 3]},
            (True, False, False, True, False),
        ),
        (
            "dynamic",
            {"actor": [0, 1, 2, 3], "rollout": [0, 1], "genrm": [2, 3]},
            (True, False, False, True, True),
        ),
        (
            "disaggregated",
            {"actor": [0, 1], "rollout": [2], "genrm": [3]},
            (False, False, False, True, False),
        ),
    ],
)
def test_each_mode_states_its_facts(mode, devices, facts):
    result = plan(FOUR, [ACTOR, ROLLOUT, JUDGE], mode, profile=EVEN)
    assert {key: result.devices(key) for key in result.role_keys()} == devices
    assert _facts(result) == facts


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_without_a_judge_nothing_streams_into_one(mode):
    # a rule reward on its own device is not a judge: nothing streams, even where rollout has its own slice
    result = plan(FOUR, [ACTOR, ROLLOUT, REWARD], mode)
    assert result.placement("genrm") is None and result.devices("genrm") == []
    assert not result.streams_into_judge and not result.shares_device("rollout", "genrm")
    assert result.shares_device("actor", "rollout") == (mode == "colocated")


def test_replicas_devices_and_names_on_a_hand_made_plan():
    made = PlacementPlan(
        mode="disaggregated",
        num_devices=8,
        roles=[
            RolePlacement(role="actor", replicas=[[0], [1]]),
            RolePlacement(role="rollout", replicas=[[3, 2], [4, 5]]),
            RolePlacement(role="genrm", name="judge", replicas=[[6, 7]]),
        ],
    )
    assert made.role_keys() == ["actor", "rollout", "judge"]
    assert made.num_replicas("actor") == 2 and made.num_replicas("judge") == 1 and made.num_replicas("x") == 0
    assert made.devices("rollout") == [2, 3, 4, 5] and made.devices("genrm") == []  # named "judge"
    assert made.streams_into_judge and not made.shares_device("actor", "rollout")
    shared = PlacementPlan(
        mode="partial",
        num_devices=2,
        roles=[RolePlacement(role="rollout", replicas=[[0]]), RolePlacement(role="genrm", replicas=[[0, 1]])],
    )
    assert shared.shares_device("rollout", "genrm") and not shared.streams_into_judge


def test_facts_survive_the_wire():
    import msgspec

    result = plan(FOUR, [ACTOR, ROLLOUT, JUDGE], "dynamic", profile=EVEN)
    back = msgspec.json.decode(msgspec.json.encode(result), type=PlacementPlan)
    assert _facts(back) == _facts(result) and back.devices("rollout") == result.devices("rollout")
