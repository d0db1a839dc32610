"""`yatt grpo-t2i`: text-to-image GRPO (Flow-GRPO, arXiv 2505.05470) on a flow-matching diffusion policy.

Each controller takes its shard of the step's prompts, asks the diffusion engine (`T2IRolloutWorker`) for
`sampling.n` images per prompt, each sampled with the SDE (noise level `t2i.eta`) from its own seed, and gets
back the images and the trained steps' latents and log-probabilities, chunk by chunk; each chunk's images go
to the reward service (`T2IRewardWorker`, `runtime/t2i_rewards.py`) while later chunks are sampled. The
reward is the LLM jobs' weighted sum over `rewards:` (same config shape), with image kinds: the pixel rule of
the embedded task (`colour_position`: the named colour in the named half), the CLIP-style Bradley-Terry image
reward model (`image_rm`) and the VLM judge on prompt-image consistency (`genrm`, with `judge:` a Qwen2-VL
model: K verdicts, statuses and parse counts). The reward role is placed as the LLM jobs' (`policy_roles`):
`reward` on the rollout engines' devices, or `genrm` on its own with a judge. Then group advantages over each
prompt's images with the configured estimator (`algo.adv_estimator`, default GRPO), and the learner rank
(`T2ILearnerWorker`) takes the clipped GRPO step on each trained denoising step
(`yatt_algos.learner.diffusion`); then the weights go to the engines. Images and latents travel between a
controller and its workers only: in parallel mode no image passes through the driver.

Every `run.eval_every` steps and at the last, before the step's update: the validation prompts are sampled
with fixed seeds and scored by the reward service (`val/reward` and `val/reward/<term>_mean`, over every
controller), and controller 0 writes a grid of its validation images to RUN_DIR/images/step-NNNNNN.png, to
TensorBoard and, with `log.wandb`, to W&B (`runtime/t2i_images.py`). On the last step the trained pipeline is
written to RUN_DIR/final as a diffusers folder (`load_t2i` or diffusers' SD3 loaders read it); `yatt export`
writes one from any checkpoint.

Data: `data.train` (jsonl or parquet, one prompt per row under `data.prompt_key`) or, when empty, the
embedded task's prompts ("a red square on the left"); every prompt must name a colour and a side (the rule
reward's task), checked row by row before anything starts.
"""

from __future__ import annotations

import hashlib
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from yatt_algos.types import AlgoConfig, OptimConfig
from yatt_multimodal.types import RewardSpec
from yatt_rollout.types import SamplingParams

from yatt_apps.config import ControllerSpec, DataSpec, ModelSpec, RunConfig, RunSpec, _Config
from yatt_apps.io.data import PromptRow
from yatt_apps.runtime.job import JobDef, StepFn, ValRows, policy_roles
from yatt_apps.runtime.phases import learner_of, sample_seed, sync_weights

if TYPE_CHECKING:
    from yatt_controller.controller import StepContext
    from yatt_controller.runner import Services
    from yatt_controller.worker_group import HostPool
    from yatt_placement.types import PlacementPlan, RoleSpec

    from yatt_apps.runtime.t2i_images import ValidationImages

VAL_SEED = 10_000  # validation prompts and their noise: the run's seed + this
TINY_FORMAT = 2  # bump when the tiny pipeline's build changes: its cache key includes it


