"""`yatt sft`: supervised fine-tuning on prompt/response rows, as a YATT job like the RL ones.

Each controller takes its shard of the step's rows, renders them with the policy tokenizer's chat template
(`data.system_prompt` as the system turn), and its learner rank (`SFTWorker`) takes one optimizer step of the
mean token NLL over the response tokens only, through the yatt-algos torch learner's engine: the same data
parallel group (DDP or FSDP2), micro-batching, gradient clipping and LR schedule as the RL updates. On the
last step the job writes `RUN_DIR/final`, an HF folder (config, safetensors, the policy's tokenizer) that
`AutoModelForCausalLM.from_pretrained` loads.

Data: `sft.train` (jsonl or parquet, `sft.prompt_key` / `sft.response_key`; or multi-turn rows in TRL's chat
format, `{"messages": [...], "tools": [...]}` with `tool_calls` and `tool` messages, the loss on the assistant
turns only: `io.sft_data`), or, when empty, worked answers of the embedded arithmetic task (prompt "a + b =",
response the answer), so `yatt sft` runs out of the box. Inside the job an SFT row travels as a `PromptRow`
whose `answer` is the response (a chat row as its subclass `ChatRow`).
"""

from __future__ import annotations

import functools
import io
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from yatt_apps.config import SftConfig, tiny_cpu_sft
from yatt_apps.io.data import PromptRow, arithmetic_task
from yatt_apps.io.sft_data import (
    ChatRow,
    chat_messages,
    encode_conversation,
    encode_pair,
    load_sft_rows,
    pad_masked,
)
from yatt_apps.runtime.job import JobDef, StepFn, ValRows
from yatt_apps.runtime.phases import learner_of, sync_weights

if TYPE_CHECKING:
    from yatt_controller.controller import StepContext
    from yatt_controller.runner import Services
    from yatt_controller.worker_group import HostPool
    from yatt_placement.types import PlacementPlan


def train_rows(cfg: SftConfig) -> list[PromptRow]:
    """The SFT rows as PromptRows (answer = the response): the user's file, or the embedded task's answers."""
    if not cfg.sft.train:
        return arithmetic_task(cfg.data.num_train_rows, seed=cfg.run.seed)
    rows = load_sft_rows(cfg.sft.train, prompt_key=cfg.sft.prompt_key, response_key=cfg.sft.response_key)
    return [r if isinstance(r, ChatRow) else PromptRow(prompt=r.prompt, answer=r.response) for r in rows]


def sft_batch(tok: Any, rows: list[PromptRow], system_prompt: str) -> dict[str, Any]:
    """Padded input_ids / attention_mask / response_mask [B, T] of rows (prompt = chat template with its
    generation prompt, response = the assistant turn through its eos; a chat row: its assistant turns)."""
    examples = []
    for r in rows:
        if isinstance(r, ChatRow):
            examples.append(encode_conversation(tok, r.messages, r.tools, system_prompt))
        else:
            prompt, response = encode_pair(tok, chat_messages(system_prompt, r.prompt), r.answer)
            examples.append((prompt + response, [0] * len(prompt) + [1] * len(response)))
    return pad_masked(examples, tok.pad_token_id)


def sft_step(
    ctx: StepContext, rows: list[PromptRow], *, cfg: SftConfig, policy_dir: str, val_rows: ValRows
) -> dict[str, float]:
    """One SFT step on this controller's `rows`; metrics reduced over controllers. The run's RUN_DIR/final is
    exported from the last step's checkpoint (yatt_apps.runtime.launch.export_final), as for every job."""
    from yatt_apps.runtime.phases import tokenizer
    from yatt_apps.runtime.step_metrics import evaluate, evaluates

    tok = tokenizer(policy_dir)
    with ctx.phase("tokenize"):
        batch = sft_batch(tok, rows, cfg.data.system_prompt)
    with ctx.phase("train"):  # SPMD: every learner rank of this controller steps together (all-reduce)
        stats = ctx.get(learner_of(ctx).shard_rows("sft", batch))[0]
    # every `run.eval_every` steps and the last one (step_metrics.evaluates)
    needs_rollout = val_rows is not None and evaluates(ctx.step, cfg.run.num_steps, cfg.run.eval_every)
    if needs_rollout and "rollout" in ctx.services:
        with ctx.phase("weight_sync"):  # FSDP2: streamed one bucket at a time, as in the RL jobs
            sync_weights(ctx)
        with ctx.phase("eval"):
            sums = evaluate(ctx, val_rows, cfg, tok)
    else:
        sums = {}
    sums["sft/tokens"] = float(batch["response_mask"].sum())
    total = ctx.all_reduce(sums)
    out = {
        "train/loss": stats["loss"],
        "train/lr": stats["lr"],
        "train/grad_norm": stats["grad_norm"],
        "sft/tokens": total["sft/tokens"],
    }
    if total.get("val/total"):
        out["val/accuracy"] = total["val/correct"] / total["val/total"]
    return out


