"""The machine model of live jobs (yatt_placement.machine): a step worked out by hand (processor sharing of one
unit, chunked calls streaming into the judge), the other machine load, and a fit that recovers its constants."""

import msgspec
import pytest
from yatt_placement.machine import CallShape, MachineModel, fit_machine, step_time
from yatt_placement.planner import lay_out, plan
from yatt_placement.types import ClusterSpec, RoleSpec

ROLES = [
    RoleSpec(role="actor", num_params=2e5, trainable=True),
    RoleSpec(role="rollout", num_params=2e5),
    RoleSpec(role="genrm", num_params=2e5),
]
# every call costs 1 s at full speed: one decode iteration, tokens free
SHAPE = CallShape(
    num_prompts=2,
    samples_per_prompt=1,
    judgements=1,
    prompt_tokens=10,
    response_tokens=3,
    max_response_tokens=1,
    judge_prompt_tokens=50,
    verdict_tokens=1,
)
UNIT = MachineModel(physical_units=1, iteration_s=1.0, token_s=0.0, trainer_s=1.0)


def test_a_step_by_hand_two_devices_on_one_unit():
    # rollout on device 0, judge on device 1; 2 chunks of 1 prompt. t 0-1: rollout call A alone (full speed).
    # t 1-3: judge call of A and rollout call B share the unit (half speed each). t 3-4: judge call of B alone.
    # Then the trainer on both devices: 1 s of work at half speed.
    cluster = ClusterSpec(num_nodes=1, devices_per_node=2)
    placement = lay_out(cluster, ROLES, "partial", {"actor": 2, "rollout": 1, "genrm": 1})
    predicted = step_time(UNIT, SHAPE, placement)
    assert (predicted.rollout_s, predicted.reward_s, predicted.rollout_reward_s) == (3.0, 3.0, 4.0)
    assert predicted.step_s == 6.0
    assert predicted.busy_device_s == {"rollout": 3.0, "judge": 3.0}
    # another group busy on the machine halves every device's share: each phase takes twice as long
    loaded = step_time(msgspec.structs.replace(UNIT, background_load=1.0), SHAPE, placement)
    assert (loaded.rollout_reward_s, loaded.step_s) == (8.0, 12.0)


def test_colocated_calls_of_one_device_wait_for_each_other():
    # colocated on one device: both roles' calls run one at a time: 4 calls of 1 s, then the trainer and the
    # engines' swap (0.5 s of work)
    cluster = ClusterSpec(num_nodes=1, devices_per_node=1)
    model = msgspec.structs.replace(UNIT, swap_s=0.5)
    predicted = step_time(model, SHAPE, plan(cluster, ROLES, "colocated"))
    assert (predicted.rollout_reward_s, predicted.step_s) == (4.0, 5.5)


def test_fit_recovers_the_constants_of_a_colocated_run():
    cluster = ClusterSpec(num_nodes=1, devices_per_node=4)
    shape = msgspec.structs.replace(
        SHAPE, num_prompts=8, samples_per_prompt=8, judgements=4, max_response_tokens=6, verdict_tokens=3
    )
    truth = MachineModel(
        physical_units=2, iteration_s=0.004, token_s=1e-5, trainer_s=0.1, sync_s=0.01, background_load=1.5
    )
    colocated = plan(cluster, ROLES, "colocated")
    run = step_time(truth, shape, colocated)
    wall = 1 / truth.rate(4)  # the trainer's phases, as a run measures them (wall seconds)
    measured = {
        "rollout_s": run.rollout_s,
        "reward_s": run.reward_s,
        "trainer_s": 0.1 * wall,
        "sync_s": 0.01 * wall,
    }
    fitted = fit_machine(measured, shape, colocated, physical_units=2, background_load=1.5)
    assert fitted.iteration_s == pytest.approx(0.004, rel=1e-4)
    assert fitted.token_s == pytest.approx(1e-5, rel=1e-4)
    assert (fitted.trainer_s, fitted.sync_s) == pytest.approx((0.1, 0.01))
    with pytest.raises(ValueError, match=r"fit_machine needs a measured reward_s > 0, got 0\.0"):
        fit_machine({"rollout_s": 1.0, "reward_s": 0.0}, shape, colocated, physical_units=2)
    with pytest.raises(ValueError, match=r"MachineModel\.physical_units must be >= 1, got 0"):
        MachineModel(physical_units=0, iteration_s=0.0, token_s=0.0)