class T2iSpec(_Config, frozen=True, kw_only=True):
    """The diffusion policy and its sampling. `path`: a diffusers SD3-style pipeline folder or hub id; ""
    builds the tiny one from the `tiny_*` keys (cached under $YATT_CACHE_DIR like the warm-started LLMs)."""

    path: str = ""  # a diffusers SD3-style pipeline folder or hub id; "": the tiny one built from tiny_*
    image_size: int = 16  # pixels per side; a multiple of 4 for the tiny pipeline (VAE /2, patch 2)
    num_steps: int = 6  # denoising steps per image
    eta: float = 1.0  # SDE noise level (> 0 to train; the original system's DiT uses 0.3 at 16 steps)
    shift: float = 3.0  # time shift of the sigma schedule
    guidance_scale: float = 1.0  # classifier-free guidance (1: off)
    num_train_steps: int = 0  # the first K denoising steps are trained; 0: all
    images_dir: str = ""  # where validation grids go; "": RUN_DIR/images (set by prepare)
    final_dir: str = ""  # the trained pipeline (diffusers folder) at the last step; "": RUN_DIR/final
    tensorboard_dir: str = ""  # where validation images go as TensorBoard images; "": RUN_DIR/tb (the run's)
    wandb_dir: str = ""  # with log.wandb: where the validation images' W&B run writes; "": RUN_DIR
    tiny_hidden_size: int = 64  # the tiny DiT's width
    tiny_num_layers: int = 2  # the tiny DiT's joint transformer blocks
    tiny_vae_steps: int = 200  # the tiny VAE's autoencoder pretraining on two-colour images (0: random)

    def __post_init__(self) -> None:
        if self.image_size < 4 or self.image_size % 4:
            raise ValueError(f"t2i.image_size must be a positive multiple of 4, got {self.image_size}")
        if self.eta <= 0:
            raise ValueError(
                f"t2i.eta must be > 0 (eta 0 is the deterministic sampler: nothing to train), got {self.eta}"
            )
        if not 0 <= self.num_train_steps <= self.num_steps:
            raise ValueError(
                f"t2i.num_train_steps must be in [0, t2i.num_steps={self.num_steps}], got {self.num_train_steps}"
            )
        if self.guidance_scale < 1:
            raise ValueError(f"t2i.guidance_scale must be >= 1 (1: no guidance), got {self.guidance_scale}")


class T2iConfig(RunConfig, frozen=True, kw_only=True):
    """`yatt grpo-t2i`: the shared keys and the diffusion policy's."""

    app: str = "grpo-t2i"
    t2i: T2iSpec = T2iSpec()  # the diffusion policy and its SDE sampling


def tiny_cpu_t2i() -> T2iConfig:
    """`yatt grpo-t2i` on the embedded colour/position task: a tiny SD3-style pipeline (16x16 images, 4 latent
    channels, a 2-layer DiT of width 64, a 2-layer CLIP text encoder, a VAE pretrained for 200 steps on
    two-colour images), 6 SDE steps at eta 1, 8 prompts x 8 images per step over two controllers, constant
    lr 3e-3, clip 0.2, no KL; validation on 32 prompts (each colour x side pair twice) every 5 steps. One
    reward term, the pixel rule (weight 1), in the `reward` role beside each engine: the tiny image reward
    model and VLM judge are built untrained, so on this task they would only add noise to the advantages
    (and the judge ~1 s a step); add them with `rewards:` and `judge:` (README). Measured: see README
    (Text-to-image GRPO)."""
    return T2iConfig(
        model=ModelSpec(),  # launch's placeholder tokenizer model: the policy is t2i.path's pipeline
        judge=None,  # a VLM judge: judge=ModelSpec(arch="qwen2_vl") and a rewards term of kind genrm
        # the pixel rule drives learning; the tiny image RM and judge are random (no signal on this task)
        rewards=[RewardSpec(kind="colour_position", weight=1.0)],
        run=RunSpec(name="t2i-tiny", num_steps=60, prompts_per_step=8, eval_every=5),
        data=DataSpec(num_train_rows=512, num_val_rows=32),
        sampling=SamplingParams(n=8),
        algo=AlgoConfig(adv_estimator="grpo", clip_ratio_low=0.2, clip_ratio_high=0.2),
        # a constant learning rate (min_lr_ratio 1), as Flow-GRPO; cosine decay to 0 halved the rise in 30 steps
        optim=OptimConfig(
            lr=3e-3, min_lr_ratio=1.0, num_training_steps=60, micro_batch_size=32, clip_grad_norm=1.0
        ),
        controller=ControllerSpec(
            num_controllers=2, checkpoint_every=10, keep_checkpoints=2, hang_timeout_s=300.0
        ),
        t2i=T2iSpec(),
    )


