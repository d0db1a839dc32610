"""`yatt distill`: on-policy distillation. The student (the trained policy) samples; a frozen teacher scores
every sampled token; each token's advantage is -(log p_student - log p_teacher), the negative per-token reverse
KL estimate (`yatt_algos.distill`), optionally plus `distill.reward_coef` x the task reward; the update is the
RL jobs' clipped importance-ratio policy loss (`phases.train_policy`), then the versioned weight push.

`distill_step` is the whole step, run by every controller on its own shard of prompts: n completions per
prompt streamed, chunk by chunk, into the teacher's service (`runtime.teacher.TeacherWorker`: the rule terms
and the teacher's token log-probs from its own HF forward), the teacher's advantages, the SPMD update, the push.

The teacher is a role of the placement like a GenRM judge (role `genrm`, named `teacher`): colocated with
every role, on its own devices (disaggregated), or on the complement of the rollout's devices (partial), where
rollout streams into it while it still generates. It is served from the judge's slot of the run's config
(`serve_teacher` copies `distill.teacher` there), so the run's model preparation builds or resolves it like a
judge: a tiny teacher is warm-started on the task and cached (`runtime.warmstart`, kind "policy") next to the
tiny student, with the same tokenizer. Student and teacher tokenizers are checked to match before any worker
starts (`teacher.check_tokenizers`).

Metrics: `distill/reverse_kl` (per-token mean of log p_student - log p_teacher over the sampled tokens),
`distill/teacher_logprob` (per-token mean), `val/accuracy` (the student's greedy accuracy, as every RL job) and
`val/teacher_accuracy` (the teacher's, measured once per controller process: the teacher is frozen).
"""

from __future__ import annotations

import functools
import uuid
from typing import TYPE_CHECKING, Literal

import msgspec
from yatt_algos.types import AlgoConfig, OptimConfig
from yatt_multimodal.types import RewardSpec

from yatt_apps.config import ModelSpec, RunConfig, _Config, _tiny_base, as_config
from yatt_apps.io.data import PromptRow
from yatt_apps.runtime.job import JobDef, StepFn, ValRows, num_params, policy_roles
from yatt_apps.runtime.phases import (
    kept_batch,
    old_logprobs,
    push_weights,
    rollout_and_score,
    sleep_engines,
    tokenizer,
    train_policy,
)
from yatt_apps.runtime.step_metrics import maybe_evaluate, sample_sums, summarize
from yatt_apps.runtime.teacher import TeacherAccuracy, teacher_tensor

if TYPE_CHECKING:
    from pathlib import Path

    from yatt_controller.controller import StepContext
    from yatt_controller.runner import Services
    from yatt_controller.worker_group import HostPool
    from yatt_placement.types import PlacementPlan, RoleSpec

TEACHER = "teacher"  # the teacher's role key in the plan (a `genrm` role by kind: placed like a judge)

# the tiny preset's teacher: twice the student's width, warm-started on the task for longer (cached): greedy
# validation accuracy 0.75, 0.63 sampled at temperature 1 (0.65-0.76 from 1200 to 1500 steps at lr 3e-3: noisier)
TINY_TEACHER = ModelSpec(
    seed=1,
    hidden_size=128,
    num_heads=4,
    num_kv_heads=1,
    warm_start="policy",
    warm_start_steps=1000,
    warm_start_lr=2e-3,
    warm_start_batch_size=64,
)


