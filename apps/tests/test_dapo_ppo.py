"""`yatt dapo` and `yatt ppo`.

Quick: DAPO's filter-and-refill arithmetic and its wave loop with hand-worked numbers (pure functions and a
scripted step-context double, no Ray), and config errors. Slow: each app runs through the CLI's command in this
process, on one shared Ray session (two parallel controllers, tiny HF models): DAPO 2 steps, PPO 8 steps in
which the critic's value loss falls.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from yatt_apps.cli.main import main
from yatt_apps.config import PRESETS, DynamicSamplingSpec
from yatt_apps.io.data import PromptRow
from yatt_apps.jobs.dapo import (
    Group,
    draw_prompts,
    dynamic_sample,
    push_surplus,
    refill_size,
    select_groups,
    update_expansion,
)

SPEC = DynamicSamplingSpec()  # max_refill 3, safety 1.2, decay 0.9, max expansion 10


def _row(name: str) -> PromptRow:
    return PromptRow(prompt=name, answer="0")


def test_expansion_ema_hand_worked():
    # 8 groups, 2 valid: ratio 4 -> 0.9 * 1.0 + 0.1 * 4 = 1.3
    assert update_expansion(1.0, 8, 2, SPEC) == pytest.approx(1.3)
    # no valid group counts as the maximum 10: 0.9 * 1.3 + 0.1 * 10 = 2.17
    assert update_expansion(1.3, 5, 0, SPEC) == pytest.approx(2.17)
    # the ratio is capped before averaging: 100 / 1 -> 10; 0.9 * 9.5 + 1.0 = 9.55
    assert update_expansion(9.5, 100, 1, SPEC) == pytest.approx(9.55)
    # a wave with no group at all (every controller already full) leaves the EMA alone
    assert update_expansion(1.7, 0, 0, SPEC) == 1.7


def test_refill_size_rounds_float_noise_before_ceil():
    assert 25 * 8.3 * 1.2 > 249  # 249.00000000000003: a bare ceil would ask for 250
    assert refill_size(25, 8.3, 1.2) == 249
    assert refill_size(5, 1.0, 1.2) == 6
    assert refill_size(3, 1.3, 1.2) == 5  # ceil(4.68)
    assert refill_size(1, 10.0, 1.2) == 12
    assert refill_size(0, 3.0, 1.2) == 0


def test_draw_select_and_push_surplus():
    parts = iter([[_row("f0"), _row("f1"), _row("f2"), _row("f3")]])
    drawn, rest = draw_prompts([_row("b0")], 3, lambda: next(parts))
    assert [r.prompt for r in drawn] == ["b0", "f0", "f1"] and [r.prompt for r in rest] == ["f2", "f3"]
    with pytest.raises(ValueError, match="the controller's shard returned no rows for a refill"):
        draw_prompts([], 1, lambda: [])
    assert select_groups(["v1", "v2", "v3"], ["i1", "i2"], 2) == (["v1", "v2"], [], ["v3"])
    assert select_groups(["v1"], ["i1", "i2", "i3"], 3) == (["v1"], ["i1", "i2"], [])
    assert push_surplus(["b1", "b2"], ["s1"], 2) == ["s1", "b1"]  # surplus first, capped


class ScriptedContext:
    """A test double of yatt_controller's StepContext for one controller: `state`, `next_batch` from a list
    of shard parts, and `all_reduce` adding a scripted peer controller's counts, one dict per wave."""

    def __init__(self, parts: list[list[PromptRow]], peer: list[dict[str, float]], state: dict | None = None):
        self.parts, self.peer, self.state = iter(parts), iter(peer), state if state is not None else {}
        self.reduced: list[dict[str, float]] = []

    def next_batch(self) -> list[PromptRow]:
        return next(self.parts)

    def all_reduce(self, values: dict[str, float]) -> dict[str, float]:
        peer = next(self.peer)
        self.reduced.append({k: v + peer[k] for k, v in values.items()})
        return self.reduced[-1]


