"""`yatt dpo`: offline preference training (DPO, IPO, hinge) on prompt/chosen/rejected pairs, a YATT job like
`yatt sft`: no rollout in training, a trained policy and a frozen reference.

Each controller takes its shard of the step's pairs, renders both responses after the prompt's chat template,
and its learner rank (`DPOWorker`) first runs the frozen reference once over the batch (a separate no-grad
forward: per-token log-probs, summed per sequence over the response tokens), then takes one optimizer step of
the mean pair loss (`yatt_algos.dpo.dpo_loss`) through the yatt-algos torch learner's engine: the same data
parallel group (DDP or FSDP2), micro-batching (a pair is one row, so its two sequences share a micro-batch and
a single forward), clipping, LR schedule and LoRA as the RL updates. The reference is a full frozen copy of the
starting policy in the learner's process (with LoRA too), re-read from the model folder on restart, so a
checkpoint holds only the policy learner's state.

Metrics (means over every pair of the step, all controllers): `dpo/loss`, `dpo/rewards_chosen`,
`dpo/rewards_rejected` (beta x log-ratio to the reference), `dpo/margin` (their difference), `dpo/accuracy`
(chosen reward above rejected, a tie counting half: 0.5 at the first step, where the policy is the reference
and every reward is 0; TRL counts ties wrong, which would read 0 there), `dpo/nll`
(the chosen response's mean token NLL, the RPO term), measured on the training forward (before its step).
Every `run.eval_every` steps and at the last, before the step's update (as `yatt grpo` evaluates: the policy
the step starts from, so step 0 shows the reference itself, accuracy 0.5 and margin 0, and the starting
policy's generation accuracy): the same on the validation pairs under `val/dpo/...` (no grad), and
`val/accuracy`, the greedy generation accuracy (math_verify) on the validation prompts with reference answers,
through a rollout engine fed the weights.

Data: `dpo.train` (jsonl or parquet, `yatt_apps.io.pref_data`), or, when empty, the embedded arithmetic task's
pairs (chosen the correct answer, rejected a wrong or badly formatted one). Validation pairs: `dpo.val`, or the
embedded task's when `dpo.train` is empty. Generation accuracy: `data.val` (prompt/answer rows) if given, else
the validation pairs' prompts with their `answer` (the embedded task's: the correct one).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec
from yatt_algos.types import AlgoConfig, OptimConfig
from yatt_rollout.types import SamplingParams

from yatt_apps.config import DataSpec, RunConfig, _Config, _tiny_base, as_config
from yatt_apps.io.data import PromptRow, load_rows
from yatt_apps.io.pref_data import PrefRow, arithmetic_pairs, load_pref_rows, pair_batch
from yatt_apps.jobs import sft
from yatt_apps.jobs.sft import SFTWorker
from yatt_apps.runtime.job import JobDef, StepFn, ValRows
from yatt_apps.runtime.phases import learner_of, sync_weights

if TYPE_CHECKING:
    from yatt_controller.controller import StepContext
    from yatt_placement.types import PlacementPlan

METRICS = (
    "loss",
    "rewards_chosen",
    "rewards_rejected",
    "margin",
    "nll",
)  # per-pair means; accuracy from `correct`
VAL_SEED = 10_000  # the embedded validation pairs: the run's seed + this, as the other jobs' validation split


class DpoSpec(_Config, frozen=True, kw_only=True):
    """`yatt dpo`'s data and loss: preference pairs (jsonl or parquet; prompt a string or chat-message list,
    responses strings or one assistant message); empty `train` uses the embedded task's pairs."""

    train: str = ""  # a .jsonl or .parquet file of prompt/chosen/rejected rows; "": the embedded task's pairs
    val: str = ""  # validation pairs (same format); "": the embedded task's when train is empty, else none
    prompt_key: str = "prompt"  # the column holding the prompt (a string or a list of chat messages)
    chosen_key: str = "chosen"  # the column holding the preferred response
    rejected_key: str = "rejected"  # the column holding the dispreferred response
    # the loss on h = (log-ratio of chosen) - (log-ratio of rejected), sequence log-probs summed over response
    # tokens: sigmoid (DPO, -log sigma(beta h)), ipo ((h - 1/(2 beta))^2), hinge (relu(1 - beta h))
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    beta: float = 0.1  # the KL strength: DPO/hinge's temperature, IPO's tau
    # probability that a preference label is flipped: (1 - eps) L(h) + eps L(-h) (cDPO for sigmoid), in [0, 0.5)
    label_smoothing: float = 0.0
    # RPO (Pang et al. 2024, TRL's rpo_alpha): add alpha x the chosen response's mean token NLL to each pair's
    # loss, keeping the chosen likelihood from falling with the rejected one (0: plain DPO/IPO/hinge)
    rpo_alpha: float = 0.0

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ValueError(f"dpo.beta must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.rpo_alpha < 0:
            raise ValueError(f"dpo.rpo_alpha must be >= 0, got {self.rpo_alpha}")


class DpoConfig(RunConfig, frozen=True, kw_only=True):
    """`yatt dpo`: the shared keys and the preference data and loss."""

    app: str = "dpo"
    dpo: DpoSpec = DpoSpec()


def tiny_cpu_dpo() -> DpoConfig:
    """`yatt dpo` on the embedded task: the warm-started tiny Qwen2 policy of `tiny_cpu` (and its frozen copy as
    the reference), DPO (sigmoid, beta 0.5) with the RPO term (rpo_alpha 1) on 32 pairs per step over two
    controllers (data parallel), chosen the correct answer and rejected a near miss, a sign slip, an echoed
    operand or a badly formatted answer; preference and greedy generation accuracy on 128 validation pairs
    every 5 steps. Measured (seed 0, 30 steps; each evaluation before its step's update): val/dpo/accuracy 0.5
    (the reference: every pair a tie, counted half) -> 0.70 at step 5 -> 0.83 at step 29, val/dpo/margin 0 ->
    0.50 -> 1.19, val/accuracy 0.51 (the warm start) -> 0.61. Plain DPO (rpo_alpha 0) raised the preference
    accuracy as much but lowered the greedy accuracy (0.53 -> 0.45 in 20 steps in a single-process trial): it
    pushes the chosen answers' likelihood down with the rejected ones'. `bench_jobs.py --quick` (20 steps,
    every step evaluated; the same figures twice, at load 12 and 3 on 2 cores): 0.5 -> 0.648 after one update
    -> 0.766 at step 19 (rise 0.27, 0.12 from step 1), val/accuracy 0.555 -> 0.672, 156 s and 104 s. A
    single-process sweep (lr 2e-3 or 3e-3, beta 0.2 or 1, 64 pairs per step, 2000 training pairs, rpo_alpha
    0.5) did no better: higher lr lowered the greedy accuracy (0.555 -> 0.35), rpo_alpha 0.5 reached 0.83
    preference but 0.60 greedy accuracy, the others were within the 128 pairs' noise (+-0.04)."""
    base = _tiny_base()
    return as_config(
        DpoConfig,
        base,
        run=msgspec.structs.replace(
            base.run, name="dpo-tiny", num_steps=30, prompts_per_step=32, eval_every=5
        ),
        judge=None,
        rewards=[],
        data=DataSpec(num_val_rows=128),
        sampling=SamplingParams(n=1, temperature=0.0, max_new_tokens=6),  # validation generation only
        algo=AlgoConfig(),
        optim=OptimConfig(
            lr=1e-3, num_warmup_steps=2, num_training_steps=30, micro_batch_size=32, clip_grad_norm=1.0
        ),
        dpo=DpoSpec(beta=0.5, rpo_alpha=1.0),
    )


def train_rows(cfg: DpoConfig) -> list[PrefRow]:
    """The training pairs: the user's file, or the embedded task's (`data.num_train_rows`, the run's seed)."""
    spec = cfg.dpo
    if not spec.train:
        return arithmetic_pairs(cfg.data.num_train_rows, seed=cfg.run.seed)
    return load_pref_rows(
        spec.train, prompt_key=spec.prompt_key, chosen_key=spec.chosen_key, rejected_key=spec.rejected_key
    )


def val_pairs(cfg: DpoConfig) -> list[PrefRow]:
    """The validation pairs: `dpo.val`, else the embedded task's when training on it, else none."""
    spec = cfg.dpo
    if spec.val:
        return load_pref_rows(
            spec.val, prompt_key=spec.prompt_key, chosen_key=spec.chosen_key, rejected_key=spec.rejected_key
        )
    return [] if spec.train else arithmetic_pairs(cfg.data.num_val_rows, seed=cfg.run.seed + VAL_SEED)


def generation_rows(cfg: DpoConfig) -> list[PromptRow]:
    """Prompts with reference answers for the greedy accuracy: `data.val`, else the validation pairs'."""
    data = cfg.data
    if data.val:
        return load_rows(data.val, prompt_key=data.prompt_key, answer_key=data.answer_key)
    return [PromptRow(prompt=p.prompt, answer=p.answer) for p in val_pairs(cfg) if not p.messages]


def _pair_means(total: dict[str, float], sums: str, out: str) -> dict[str, float]:
    """`OUT/...` means from the summed `SUMS/...` pair sums (`preference_sums` and the chosen NLL)."""
    pairs = total.get(f"{sums}/pairs", 0.0)
    if not pairs:
        return {}
    means = {f"{out}/{k}": total[f"{sums}/{k}"] / pairs for k in METRICS}
    return means | {f"{out}/accuracy": total[f"{sums}/correct"] / pairs}


def _summed(results: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """One controller's learner ranks' pair sums added, as `PREFIX/...` (a single controller's view may hold
    several ranks)."""
    return {f"{prefix}/{k}": sum(r[k] for r in results) for k in ("pairs", "correct", *METRICS)}


def dpo_step(
    ctx: StepContext,
    rows: list[PrefRow],
    *,
    cfg: DpoConfig,
    policy_dir: str,
    pairs: Any,
    gen_rows: ValRows,
) -> dict[str, float]:
    """One DPO step on this controller's `rows` (the reference forward, then one optimizer step); first, every
    `run.eval_every` steps and at the last, the validation pairs' metrics and the greedy accuracy of the policy
    the step starts from. Metrics are sums all-reduced over controllers, then means."""
    from yatt_apps.runtime.phases import tokenizer
    from yatt_apps.runtime.step_metrics import evaluate, evaluates

    tok = tokenizer(policy_dir)
    sums: dict[str, float] = {}
    # validation first, as `yatt grpo` does: the policy this step starts from (at step 0 the reference itself)
    if evaluates(ctx.step, cfg.run.num_steps, cfg.run.eval_every):
        mine = pairs()[ctx.rank :: ctx.world_size]
        if mine:
            with ctx.phase("eval_pairs"):
                val = pair_batch(tok, mine, cfg.data.system_prompt)
                sums |= _summed(ctx.get(learner_of(ctx).shard_rows("dpo_eval", val)), "val_pairs")
        elif pairs():  # fewer validation pairs than controllers: this one adds zeros (same keys everywhere)
            sums |= _summed([dict.fromkeys(("pairs", "correct", *METRICS), 0.0)], "val_pairs")
        if gen_rows is not None and "rollout" in ctx.services:
            with ctx.phase(
                "weight_sync"
            ):  # FSDP2: streamed one bucket at a time (SFTWorker's LearnerWeights)
                sync_weights(ctx)
            with ctx.phase("eval"):
                sums |= evaluate(ctx, gen_rows, cfg, tok)
    with ctx.phase("tokenize"):
        batch = pair_batch(tok, rows, cfg.data.system_prompt)
    with ctx.phase("train"):  # SPMD: every learner rank of this controller steps together (all-reduce)
        results = ctx.get(learner_of(ctx).shard_rows("dpo", batch))
    sums |= _summed(results, "pairs")
    total = ctx.all_reduce(sums)
    stats = results[0]
    out = {"train/loss": stats["train_loss"], "train/lr": stats["lr"], "train/grad_norm": stats["grad_norm"]}
    out |= _pair_means(total, "pairs", "dpo") | _pair_means(total, "val_pairs", "val/dpo")
    if total.get("val/total"):
        out["val/accuracy"] = total["val/correct"] / total["val/total"]
    return out


def with_absolute_data(cfg: DpoConfig, run_dir: Path) -> DpoConfig:
    """`dpo.train` and `dpo.val` made absolute (the workers may start in another directory)."""

    def absolute(path: str) -> str:
        return str(Path(path).resolve()) if path else ""

    spec = msgspec.structs.replace(cfg.dpo, train=absolute(cfg.dpo.train), val=absolute(cfg.dpo.val))
    cfg = msgspec.structs.replace(cfg, dpo=spec)
    val_pairs(cfg), generation_rows(cfg)  # a bad validation row fails here, before anything starts
    return cfg


def check(cfg: DpoConfig) -> None:
    if cfg.data.train:
        raise ValueError("dpo reads its pairs from dpo.train (prompt/chosen/rejected rows), not data.train")
    if cfg.judge is not None or cfg.rewards:
        raise ValueError("dpo trains on preference pairs, not rewards: set judge to null and rewards to []")
    if cfg.model.pipeline_parallel > 1 or cfg.learner.backend == "megatron":
        raise ValueError(
            "dpo trains with the torch learner: learner.backend ddp or fsdp2, pipeline_parallel 1"
        )
    if cfg.model.arch == "qwen2_vl":
        raise ValueError("dpo trains on text pairs: model.arch qwen2_vl is not supported")


def step_function(cfg: DpoConfig, policy_dir: str, val_rows: ValRows, plan: PlacementPlan) -> StepFn:
    """The step every controller runs; validation pairs and generation rows are read where they are used."""
    check(cfg)
    gen = functools.partial(generation_rows, cfg) if cfg.run.eval_every else None
    # its rows are PrefRows (this job's `dataset`), which carry the `prompt` a PromptRow has
    return functools.partial(
        dpo_step, cfg=cfg, policy_dir=policy_dir, pairs=functools.partial(val_pairs, cfg), gen_rows=gen
    )


def pair_forward(
    model: Any, mb: dict[str, Any], *, chunk_size: int, score_prompt: bool = True
) -> dict[str, Any]:
    """Per-token log-probs [b, t] of the chosen and the rejected sequences of a micro-batch of pairs, in one
    forward of the 2b sequences (0 outside each sequence's response; `score_prompt=False`: the output
    projection runs at the responses' positions only)."""
    import torch
    from yatt_algos.learner.torch_backend import causal_lm_forward

    both = {
        "input_ids": torch.cat([mb["input_ids"], mb["rejected_input_ids"]]),
        "attention_mask": torch.cat([mb["chosen_attention_mask"], mb["rejected_attention_mask"]]),
        "response_mask": torch.cat([mb["chosen_response_mask"], mb["rejected_response_mask"]]),
    }
    # temperature 1: the data's likelihood, not a sampling distribution
    out = causal_lm_forward(model, both, chunk_size=chunk_size, score_prompt=score_prompt)
    chosen, rejected = out["logprobs"].chunk(2)
    return {
        "chosen_logprobs": chosen * mb["chosen_response_mask"],
        "rejected_logprobs": rejected * mb["rejected_response_mask"],
    }


class DPOWorker(SFTWorker):
    """One data-parallel rank of the DPO learner: the policy (the yatt-algos torch learner's engine: DDP/FSDP2
    group, micro-batches, clipping, schedule, LoRA) and a frozen full copy of the starting policy as the
    reference. Export and checkpoints are SFTWorker's (the policy learner's state; the reference is re-read)."""

    def __init__(self, cfg: DpoConfig, model_dir: str, key: str, *, worker_info: Any) -> None:
        import torch

        from yatt_apps.runtime.learner_weights import LearnerWeights
        from yatt_apps.runtime.workers import (
            _torch_learners,
            join_learner_group,
            learner_backend,
            set_threads,
        )

        set_threads(cfg)
        torch.manual_seed(cfg.run.seed)
        group = join_learner_group(worker_info, key)
        algo = msgspec.structs.replace(cfg.algo, num_updates_per_batch=1)  # one pass per batch, as TRL
        one_pass = msgspec.structs.replace(cfg, algo=algo)
        self.learner, self.reference = _torch_learners(one_pass, model_dir, group, reference=True)
        self.model_dir, self.dp_rank, self.trust = model_dir, worker_info.dp_rank, cfg.model.trust_remote_code
        self.spec = cfg.dpo
        self.weights = LearnerWeights(
            self.learner, learner_backend(cfg)
        )  # what a weight push reads (SFTWorker's)

    def _forward(self):
        cfg = self.learner.engine.learner
        chunk, score_prompt = cfg.logits_chunk_size, cfg.score_prompt_tokens
        return lambda model, mb, grad: pair_forward(model, mb, chunk_size=chunk, score_prompt=score_prompt)

    def _reference_logps(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The reference's per-token log-probs [B, T] of both sequences, one no-grad forward per micro-batch."""
        out = self.reference.engine.infer(batch, self._forward(), self.reference.micro_batch_size)
        return {
            "ref_chosen_logprobs": out["chosen_logprobs"],
            "ref_rejected_logprobs": out["rejected_logprobs"],
        }

    def _loss(self, out: dict[str, Any], mb: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
        """Per-pair preference losses, rewards and chosen mean token NLL [b] of a micro-batch from its per-token
        log-probs (summed here over each response)."""
        from yatt_algos.dpo import dpo_loss

        chosen_mask = mb["chosen_response_mask"]
        losses, chosen, rejected = dpo_loss(
            out["chosen_logprobs"].sum(-1),
            out["rejected_logprobs"].sum(-1),
            (mb["ref_chosen_logprobs"] * chosen_mask).sum(-1),
            (mb["ref_rejected_logprobs"] * mb["rejected_response_mask"]).sum(-1),
            beta=self.spec.beta,
            loss_type=self.spec.loss_type,
            label_smoothing=self.spec.label_smoothing,
        )
        nll = -out["chosen_logprobs"].sum(-1) / chosen_mask.sum(-1).clamp(min=1)
        return losses, chosen, rejected, nll

    def _sums(self, losses: Any, chosen: Any, rejected: Any, nll: Any) -> dict[str, float]:
        from yatt_algos.dpo import preference_sums

        return {**preference_sums(losses, chosen, rejected), "nll": float(nll.detach().sum())}

    def dpo(self, batch: dict[str, Any]) -> dict[str, float]:
        """The reference forward, then one optimizer step on this rank's pairs: loss = mean over all ranks'
        pairs of (preference loss + rpo_alpha x chosen NLL). Returns this rank's pair sums (from the training
        forward, before the step) and the engine's global loss, grad norm and learning rate."""
        import torch

        batch = {**batch, **self._reference_logps(batch), "row_index": torch.arange(len(batch["input_ids"]))}
        seen = [torch.zeros(len(batch["input_ids"])) for _ in range(4)]  # _loss's four [B] values per pair
        alpha = self.spec.rpo_alpha

        def objective(out: dict[str, Any], mb: dict[str, Any], norm: Any) -> tuple[Any, dict]:
            values = self._loss(out, mb)
            real = mb["response_mask"].any(-1)  # False on FSDP2's filler rows
            rows = mb["row_index"][real].cpu()
            for store, value in zip(seen, values, strict=True):
                store[rows] = value[real].detach().float().cpu()
            per_pair = values[0] + alpha * values[3] if alpha else values[0]
            return (per_pair * real).sum() / max(norm.num_seqs, 1.0), {}

        self.weights.release()  # the weights change
        stats = self.learner.engine.update(batch, self._forward(), objective, ("response_mask",))
        return {**self._sums(*seen), "train_loss": stats.loss, "grad_norm": stats.grad_norm, "lr": stats.lr}

    def dpo_eval(self, batch: dict[str, Any]) -> dict[str, float]:
        """This rank's pair sums on validation pairs (policy and reference no-grad forwards)."""
        policy = self.learner.engine.infer(batch, self._forward(), self.learner.micro_batch_size)
        return self._sums(*self._loss(policy, {**batch, **self._reference_logps(batch)}))


JOB = JobDef(
    name="dpo",
    help="offline preference training (DPO, IPO, hinge) on prompt/chosen/rejected pairs; writes an HF folder",
    preset=tiny_cpu_dpo,
    step=step_function,
    config=DpoConfig,
    roles=sft.roles,  # the trained policy (its frozen reference in its process) and the evaluating engine
    build=functools.partial(sft.build, worker_cls=DPOWorker),
    check=check,
    prepare=with_absolute_data,
    dataset=train_rows,
)