def with_absolute_data(cfg: SftConfig, run_dir: Path) -> SftConfig:
    """`sft.train` made absolute (the workers may start in another directory)."""
    train = str(Path(cfg.sft.train).resolve()) if cfg.sft.train else ""
    return msgspec.structs.replace(cfg, sft=msgspec.structs.replace(cfg.sft, train=train))


def check(cfg: SftConfig) -> None:
    if cfg.judge is not None or cfg.rewards:
        raise ValueError("sft trains on responses, not rewards: set judge to null and rewards to []")
    if cfg.model.pipeline_parallel > 1:
        raise ValueError("sft trains with the torch learner: model.pipeline_parallel must be 1")
    if cfg.data.train:  # the RL jobs' key: ignoring it would train on the embedded task without a word
        raise ValueError(
            f"data.train={cfg.data.train!r}: yatt sft reads prompt/response rows from sft.train "
            "(keys sft.prompt_key, sft.response_key); data.train is the RL jobs' prompt/answer data"
        )


def step_function(cfg: SftConfig, policy_dir: str, val_rows: ValRows, plan: PlacementPlan) -> StepFn:
    check(cfg)
    return functools.partial(sft_step, cfg=cfg, policy_dir=policy_dir, val_rows=val_rows)


def roles(cfg: SftConfig) -> list:
    """The actor (the trained policy; `yatt dpo`'s frozen reference rides in the same process) and, when the
    run evaluates, a rollout engine for greedy accuracy."""
    from yatt_placement.types import RoleSpec

    from yatt_apps.runtime.job import num_params

    policy = num_params(cfg.model)
    tp = cfg.model.tensor_parallel
    out = [RoleSpec(role="actor", num_params=policy, trainable=True, tensor_parallel=tp)]
    if cfg.run.eval_every:
        out.append(RoleSpec(role="rollout", num_params=policy, tensor_parallel=tp))
    return out


def build(
    pool: HostPool,
    *,
    cfg: SftConfig,
    policy_dir: str,
    judge_dir: str,
    plan: PlacementPlan,
    worker_cls: Any = None,
) -> Services:
    """The SFT job's services: the SFT learner ranks (`worker_cls`, default SFTWorker; `yatt dpo` passes its
    subclass), and the rollout engine that evaluates (if any)."""
    from yatt_controller.runner import Services
    from yatt_controller.sync import WeightSync
    from yatt_controller.worker_group import WorkerGroup

    from yatt_apps.runtime.workers import RolloutWorker

    key = f"yatt-{cfg.app}-{uuid.uuid4().hex}"  # this attempt's learner rendezvous
    cls = worker_cls or SFTWorker
    actor = WorkerGroup.create(
        pool, "actor", cls, args=(cfg, policy_dir, key), pass_worker_info=True, lock="learner"
    )
    if not cfg.run.eval_every:
        return Services(groups={"actor": actor}, learner="actor")
    rollout = WorkerGroup.create(
        pool,
        "rollout",
        RolloutWorker,
        args=(cfg, policy_dir),
        kwargs={"shared_device": plan.shares_device("rollout", "actor")},
        pass_worker_info=True,
    )
    return Services(
        groups={"actor": actor, "rollout": rollout},
        learner="actor",
        weight_sync=WeightSync(actor, [rollout], mode="auto", backend="auto"),
    )


def _sft_objective(out: dict[str, Any], mb: dict[str, Any], norm) -> tuple[Any, dict[str, Any]]:
    """This micro-batch's share of the mini-batch's mean response-token NLL (global token count in `norm`)."""
    mask = mb["response_mask"]
    loss = -(out["logprobs"] * mask).sum() / max(norm.num_tokens, 1.0)
    return loss, {}