def _waves(valid_names: set[str], calls: list):
    """A scripted wave: one group per prompt, valid (scores 0 and 1) when its prompt is in valid_names."""

    def wave(rows: list[PromptRow], index: int) -> list[Group]:
        calls.append((index, [r.prompt for r in rows]))
        return [
            Group(
                row=r,
                prompt_ids=[1],
                completions=[],
                scores=[0.0, 1.0] if r.prompt in valid_names else [0.0, 0.0],
                varied=r.prompt in valid_names,
            )
            for r in rows
        ]

    return wave


def test_refill_waves_hand_worked():
    """need 4. Wave 0: 1 of 4 valid here, the peer 1 of 4 and short: EMA 0.9 + 0.1 * 8/2 = 1.3; gap 3 asks
    ceil(3 * 1.3 * 1.2) = ceil(4.68) = 5 prompts: the buffered b0, then the shard part f0..f3. Wave 1: b0, f0,
    f2, f3 valid (5 in all, the peer full): EMA 0.9 * 1.3 + 0.1 * 11/7 = 1.32714; stop. Trained: r1, b0,
    f0, f2; f3 is surplus and goes back to the buffer."""
    rows = [_row(f"r{i}") for i in range(4)]
    fresh = [_row(f"f{i}") for i in range(4)]
    state = {"dapo": {"expansion": 1.0, "buffer": [msgspec.structs.asdict(_row("b0"))]}}
    ctx = ScriptedContext(
        [fresh],
        [{"total": 4, "valid": 1, "short": 1}, {"total": 6, "valid": 3, "short": 0}],
        msgspec.msgpack.decode(msgspec.msgpack.encode(state)),
    )
    calls: list = []
    picked = dynamic_sample(ctx, rows, _waves({"r1", "b0", "f0", "f2", "f3"}, calls), SPEC)
    assert calls == [(0, ["r0", "r1", "r2", "r3"]), (1, ["b0", "f0", "f1", "f2", "f3"])]
    assert ctx.reduced == [{"total": 8, "valid": 2, "short": 2}, {"total": 11, "valid": 7, "short": 0}]
    assert [g.row.prompt for g in picked["trained"]] == ["r1", "b0", "f0", "f2"]
    assert picked["padded"] == [] and picked["surplus"] == 1 and picked["waves"] == 2
    assert ctx.state["dapo"]["expansion"] == pytest.approx(0.9 * 1.3 + 0.1 * 11 / 7)  # 1.32714...
    assert ctx.state["dapo"]["buffer"] == [{"prompt": "f3", "answer": "0", "images": []}]
    # the state is what the controller checkpoints: it survives msgpack
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(ctx.state)) == ctx.state


def test_still_short_after_the_last_wave_pads_with_masked_groups():
    """max_refill 1, alone (the peer adds nothing). Wave 0: r0 valid of 4: EMA 1.3; 5 prompts from two shard
    parts (f0..f3, g0; g1..g3 stay buffered). Wave 1: none valid: EMA 0.9 * 1.3 + 0.1 * 10 = 2.17. Waves are
    spent: r0 is trained, padded with the first invalid groups r1, r2, r3."""
    spec = DynamicSamplingSpec(max_refill=1)
    rows = [_row(f"r{i}") for i in range(4)]
    parts = [[_row(f"f{i}") for i in range(4)], [_row(f"g{i}") for i in range(4)]]
    zero = {"total": 0, "valid": 0, "short": 0}
    ctx = ScriptedContext(parts, [zero, zero])
    calls: list = []
    picked = dynamic_sample(ctx, rows, _waves({"r0"}, calls), spec)
    assert calls == [(0, ["r0", "r1", "r2", "r3"]), (1, ["f0", "f1", "f2", "f3", "g0"])]
    assert [g.row.prompt for g in picked["trained"]] == ["r0"]
    assert [g.row.prompt for g in picked["padded"]] == ["r1", "r2", "r3"]
    assert ctx.state["dapo"]["expansion"] == pytest.approx(2.17)
    assert [r["prompt"] for r in ctx.state["dapo"]["buffer"]] == ["g1", "g2", "g3"]