# ---- data --------------------------------------------------------------------------------------------------


def load_prompts(path: str, key: str) -> list[PromptRow]:
    """One prompt per row of a jsonl or parquet file (field `key`, a non-empty string naming a colour and a
    side: the rule reward's task); anything else is a ValueError naming the file, line or row, and field."""
    from yatt_multimodal.image_rules import parse_colour_prompt

    from yatt_apps.io.records import read_records

    rows = []
    for where, raw in read_records(path, parquet_where="{path}: row {n} (1-based)"):
        if not isinstance(raw, dict) or key not in raw:
            raise ValueError(f"{where}: missing field {key!r} (one prompt per row)")
        prompt = raw[key]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{where}: field {key!r} must be a non-empty string, got {prompt!r}")
        try:
            parse_colour_prompt(prompt)
        except ValueError as err:
            raise ValueError(f"{where}: field {key!r}: {err}") from None
        rows.append(PromptRow(prompt=prompt, answer=""))
    return rows


def train_rows(cfg: T2iConfig) -> list[PromptRow]:
    """The training prompts: `data.train`'s rows, or the embedded task's (`data.num_train_rows`, the seed)."""
    from yatt_multimodal.image_rules import colour_prompts

    data = cfg.data
    if not data.train:
        return [
            PromptRow(prompt=p, answer="") for p in colour_prompts(data.num_train_rows, seed=cfg.run.seed)
        ]
    return load_prompts(data.train, data.prompt_key)


def val_prompts(cfg: T2iConfig) -> list[str]:
    """The validation prompts: `data.val`'s rows, or `data.num_val_rows` of the embedded task's, every
    (colour, side) pair in turn (balanced: 32 rows hold each of the 16 pairs twice)."""
    from yatt_multimodal.image_rules import every_colour_prompt

    data = cfg.data
    if not data.val:
        pairs = every_colour_prompt()
        return [pairs[i % len(pairs)] for i in range(data.num_val_rows)]
    return [r.prompt for r in load_prompts(data.val, data.prompt_key)]


# ---- the pipeline folder -----------------------------------------------------------------------------------


