"""Shipped simulation scenarios, an explicit registry.

- `paper`: shaped after WeChat-YATT's GRPO + GenRM run (arXiv 2508.07970; PAPERS.md): 64 H20-class devices
  (8 nodes x 8, 96 GB), a 1.5B policy, a 72B judge on tensor-parallel-8 engines, 4 samples per prompt and 8
  judgements per response of up to 512 tokens (median 120: a short verification and the verdict);
  responses long-tailed (median 600, up to 4096 tokens); 256 prompts per step.
- `paper-8`: the paper's model shapes on one 8-device node (the README's prediction for a GPU cluster): a
  1.5B policy, a 7B judge (one device per engine), the `paper` workload at 64 prompts per step.
- `drift`: 32 devices, a 7B policy whose responses lengthen 21x over the run (as in long-CoT RL) and a 7B
  answer-verifier judge (tensor parallel 4, 8 verdicts per response, reads the final answer only, so its work
  stays flat): the best rollout/judge split moves during the run, the case the dynamic re-planner is for.
- `single-judge`: a 7B policy judged once per response by a 7B GenRM on 16 devices.
- `no-judge`: a 7B policy with a rule reward and dynamic sampling (DAPO-like) on 16 devices; partial
  colocation does not apply (it needs a GenRM).
The hardware and length figures are assumptions in the range of public reports, not measurements.
"""

from __future__ import annotations

from collections.abc import Callable

from yatt_placement.simulator import Scenario, Workload
from yatt_placement.types import ClusterSpec, RoleSpec


def _policy(num_params: float) -> list[RoleSpec]:
    return [
        RoleSpec(role="actor", num_params=num_params, trainable=True),
        RoleSpec(role="rollout", num_params=num_params),
    ]


def paper(num_prompts: int = 256) -> Scenario:
    return Scenario(
        name="paper",
        cluster=ClusterSpec(num_nodes=8, devices_per_node=8, device_memory_gb=96.0),
        roles=[*_policy(1.5e9), RoleSpec(role="genrm", num_params=72e9, tensor_parallel=8, name="judge")],
        workload=Workload(
            num_prompts=num_prompts,
            samples_per_prompt=4,
            gen_median_tokens=600.0,
            gen_sigma=1.0,
            judgements=8,
            judge_median_tokens=120.0,
        ),
    )


def paper_8(num_prompts: int = 64) -> Scenario:
    return Scenario(
        name="paper-8",
        cluster=ClusterSpec(num_nodes=1, devices_per_node=8, device_memory_gb=96.0),
        roles=[*_policy(1.5e9), RoleSpec(role="genrm", num_params=7e9, name="judge")],
        workload=paper(num_prompts).workload,
    )


def drift(num_prompts: int = 256, num_steps: int = 24) -> Scenario:
    return Scenario(
        name="drift",
        cluster=ClusterSpec(num_nodes=1, devices_per_node=8, device_memory_gb=96.0),
        roles=[*_policy(7e9), RoleSpec(role="genrm", num_params=7e9, tensor_parallel=2, name="judge")],
        workload=Workload(
            num_prompts=num_prompts,
            samples_per_prompt=8,
            gen_median_tokens=100.0,
            gen_sigma=0.3,
            gen_growth_per_step=20.0 / num_steps,  # median 100 -> 2100 tokens over the run
            judgements=8,
            judge_reads_response=False,  # an answer verifier: its work does not grow with the responses
            judge_median_tokens=250.0,
        ),
    )


def single_judge(num_prompts: int = 128) -> Scenario:
    return Scenario(
        name="single-judge",
        cluster=ClusterSpec(num_nodes=2, devices_per_node=8, device_memory_gb=80.0),
        roles=[*_policy(7e9), RoleSpec(role="genrm", num_params=7e9, tensor_parallel=2, name="judge")],
        workload=Workload(num_prompts=num_prompts, samples_per_prompt=8, judgements=1),
    )


def no_judge(num_prompts: int = 128) -> Scenario:
    return Scenario(
        name="no-judge",
        cluster=ClusterSpec(num_nodes=2, devices_per_node=8, device_memory_gb=80.0),
        roles=_policy(7e9),
        workload=Workload(num_prompts=num_prompts, samples_per_prompt=8, judgements=0),
    )


SCENARIOS: dict[str, Callable[..., Scenario]] = {
    "paper": paper,
    "paper-8": paper_8,
    "drift": drift,
    "single-judge": single_judge,
    "no-judge": no_judge,
}


def get_scenario(name: str, **kwargs: int) -> Scenario:
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; known: {sorted(SCENARIOS)}")
    return SCENARIOS[name](**kwargs)