class SFTWorker:
    """One data-parallel rank of the SFT learner: the yatt-algos torch learner's engine (DDP/FSDP2 group,
    micro-batches, clipping, schedule) with the masked NLL as its objective, one update per batch."""

    def __init__(self, cfg: SftConfig, model_dir: str, key: str, *, worker_info: Any) -> None:
        import msgspec
        import torch
        from yatt_algos.learner.torch_backend import TorchPolicyLearner

        from yatt_apps.io.models import load_causal_lm
        from yatt_apps.runtime.learner_weights import LearnerWeights
        from yatt_apps.runtime.workers import join_learner_group, learner_backend, set_threads

        set_threads(cfg)
        torch.manual_seed(cfg.run.seed)
        group = join_learner_group(worker_info, key)
        algo = msgspec.structs.replace(cfg.algo, num_updates_per_batch=1)  # SFT: one pass per batch
        self.model_dir, self.dp_rank = model_dir, worker_info.dp_rank
        self.learner = TorchPolicyLearner(
            load_causal_lm(model_dir, trust_remote_code=cfg.model.trust_remote_code),
            algo=algo,
            optim_config=cfg.optim,
            learner=cfg.learner,
            group=group,
        )
        self.trust = cfg.model.trust_remote_code
        self.weights = LearnerWeights(self.learner, learner_backend(cfg))  # what a weight push reads

    def sft(self, batch: dict[str, Any]) -> dict[str, float]:
        """One optimizer step on this rank's batch: loss = mean NLL over all ranks' response tokens."""
        from yatt_algos.learner.torch_backend import causal_lm_forward

        cfg = self.learner.engine.learner
        chunk, score_prompt = cfg.logits_chunk_size, cfg.score_prompt_tokens

        def forward(model, mb, grad):  # temperature 1: the data's likelihood, not a sampling distribution
            return causal_lm_forward(model, mb, chunk_size=chunk, temperature=1.0, score_prompt=score_prompt)

        self.weights.release()  # the weights change
        stats = self.learner.engine.update(batch, forward, _sft_objective, ("response_mask",))
        return {
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "lr": stats.lr,
            "num_tokens": float(stats.num_tokens),
        }

    # a validation push (`phases.sync_weights`): under FSDP2 every rank gathers one bucket at a time
    def gather_weights(self) -> int:
        return self.weights.gather_all()

    def next_weight_bucket(self, bucket_bytes: int) -> int:
        return self.weights.next_bucket(bucket_bytes)

    def named_weights(self) -> Any:
        return self.weights.named_weights()

    def save_hf(self, out_dir: str) -> str:
        """Write the trained weights as an HF folder (model config and tokenizer from the starting model),
        atomically (tmp + rename). Every rank exports; data-parallel rank 0 writes."""
        import shutil

        from yatt_apps.io.models import load_causal_lm, load_tokenizer

        named = {name: t for bucket in self.learner.export_weights(64 << 20) for name, t in bucket}
        if self.dp_rank != 0:
            return ""
        out = Path(out_dir)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model = load_causal_lm(self.model_dir, trust_remote_code=self.trust)
        model.load_state_dict(named, strict=False)  # tied embeddings export once; strict on what is there
        model.save_pretrained(tmp)
        load_tokenizer(self.model_dir, trust_remote_code=self.trust).save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.replace(out)
        return str(out)

    def checkpoint_state(self) -> bytes:
        import torch

        buf = io.BytesIO()
        torch.save(self.learner.state_dict(), buf)
        return buf.getvalue()

    def load_checkpoint_state(self, data: bytes) -> None:
        import torch

        self.weights.release()
        self.learner.load_state_dict(torch.load(io.BytesIO(data), weights_only=True))

    # the sharded checkpoint protocol (as PolicyWorker's): each rank writes its own DCP shards
    def save_checkpoint_shards(self, folder: str, background: bool) -> None:
        self.learner.save_shards(folder, background=background)

    def finish_checkpoint_shards(self) -> dict[str, tuple[str, int]]:
        return self.learner.wait_shards()

    def load_checkpoint_shards(self, folder: str) -> None:
        self.weights.release()
        self.learner.load_shards(folder)


JOB = JobDef(
    name="sft",
    help="supervised fine-tuning on prompt/response rows (loss on the response); writes an HF folder",
    preset=tiny_cpu_sft,
    step=step_function,
    config=SftConfig,
    roles=roles,
    build=build,
    check=check,
    prepare=with_absolute_data,
    dataset=train_rows,
)