def test_a_full_controller_joins_the_peers_waves_with_empty_ones():
    """This controller is full after wave 0; its peer is short, so it runs an empty wave 1 (no generation,
    zero counts) to keep the collectives in step."""
    rows = [_row(f"r{i}") for i in range(2)]
    ctx = ScriptedContext([], [{"total": 2, "valid": 0, "short": 1}, {"total": 3, "valid": 2, "short": 0}])
    calls: list = []
    picked = dynamic_sample(ctx, rows, _waves({"r0", "r1"}, calls), SPEC)
    assert calls == [(0, ["r0", "r1"])]
    assert ctx.reduced[1] == {"total": 3, "valid": 2, "short": 0} and picked["waves"] == 2
    assert len(picked["trained"]) == 2 and picked["surplus"] == 0


def test_dapo_preset_and_config_errors(capsys, tmp_path):
    cfg = PRESETS["tiny_cpu_dapo"]()
    assert (cfg.app, cfg.judge, cfg.algo.clip_ratio_high, cfg.algo.loss_agg_mode) == (
        "dapo",
        None,
        0.28,
        "token-mean",
    )
    assert cfg.algo.overlong_buffer_len == 2 and cfg.algo.kl_loss_coef == 0.0
    run = ["--run-dir", str(tmp_path / "run")]
    assert main(["dapo", "--set", "dynamic_sampling.ema_decay=1.0", *run]) == 2
    assert "dynamic_sampling.ema_decay must be in [0, 1), got 1.0" in capsys.readouterr().err
    assert main(["dapo", "--set", "dynamic_sampling.safety=0.5", *run]) == 2
    assert "dynamic_sampling.safety and max_expansion must be >= 1" in capsys.readouterr().err


class SummingContext:
    """A test double of StepContext.all_reduce across controllers: adds the sums another controller would
    contribute (`peer`)."""

    def __init__(self, peer: dict[str, float]):
        self.peer = peer

    def all_reduce(self, values: dict[str, float]) -> dict[str, float]:
        return {k: v + self.peer.get(k, 0.0) for k, v in values.items()}


def test_ppo_whitening_spans_every_controller():
    """Two controllers' halves whitened together equal yatt_algos' masked_whiten of the whole batch."""
    torch = pytest.importorskip("torch")
    from yatt_algos.advantages import masked_whiten
    from yatt_apps.jobs.ppo import whiten_across

    adv = torch.tensor(
        [[0.0, 1.0, 2.0, 9.0], [3.0, -1.0, 0.0, 0.0], [4.0, 4.0, 1.0, 0.0], [0.5, 2.0, 0.0, 7.0]]
    )
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 0], [0, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    whole = masked_whiten(adv, mask, eps=1e-8)
    halves = []
    for mine, other in ((slice(0, 2), slice(2, 4)), (slice(2, 4), slice(0, 2))):
        theirs = torch.where(mask[other], adv[other], 0.0).double()
        peer = {"n": float(mask[other].sum()), "s": float(theirs.sum()), "ss": float(theirs.square().sum())}
        halves.append(whiten_across(SummingContext(peer), adv[mine], mask[mine]))
    assert torch.allclose(torch.cat(halves), whole, atol=1e-6)
    # hand-worked on one controller: tokens 1, 2, 3 -> mean 2, unbiased std 1 -> -1, 0, 1
    one = whiten_across(
        SummingContext({}), torch.tensor([[1.0, 2.0, 3.0]]), torch.ones(1, 3, dtype=torch.bool)
    )
    assert one[0].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-6)


