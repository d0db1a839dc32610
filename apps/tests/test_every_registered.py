"""Every registered advantage estimator and policy loss of yatt-algos runs one step in a real job: the test job
file `jobs/sweep_job.py` (GRPO's step function, run as a user's own job is, through `yatt run`'s loader) trains
step s with the s-th (estimator, loss) pair, so one start covers them all; GAE, which needs the critic's values,
is `yatt ppo`'s (tested in test_dapo_ppo.py). A config a job cannot run is refused at start, before Ray, with
the missing input named.

Marked slow: one job of 14 steps in the module's Ray session.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import msgspec
import pytest
from yatt_algos.advantages import ADVANTAGE_ESTIMATORS
from yatt_algos.policy_losses import POLICY_LOSSES
from yatt_apps.config import tiny_cpu, tiny_cpu_ppo
from yatt_apps.jobs import find, load_file

replace = msgspec.structs.replace
# loaded at collection: the file's folder reaches PYTHONPATH before any Ray worker starts
SWEEP = load_file(Path(__file__).parent / "jobs" / "sweep_job.py")


def test_every_registered_estimator_and_loss_is_in_the_sweep():
    import sweep_job

    pairs = sweep_job.pairs()
    assert {e for e, _ in pairs} | set(sweep_job.CRITIC_ESTIMATORS) == set(ADVANTAGE_ESTIMATORS)
    assert {loss for _, loss in pairs} == set(POLICY_LOSSES)
    assert tiny_cpu_ppo().algo.adv_estimator == "gae"  # the critic's estimator runs in yatt ppo's test


@pytest.mark.slow
def test_every_registered_estimator_and_loss_trains_one_step_in_a_job(ray_session, tmp_path):
    import sweep_job
    from yatt_apps.runtime.launch import run_job

    cfg = SWEEP.preset()
    run_job(cfg, tmp_path / "run", SWEEP)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["sweep/pair"] for row in rows] == list(range(len(sweep_job.pairs())))
    moved = 0
    for row, (estimator, loss) in zip(rows, sweep_job.pairs(), strict=True):
        for key in ("train/loss", "train/pg_loss", "train/grad_norm"):
            assert math.isfinite(row[key]), (estimator, loss, key, row[key])
        moved += row["train/grad_norm"] > 0
        # a correction is on (token IS): verl's off-policy diagnostics, from the old-logprob forward, or in
        # bypass mode (the rollout's logprobs are the old policy's) from the loss's own forward
        assert row["rollout_corr/training_ppl"] > 1.0 and abs(row["rollout_corr/k3_kl"]) < 1e-3, row
        if loss != "bypass_mode":
            assert 0.9 < row["rollout_corr/rollout_is_eff_sample_size"] < 1.0 + 1e-6  # rollout ~ train here
    assert moved >= len(rows) - 2  # rewards vary within groups: almost every pair's step has a gradient


@pytest.mark.parametrize(
    ("app", "estimator", "needs"),
    [
        ("grpo", "gae", "needs values (a critic: use yatt ppo)"),
        ("dapo", "optimal_token_baseline", "needs old_logprobs and sum_pi_squared"),
        ("dapo", "remax", "needs baseline_rewards"),
        ("grpo-vlm", "gdpo", "needs reward_components"),
        ("ppo", "grpo", "yatt ppo trains with GAE"),
        ("capo", "rloo", "capo computes its own token advantages"),
    ],
)
def test_an_estimator_a_job_cannot_feed_is_refused_at_start(app, estimator, needs):
    job = find(app)
    base = job.preset()
    with pytest.raises(ValueError, match=re.escape(needs)):
        job.check(replace(base, algo=replace(base.algo, adv_estimator=estimator)))


def test_optimal_token_baseline_needs_the_torch_learner():
    from yatt_apps.runtime.policy_inputs import check_estimator

    base = tiny_cpu()
    cfg = replace(base, algo=replace(base.algo, adv_estimator="optimal_token_baseline"))
    check_estimator(cfg, "grpo", ("optimal_token_baseline",), "fsdp2")
    with pytest.raises(ValueError, match="Megatron learner does not compute"):
        check_estimator(cfg, "grpo", ("optimal_token_baseline",), "megatron")