class DistillSpec(_Config, frozen=True, kw_only=True):
    """On-policy distillation: the teacher that scores the student's tokens, and the task reward's share."""

    # the teacher model (an HF folder or hub id with the student's tokenizer; path empty: a tiny one, as
    # `model`); served by an HF engine in the teacher role's own process
    teacher: ModelSpec = TINY_TEACHER
    # advantage = -(log p_student - log p_teacher) + reward_coef x the task reward (`rewards`); 0: pure distillation
    reward_coef: float = 0.0
    # subtract the mean advantage over each controller's batch of response tokens (a constant baseline)
    baseline: bool = True
    # the teacher's logits are divided by this before its log-probs (1: its own distribution; < 1: sharper)
    teacher_temperature: float = 1.0
    # 0: the KL term is the per-token advantage -(log p_student - log p_teacher) of the sampled token (policy
    # gradient). k > 0: it is a loss of its own instead, the exact reverse KL at every response position between
    # the student's next-token distribution and the teacher's k most likely tokens plus one bucket for the rest
    # (`yatt_algos.distill_topk`; the teacher sends k + 1 log-probs per token); the advantages keep only the task
    # reward's share. Torch learners (ddp, fsdp2); k < the vocabulary size
    topk: int = 0
    # with topk: reverse, KL(student || teacher) (the sampled estimate's objective, mode-seeking), or forward,
    # KL(teacher || student) (cross-entropy on the teacher's soft labels at the student's prefixes; GKD's beta 0)
    topk_divergence: Literal["reverse", "forward"] = "reverse"

    def __post_init__(self) -> None:
        if not self.teacher_temperature > 0:
            raise ValueError(f"distill.teacher_temperature must be > 0, got {self.teacher_temperature}")
        if self.topk < 0:
            raise ValueError(f"distill.topk must be >= 0 (0: the sampled-token estimate), got {self.topk}")


class DistillConfig(RunConfig, frozen=True, kw_only=True):
    """`yatt distill`: the shared keys and the teacher (the `judge` key holds it while a run is live: leave it
    null)."""

    app: str = "distill"
    distill: DistillSpec = DistillSpec()


def tiny_cpu_distill() -> DistillConfig:
    """`yatt distill` on the embedded task: the shared tiny Qwen2 policy (warm-started 700 steps: greedy
    validation accuracy about 0.50) distils a twice-wider tiny teacher warm-started for longer (0.75; both
    shipped). The KL term is the dense one (`distill.topk` 16: the exact per-position reverse KL over the
    teacher's 16 most likely tokens and a tail bucket, `yatt_algos.distill_topk`), pure distillation
    (reward_coef 0; the exact-answer rule is scored as a metric), token-mean, two updates per batch at lr 5e-4,
    no KL to a reference, 32 prompts x 8 samples per step, 60 steps, greedy accuracy on 256 validation rows
    (64 rows are +-0.05 of noise). Measured (`bench_jobs.py --quick`, seed 0, a loaded 2-core machine): reverse
    KL 0.75 -> 0.16 nats/token (-79%, first and last three steps), greedy accuracy 0.50 -> 0.61, sampled
    accuracy 0.35 -> 0.44, the teacher 0.75. Tried (session 10; the job unless "replica": a single-process
    copy of the step): the sampled-token estimate (distill.topk 0) with this student cut the reverse KL 44% in
    30 steps but left greedy accuracy flat (0.48 -> 0.47) and at lr 1e-3 made it worse (0.50 -> 0.33 by step
    10); the dense loss at lr 2e-3 diverged (reverse KL 0.55 -> 2.8); the forward KL
    (distill.topk_divergence) did no better than the reverse one (replica: -12% vs -22% KL, greedy -0.004 vs
    +0.02 in 30 steps). Session 9's 400-step student (0.22) stayed flat whatever the lr, reward coefficient or
    teacher temperature."""
    base = _tiny_base()
    return as_config(
        DistillConfig,
        base,
        run=msgspec.structs.replace(
            base.run, name="distill-tiny", num_steps=60, prompts_per_step=32, eval_every=10
        ),
        judge=None,
        data=msgspec.structs.replace(base.data, num_val_rows=256),
        sampling=msgspec.structs.replace(base.sampling, n=8),
        rewards=[RewardSpec(kind="math_verify", weight=1.0)],
        algo=AlgoConfig(loss_agg_mode="token-mean", kl_loss_coef=0.0, num_updates_per_batch=2),
        optim=OptimConfig(
            lr=5e-4, num_warmup_steps=2, num_training_steps=60, micro_batch_size=32, clip_grad_norm=1.0
        ),
        distill=DistillSpec(teacher=TINY_TEACHER, topk=16),
    )