def test_ppo_adaptive_kl_coefficient_follows_the_target_across_steps():
    """algo.kl_target > 0: the coefficient moves by 1 + clip(kl / target - 1, +-0.2) * n / horizon after each
    step and is carried in the controller's checkpointed state; kl_target 0 keeps kl_reward_coef."""
    from types import SimpleNamespace

    from yatt_apps.jobs.ppo import kl_coef, update_kl_coef

    base = PRESETS["tiny_cpu_ppo"]()
    algo = msgspec.structs.replace(base.algo, kl_reward_coef=0.01, kl_target=0.1, kl_horizon=100)
    cfg = msgspec.structs.replace(base, algo=algo)
    ctx = SimpleNamespace(state={})
    assert kl_coef(ctx, cfg) == 0.01
    update_kl_coef(ctx, cfg, 0.2, 10)  # KL twice the target: error clipped to +0.2 -> x (1 + 0.2 * 10 / 100)
    assert ctx.state["kl_coef"] == pytest.approx(0.0102, rel=1e-12)
    update_kl_coef(ctx, cfg, 0.09, 50)  # 0.9 of the target: error -0.1 -> x (1 - 0.1 * 50 / 100)
    assert kl_coef(ctx, cfg) == pytest.approx(0.0102 * 0.95, rel=1e-12)
    fixed = msgspec.structs.replace(cfg, algo=msgspec.structs.replace(algo, kl_target=0.0))
    still = SimpleNamespace(state={})
    update_kl_coef(still, fixed, 5.0, 10)
    assert still.state == {} and kl_coef(still, fixed) == 0.01


def test_ppo_preset_plans_a_critic_beside_the_actor(capsys):
    cfg = PRESETS["tiny_cpu_ppo"]()
    assert (cfg.app, cfg.algo.adv_estimator, cfg.algo.kl_reward_coef, cfg.judge) == ("ppo", "gae", 0.01, None)
    assert main(["plan", "--preset", "tiny_cpu_ppo", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    roles = {r["role"]: r["replicas"] for r in plan["roles"]}
    assert roles["critic"] == roles["actor"] == [[0], [1]]  # one critic rank per learner rank, same device


def test_critic_worker_fits_returns_and_round_trips_its_state(tmp_path):
    """The hosted critic (one rank, in process): repeated clipped value updates toward fixed returns
    (+1 on rows whose prompt starts with "1", -1 otherwise) cut the value loss more than tenfold; its
    checkpoint state restores the same values into a fresh worker."""
    torch = pytest.importorskip("torch")
    from yatt_apps.io.models import prepare_model
    from yatt_apps.jobs.ppo import CriticWorker
    from yatt_controller.types import WorkerInfo

    cfg = PRESETS["tiny_cpu_ppo"]()
    # a cold policy: a warm start would add 20 s and is not what this test is about
    cold = msgspec.structs.replace(cfg.model, warm_start="none", warm_start_steps=0)
    model_dir = str(prepare_model(cold, tmp_path / "policy", ["1 + 2 = 3", "2 + 2 = 4", "7 - 1 = 6"]))
    info = WorkerInfo(role="critic", dp_rank=0, dp_size=1)
    critic = CriticWorker(cfg, model_dir, 0, worker_info=info)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, critic.learner.model.config.vocab_size, (8, 10), generator=gen)
    ids[:, 0] = torch.tensor([5, 6] * 4)  # the "prompt" token that decides the return
    response = torch.zeros(8, 10, dtype=torch.bool)
    response[:, 5:] = True
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones(8, 10, dtype=torch.bool),
        "response_mask": response,
    }
    returns = torch.where(response, torch.tensor([1.0, -1.0] * 4).unsqueeze(-1), 0.0)
    losses = []
    for _ in range(25):
        values = critic.values(batch)
        losses.append(critic.train({**batch, "returns": returns, "old_values": values})["vf_loss"])
    assert losses[-1] < 0.1 * losses[0], losses
    state = critic.checkpoint_state()
    fresh = CriticWorker(cfg, model_dir, 0, worker_info=info)
    assert not torch.equal(fresh.values(batch), critic.values(batch))
    fresh.load_checkpoint_state(state)
    assert torch.equal(fresh.values(batch), critic.values(batch))