def _tiny_key(cfg: T2iConfig, corpus: list[str]) -> str:
    """The cache key of the tiny pipeline: its shape, seed and the text its tokenizer is trained on (a run on
    other prompts gets a tokenizer that knows them)."""
    spec = cfg.t2i
    parts = (
        TINY_FORMAT,
        spec.image_size,
        spec.tiny_hidden_size,
        spec.tiny_num_layers,
        spec.tiny_vae_steps,
        cfg.run.seed,
        hashlib.sha256("\n".join(corpus).encode()).hexdigest(),
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def tiny_pipeline(cfg: T2iConfig, out: Path) -> Path:
    """`out` holds the tiny pipeline: copied from the cache ($YATT_CACHE_DIR/t2i-KEY), or built (tokenizer
    trained on the embedded task's prompts and the training rows) and cached first; both writes atomic."""
    from yatt_multimodal.image_rules import colour_prompts
    from yatt_rollout.diffusion_models import save_t2i, tiny_t2i

    from yatt_apps.runtime.warmstart import cache_root, store

    if (out / "model_index.json").is_file():
        return out
    corpus = colour_prompts(512, seed=0) + [r.prompt for r in train_rows(cfg)[:2048]]
    cached = cache_root() / f"t2i-{_tiny_key(cfg, corpus)}"
    if not (cached / "model_index.json").is_file():
        spec = cfg.t2i
        policy = tiny_t2i(
            corpus,
            image_size=spec.image_size,
            hidden_size=spec.tiny_hidden_size,
            num_layers=spec.tiny_num_layers,
            vae_steps=spec.tiny_vae_steps,
            seed=cfg.run.seed,
        )
        store(cached, lambda tmp: save_t2i(policy, tmp))  # atomic; another run's equal entry wins
    tmp = out.with_name(f"{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(cached, tmp)
    tmp.rename(out)
    return out


def prepare(cfg: T2iConfig, run_dir: Path) -> T2iConfig:
    """The config the run uses: `t2i.path` the pipeline folder (the tiny one built into RUN_DIR/models/t2i),
    `t2i.images_dir` and `t2i.final_dir` absolute; the validation rows checked here."""
    spec = cfg.t2i
    if spec.path:
        from yatt_apps.io.model_sources import resolve_model_dir

        folder = resolve_model_dir(spec.path, key="t2i.path", marker="model_index.json").resolve()
    else:
        folder = tiny_pipeline(cfg, run_dir / "models" / "t2i")
    images = Path(spec.images_dir).resolve() if spec.images_dir else run_dir / "images"
    final = Path(spec.final_dir).resolve() if spec.final_dir else run_dir / "final"
    tb = Path(spec.tensorboard_dir).resolve() if spec.tensorboard_dir else run_dir / "tb"
    wandb_dir = Path(spec.wandb_dir).resolve() if spec.wandb_dir else run_dir.resolve()
    spec = msgspec.structs.replace(
        spec,
        path=str(folder),
        images_dir=str(images),
        final_dir=str(final),
        tensorboard_dir=str(tb),
        wandb_dir=str(wandb_dir),
    )
    cfg = msgspec.structs.replace(cfg, t2i=spec)
    val_prompts(cfg)  # a bad validation row fails here, before anything starts
    return cfg


# ---- the step ----------------------------------------------------------------------------------------------


def _advantages(cfg: T2iConfig, rewards: Any, group_ids: Any) -> Any:
    """Group advantages [B] with the configured estimator (each image one 'token'); `group_ids` [B] the
    prompt of each kept image."""
    import torch
    from yatt_algos.advantages import compute_advantages

    adv, _ = compute_advantages(
        rewards[:, None].float(), torch.ones(len(rewards), 1), cfg.algo, group_ids=group_ids
    )
    return adv[:, 0]


class T2iStep:
    """The step function every controller runs (`t2i_step`), holding controller 0's image writers."""

    def __init__(self, cfg: T2iConfig) -> None:
        from yatt_apps.runtime.t2i_images import ValidationImages

        self.cfg, self.images = cfg, ValidationImages(cfg)

    def __call__(self, ctx: StepContext, rows: list[PromptRow]) -> dict[str, float]:
        return t2i_step(ctx, rows, cfg=self.cfg, images=self.images)


def _validate(ctx: StepContext, cfg: T2iConfig, images: ValidationImages) -> dict[str, float]:
    """This controller's share of the validation prompts, fixed seeds, scored by the reward service: sums
    under val/; controller 0's images to every sink."""
    from yatt_apps.runtime.t2i_rewards import agreement_sums, reward_sums, rollout_and_score

    prompts = val_prompts(cfg)
    mine = list(range(ctx.rank, len(prompts), ctx.world_size))
    if not mine:
        return {"val/reward_sum": 0.0, "val/count": 0.0}
    seeds = [cfg.run.seed + VAL_SEED + i for i in mine]
    out, scored = rollout_and_score(ctx, [prompts[i] for i in mine], seeds, f"val-s{ctx.step}-c{ctx.rank}")
    if ctx.rank == 0:
        images.write(out["images"][:16], ctx.step, last=ctx.step == cfg.run.num_steps - 1)
    kept = [i for i, k in enumerate(scored["keep"]) if k]
    return {
        "val/reward_sum": float(sum(scored["scores"][i] for i in kept)),
        "val/count": float(len(kept)),
        **reward_sums(scored, kept, prefix="val/"),
        **agreement_sums(cfg.rewards, [scored["sample_components"][i] for i in kept], prefix="val/"),
    }


def t2i_step(
    ctx: StepContext, rows: list[PromptRow], *, cfg: T2iConfig, images: ValidationImages
) -> dict[str, float]:
    """One GRPO step of this controller (module doc); metrics summed over controllers, then means."""
    import torch

    from yatt_apps.runtime.step_metrics import evaluates
    from yatt_apps.runtime.t2i_rewards import agreement_sums, reward_sums, rollout_and_score

    sums: dict[str, float] = {}
    if evaluates(ctx.step, cfg.run.num_steps, cfg.run.eval_every):
        with ctx.phase("eval"):
            sums |= _validate(ctx, cfg, images)
    n = cfg.sampling.n
    prompts = [row.prompt for row in rows for _ in range(n)]
    base = sample_seed(cfg, ctx)
    with ctx.phase("rollout_reward"):  # each chunk's images scored while later chunks are sampled
        out, scored = rollout_and_score(
            ctx, prompts, [base + i for i in range(len(prompts))], f"s{ctx.step}-c{ctx.rank}"
        )
    with ctx.phase("advantages"):  # the failure policy's dropped images leave the batch
        kept = [i for i, k in enumerate(scored["keep"]) if k]
        if not kept:
            raise ValueError(
                f"step {ctx.step}: every image of controller {ctx.rank} failed its reward "
                f"(statuses {sorted(set(scored['statuses']))}); see the reward terms' errors"
            )
        rewards = torch.tensor([scored["scores"][i] for i in kept])
        advantages = _advantages(cfg, rewards, torch.tensor([i // n for i in kept]))
    fields = ("latents", "next_latents", "old_logprobs", "sigmas", "next_sigmas", "embeds", "pooled")
    batch = {k: out[k][kept] for k in fields}
    batch["advantages"] = advantages.numpy()
    with ctx.phase("train"):  # SPMD: every learner rank of this controller steps together
        stats = ctx.get(learner_of(ctx).shard_rows("update", batch))[0]
    with ctx.phase("weight_sync"):
        sync_weights(ctx)
    if ctx.step == cfg.run.num_steps - 1:
        with ctx.phase("export"):
            ctx.get(learner_of(ctx).broadcast("export", cfg.t2i.final_dir))
    stream = scored["stream"]  # this controller's engines; the controllers' rates add up
    sums |= {
        "reward_sum": float(rewards.sum()),
        "images": float(len(kept)),
        "images_dropped": float(len(prompts) - len(kept)),
        "images_per_s": len(prompts) / max(stream["rollout_s"], 1e-9),
        **{f"stream/{k}": v for k, v in stream.items()},
        **reward_sums(scored, kept),
        **agreement_sums(cfg.rewards, [scored["sample_components"][i] for i in kept]),
    }
    return _means(ctx.all_reduce(sums), stats, ctx.world_size)


def _means(total: dict[str, float], stats: dict[str, float], world_size: int) -> dict[str, float]:
    """The step's metrics from the controllers' sums: reward means over the kept images, per-term and judge
    figures (`t2i_rewards.reward_means`), validation figures over the validation images, the learner's."""
    from yatt_apps.runtime.t2i_rewards import reward_means

    metrics = {
        "reward/mean": total["reward_sum"] / max(total["images"], 1.0),
        "samples_dropped": total["images_dropped"],
        "t2i/images_per_s": total["images_per_s"],
        "train/loss": stats["loss"],
        "train/grad_norm": stats["grad_norm"],
        "train/lr": stats["lr"],
        "train/clip_frac": stats.get("clip_frac", 0.0),
        **reward_means(total, total["images"]),
        **{
            "time/" + {"overlap_s": "rollout_reward_overlap_s"}.get(k[7:], k[7:]): v / max(world_size, 1)
            for k, v in total.items()
            if k.startswith("stream/")
        },
    }
    if total.get("val/count"):
        metrics["val/reward"] = total["val/reward_sum"] / total["val/count"]
        metrics |= reward_means(total, total["val/count"], prefix="val/")
    return metrics


def export(run: Any, cfg: T2iConfig) -> Path | None:
    """RUN_DIR/final as launch would report it: this job writes its diffusers folder itself at its last step
    (`T2ILearnerWorker.export`), so there is nothing to convert; the folder, or None when the run has not
    reached its last step. The job's `export` hook (launch's default, `export_final`, reads causal-LM learner
    checkpoints)."""
    final = Path(cfg.t2i.final_dir) if cfg.t2i.final_dir else Path(run.path) / "final"
    return final if (final / "model_index.json").is_file() else None


def step_function(cfg: T2iConfig, policy_dir: str, val_rows: ValRows, plan: PlacementPlan) -> StepFn:
    check(cfg)
    return T2iStep(cfg)


def check(cfg: T2iConfig) -> None:
    """Image rewards only (`image_reward_specs.check_image_specs`), a judge model exactly when a `genrm` term
    reads it (served by the HF engine: it reads images), the diffusion learner's settings."""
    from yatt_multimodal.image_reward_specs import check_image_specs

    check_image_specs(cfg.rewards)
    judged = any(spec.kind == "genrm" for spec in cfg.rewards)
    if cfg.judge is not None and not judged:
        raise ValueError(
            "judge is set but no rewards term of kind 'genrm' uses it: add one, or set judge to null"
        )
    if cfg.judge is not None and cfg.judge.engine != "hf":
        raise ValueError(
            f"judge.engine={cfg.judge.engine!r}: grpo-t2i's VLM judge reads images through the HF engine; set it to 'hf'"
        )
    if cfg.learner.backend != "ddp" or cfg.model.tensor_parallel > 1 or cfg.model.pipeline_parallel > 1:
        raise ValueError(
            "grpo-t2i trains with its diffusion learner: learner.backend ddp, no tensor/pipeline parallel"
        )
    if cfg.algo.max_staleness:
        raise ValueError("grpo-t2i trains on-policy: algo.max_staleness must be 0")
    if cfg.sampling.n < 2 and cfg.algo.adv_estimator == "grpo":
        raise ValueError("grpo-t2i: sampling.n must be >= 2 (GRPO compares the images of one prompt)")


def roles(cfg: T2iConfig) -> list[RoleSpec]:
    """The LLM jobs' roles (`policy_roles`): the trained policy (actor), its diffusion engine (rollout) and
    the reward service: `genrm` on devices of its own with a judge model, else `reward` on the rollout's."""
    return policy_roles(cfg)


def build(
    pool: HostPool, *, cfg: T2iConfig, policy_dir: str, judge_dir: str, plan: PlacementPlan
) -> Services:
    """The learner ranks, the engines with the weight sync between them, and the reward service."""
    from yatt_controller.runner import Services
    from yatt_controller.sync import WeightSync
    from yatt_controller.worker_group import WorkerGroup

    from yatt_apps.runtime.job import reward_role
    from yatt_apps.runtime.t2i_rewards import T2IRewardWorker
    from yatt_apps.runtime.t2i_workers import T2ILearnerWorker, T2IRolloutWorker

    key = f"yatt-t2i-{uuid.uuid4().hex}"  # this attempt's learner rendezvous
    actor = WorkerGroup.create(
        pool, "actor", T2ILearnerWorker, args=(cfg, policy_dir, key), pass_worker_info=True, lock="learner"
    )
    rollout = WorkerGroup.create(
        pool,
        "rollout",
        T2IRolloutWorker,
        args=(cfg, policy_dir),
        kwargs={"shared_device": plan.shares_device("rollout", "actor")},
        pass_worker_info=True,
    )
    role = reward_role(cfg)
    reward = WorkerGroup.create(
        pool,
        role,
        T2IRewardWorker,
        args=(cfg, judge_dir),
        kwargs={"shared_device": plan.shares_device(role, "actor")},
        pass_worker_info=True,
    )
    sync = WeightSync(actor, [rollout], mode="auto", backend="auto")
    groups = {"actor": actor, "rollout": rollout, "reward": reward}
    return Services(groups=groups, learner="actor", weight_sync=sync)


JOB = JobDef(
    name="grpo-t2i",
    help="text-to-image GRPO (Flow-GRPO) on a flow-matching diffusion policy; writes a diffusers folder",
    preset=tiny_cpu_t2i,
    step=step_function,
    config=T2iConfig,
    roles=roles,
    build=build,
    check=check,
    prepare=prepare,
    dataset=train_rows,
    export=export,
)