def distill_step(
    ctx: StepContext,
    rows: list[PromptRow],
    *,
    cfg: DistillConfig,
    policy_dir: str,
    val_rows: ValRows,
    plan: PlacementPlan,
    teacher_accuracy: TeacherAccuracy,
) -> dict[str, float]:
    """One distillation step on this controller's `rows`; returns metrics already reduced over controllers."""
    import torch
    from yatt_algos.distill import reverse_kl_advantages, reverse_kl_sums

    from yatt_apps.jobs.grpo import logprobs_and_train, old_logprobs_from_update, rollout_logprobs

    tok = tokenizer(policy_dir)
    topk = cfg.distill.topk
    with ctx.phase("rollout_teacher"):  # completions streamed into the teacher, chunk by chunk
        prompt_ids, scored = rollout_and_score(ctx, cfg, rows, tok, method="score_and_teach", token_ids=True)
    sums = maybe_evaluate(ctx, val_rows, cfg, tok)  # the student that generated this step's samples
    if "val/total" in sums:
        sums |= teacher_accuracy.of(ctx, val_rows, cfg, tok)
    sleep_engines(ctx, cfg, plan)  # full colocation: the engines (the teacher's too) give the devices back

    with ctx.phase("advantages"):
        kept, samples, batch = kept_batch(scored, prompt_ids, tok)
        student = rollout_logprobs(batch, samples)  # the sampling policy's log-probs [B, T]
        teacher = teacher_tensor(batch, [scored.extra["teacher_logprobs"][i] for i in kept])
        reward = torch.tensor([scored.scores[i] for i in kept], dtype=torch.float32)
        advantages = reverse_kl_advantages(
            student,
            teacher,
            batch["response_mask"],
            reward=reward,
            reward_coef=cfg.distill.reward_coef,
            baseline=cfg.distill.baseline,
            kl_coef=0.0 if topk else 1.0,  # top-k: the KL is the learner's dense loss, not an advantage
        )
        dense = {  # [B, T, k] and [B, T, k + 1]: what the student's learner matches at every response token
            f"teacher_topk_{key}": teacher_tensor(
                batch, [scored.extra[f"teacher_topk_{key}"][i] for i in kept]
            )
            for key in (("ids", "values") if topk else ())
        }

    with ctx.phase("train"):  # SPMD: every learner rank updates together (gradient all-reduce)
        if old_logprobs_from_update(cfg) and not topk:  # one optimizer step: the update's forward gives them
            experience = {**batch, "advantages": advantages, "rollout_logprobs": student}
            lp, stats = logprobs_and_train(ctx, experience)
        else:
            lp, rollout_lp = old_logprobs(ctx, batch, samples)
            stats = train_policy(ctx, batch, lp, rollout_lp, advantages, **dense)

    push_weights(ctx, cfg, plan)  # version v+1 to every rollout replica; all controllers wait

    sums |= sample_sums(scored, kept, len(rows), batch["response_mask"], lp, student)
    sums |= {f"distill/{k}": v for k, v in reverse_kl_sums(student, teacher, batch["response_mask"]).items()}
    total = ctx.all_reduce(sums)
    out = summarize(total, stats, ctx.world_size)
    tokens = max(total["distill/num_tokens"], 1.0)
    out["distill/reverse_kl"] = total["distill/reverse_kl_sum"] / tokens
    out["distill/teacher_logprob"] = total["distill/teacher_logprob_sum"] / tokens
    if total.get("val/teacher_total"):
        out["val/teacher_accuracy"] = total["val/teacher_correct"] / total["val/teacher_total"]
    return out


def step_function(cfg: DistillConfig, policy_dir: str, val_rows: ValRows, plan: PlacementPlan) -> StepFn:
    """The step every controller runs; first the tokenizer check (in the driver, before any worker starts)."""
    from yatt_apps.runtime.teacher import check_tokenizers, teacher_dir

    check(cfg)
    check_plan(plan)
    check_tokenizers(policy_dir, teacher_dir(cfg, policy_dir))
    return functools.partial(
        distill_step,
        cfg=cfg,
        policy_dir=policy_dir,
        val_rows=val_rows,
        plan=plan,
        teacher_accuracy=TeacherAccuracy(),
    )


def roles(cfg: DistillConfig) -> list[RoleSpec]:
    """The student (actor) and its rollout engine, as every RL job, and the teacher: a `genrm` role named
    `teacher`, so the planner places it as a judge (partial: on the devices the rollout leaves)."""
    from yatt_placement.types import RoleSpec

    teacher = cfg.distill.teacher
    student = [spec for spec in policy_roles(cfg) if spec.role in ("actor", "rollout")]
    return [*student, RoleSpec(role="genrm", name=TEACHER, num_params=num_params(teacher))]