# ---- end to end (slow) -----------------------------------------------------------------------------------


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_dapo_runs_two_steps(yatt_cli, tmp_path):
    run_dir = tmp_path / "dapo"
    summary = yatt_cli(
        "dapo",
        "--run-dir",
        str(run_dir),
        "--set",
        "run.num_steps=2",
        "--set",
        "run.eval_every=0",
        "--set",
        "controller.count_driver_bytes=true",
    )
    assert summary["driver_bytes"] < 300_000 and summary["restarts"] == 0
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        # every controller ends with its 8 prompts' groups: valid ones trained, the shortfall padded
        assert row["dapo/trained_groups"] + row["dapo/padded_groups"] == 16
        assert 1 <= row["dapo/waves"] <= 4 and 1.0 <= row["dapo/expansion"] <= 10.0
        assert row["dapo/waves"] > 1 or row["dapo/padded_groups"] == 0  # refilled unless full at once
        assert row["train/num_skipped_steps"] == 0 and "time/rollout_reward" in row and "train/kl" not in row
        # rule rewards only: each rollout replica generates its prompts in one chunk, scored once it is done
        # (with a judge, two chunks, and judging starts before the rollout ends: test_placement_modes)
        assert row["time/judge_started_before_rollout_end"] == 0.0


def _comparable(row: dict) -> dict:
    """Everything but wall-clock figures."""
    return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}


# The learning runs add a constant reward term (an empty regex matches every response): returns near 1 that a
# fresh value head (outputs near 0) does not know, so a critic that learns shows a falling value loss. With the
# rule terms alone the tiny policy's returns are near 0 from the start and the loss sits at its noise floor.
# the critic's fit is measured from a policy built from scratch (no warm start), as before warm starts existed
PPO_LEARN = [
    "--set",
    "model.warm_start=none",
    "--set",
    "model.warm_start_steps=0",
    "--set",
    "run.eval_every=0",
    "--set",
    "controller.checkpoint_every=2",
    "--set",
    "rewards=[{kind: math_verify, weight: 1.0}, {kind: regex, name: format, weight: 0.5, options: "
    "{pattern: '^\\s*-?\\d+'}}, {kind: regex, name: offset, weight: 1.0, options: {pattern: ''}}]",
]


# the driver counts the bytes it receives only when asked (controller.count_driver_bytes)
COUNT_BYTES = ["--set", "controller.count_driver_bytes=true"]


@pytest.fixture(scope="module")
def ppo_run(yatt_cli, tmp_path_factory) -> Path:
    """8 PPO steps on the tiny preset (plus the offset term), fixed seed, a checkpoint every 2 steps."""
    run_dir = tmp_path_factory.mktemp("ppo") / "learn"
    summary = yatt_cli(
        "ppo",
        "--run-dir",
        str(run_dir),
        "--set",
        "run.num_steps=8",
        *PPO_LEARN,
        *COUNT_BYTES,
    )
    assert summary["driver_bytes"] < 300_000 and summary["restarts"] == 0
    return run_dir


@pytest.mark.slow
def test_ppo_critic_value_loss_falls(ppo_run):
    rows = _metrics(ppo_run)
    assert [r["step"] for r in rows] == list(range(8))
    first = rows[0]
    for key in (
        "critic/vf_loss",
        "critic/value_mean",
        "critic/return_mean",
        "ppo/kl_reward",
        "train/pg_loss",
        "train/kl",
        "reward/offset_mean",
        "time/logprobs",
        "time/train",
    ):
        assert key in first, key
    assert first["reward/offset_mean"] == 1.0
    loss = [r["critic/vf_loss"] for r in rows]
    start, end = sum(loss[:3]) / 3, sum(loss[-3:]) / 3
    assert end < 0.5 * start, loss
    assert abs(rows[-1]["critic/value_mean"] - rows[-1]["critic/return_mean"]) < 0.3, rows[-1]