def build(
    pool: HostPool, *, cfg: DistillConfig, policy_dir: str, judge_dir: str, plan: PlacementPlan
) -> Services:
    """`actor` (the student's learner), `rollout` (its engine, fed by weight pushes) and `reward` (the
    `TeacherWorker` on the teacher role's devices)."""
    from yatt_controller.runner import Services
    from yatt_controller.sync import WeightSync
    from yatt_controller.worker_group import WorkerGroup

    from yatt_apps.runtime.teacher import StudentWorker, TeacherWorker
    from yatt_apps.runtime.workers import RolloutWorker

    key = f"yatt-actor-{uuid.uuid4().hex}"  # this attempt's learner rendezvous (a restart gets a new one)
    actor = WorkerGroup.create(
        pool, "actor", StudentWorker, args=(cfg, policy_dir, key), pass_worker_info=True, lock="learner"
    )
    rollout = WorkerGroup.create(
        pool,
        "rollout",
        RolloutWorker,
        args=(cfg, policy_dir),
        kwargs={"shared_device": plan.shares_device("rollout", "actor")},
        pass_worker_info=True,
    )
    teacher = WorkerGroup.create(
        pool,
        "genrm",
        TeacherWorker,
        name=TEACHER,
        args=(cfg, judge_dir, policy_dir),
        kwargs={
            "temperature": cfg.distill.teacher_temperature,
            "topk": cfg.distill.topk,
            "shared_device": plan.shares_device(TEACHER, "actor"),
        },
    )
    sync = WeightSync(actor, [rollout], mode="auto", backend="auto")  # NCCL where the workers have CUDA
    return Services(
        groups={"actor": actor, "rollout": rollout, "reward": teacher}, learner="actor", weight_sync=sync
    )


def check(cfg: DistillConfig) -> None:
    """What `yatt distill` cannot run, each naming its keys."""
    teacher = cfg.distill.teacher
    if cfg.judge is not None and cfg.judge != teacher:
        raise ValueError(
            "distill serves distill.teacher in the judge's slot: set distill.teacher and leave judge null"
        )
    if teacher.engine != "hf" or teacher.tensor_parallel != 1 or teacher.pipeline_parallel != 1:
        raise ValueError(
            "distill.teacher is served by an HF engine on one device: set distill.teacher.engine=hf, "
            "tensor_parallel=1 and pipeline_parallel=1"
        )
    if not teacher.path and cfg.model.path:
        raise ValueError(
            "distill.teacher.path is empty (a tiny teacher with a tokenizer trained on the task) but "
            "model.path is set: the student's tokenizer cannot match; give distill.teacher.path a model of "
            "the student's family"
        )
    if cfg.model.arch == "qwen2_vl" or teacher.arch == "qwen2_vl" or cfg.rollout.env:
        raise ValueError("distill distils text policies on single-turn prompts (model.arch, rollout.env)")
    if cfg.distill.reward_coef and not cfg.rewards:
        raise ValueError("distill.reward_coef is set but rewards is empty: add the task's reward terms")
    if cfg.distill.topk and (cfg.learner.backend == "megatron" or cfg.algo.routing_replay != "off"):
        raise ValueError(
            "distill.topk > 0 (the dense loss) runs on torch learners without routing replay: set "
            "learner.backend to ddp or fsdp2 and algo.routing_replay=off, or distill.topk=0"
        )


def check_plan(plan: PlacementPlan) -> None:
    """The placements distill runs in: colocated, partial and disaggregated. A movable plan (dynamic) is
    refused: re-partitioning the rollout/teacher split live is not verified for this job."""
    if plan.movable:
        raise ValueError(
            "distill moves no devices between steps: set placement.mode to colocated, partial or disaggregated"
        )


def serve_teacher(cfg: DistillConfig, run_dir: Path) -> DistillConfig:
    """The config the run uses: `distill.teacher` in the judge's slot, so the run's model preparation builds
    (a tiny one, warm-started and cached) or resolves it and hands its folder to `build` as `judge_dir`."""
    check(cfg)
    return msgspec.structs.replace(cfg, judge=cfg.distill.teacher)


JOB = JobDef(
    name="distill",
    help="on-policy distillation: the student samples, a frozen teacher scores every token (reverse KL)",
    preset=tiny_cpu_distill,
    step=step_function,
    config=DistillConfig,
    roles=roles,
    build=build,
    check=check,
    prepare=serve_teacher,
)
