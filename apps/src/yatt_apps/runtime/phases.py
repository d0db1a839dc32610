"""The phases every RL job shares, each one call from a step function: prompts to requests, generation
streamed into scoring, the trained batch, old and reference logprobs, the SPMD update, the weight push (the
step's metrics and evaluation: `step_metrics`). A job module (grpo, dapo, ppo, capo, vlm) keeps its own flat
step that calls these in order: `rollout_and_score`, `kept_batch`, `old_logprobs`, `train_policy`,
`push_weights`.

Every learner call goes to *this controller's own learner ranks* with `shard_rows`: one rank in parallel mode
(the controller's own), every rank in single mode (the batch is split by rows, so each DDP rank joins the
SPMD step).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from yatt_apps.config import RunConfig
from yatt_apps.io.data import PromptRow

if TYPE_CHECKING:
    from yatt_controller.controller import StepContext
    from yatt_controller.worker_group import WorkerGroup
    from yatt_placement.types import PlacementPlan


def learner_of(ctx: StepContext) -> WorkerGroup:
    """This controller's learner group: every job here declares one (`Services.learner`). A weight push this
    controller left under way (`push_weights`) lands first: its sender reads the live weights."""
    assert ctx.learner is not None, "the job's services name no learner group"
    settle_push(ctx)
    return ctx.learner


def rollout_of(ctx: StepContext) -> WorkerGroup:
    """This controller's rollout service, once a weight push it left under way has landed in every engine:
    every generation after a push is made by the pushed version."""
    settle_push(ctx)
    return ctx.services["rollout"]


def settle_push(ctx: StepContext) -> None:
    """Wait for the weight push this controller left under way, if any; its bytes count in this step's
    `sync/bytes` (`SyncBytes`)."""
    if ctx.weight_sync is not None and ctx.weight_sync.pending:
        landed = ctx.weight_sync.settle()
        if landed and ctx.rank == 0:
            ctx.state[SYNC_BYTES] = ctx.state.get(SYNC_BYTES, 0) + landed


@functools.cache
def tokenizer(path: str) -> Any:
    """The tokenizer of the model folder `path`, loaded once per process (a controller's steps share it)."""
    from yatt_apps.io.models import load_tokenizer

    return load_tokenizer(path)


def render_prompt(tok: Any, row: PromptRow, system_prompt: str) -> list[int]:
    """The chat-templated prompt token ids of one row; a row with images opens its user turn with one
    Qwen2-VL placeholder per image (one pad token each: the engine expands it to the image's size). The row's
    text is data, not markup: a special token spelled in it (`<|im_end|>`) is encoded as plain text, so a
    dataset row cannot close its turn or open another role's (`prompt_codecs.encode_chat`)."""
    from yatt_multimodal.prompt_codecs import encode_chat

    placeholders = "<|vision_start|><|image_pad|><|vision_end|>" * len(row.images)
    system = [("system", system_prompt)] if system_prompt else []
    return encode_chat(tok, [*system, ("user", row.prompt)], markup=[""] * len(system) + [placeholders])


def make_requests(
    rows: list[PromptRow], prompt_ids: list[list[int]], sampling: Any, tag: str, seed: int | None
) -> list:
    """One request per prompt. With `seed`, request i samples from seed + i: a resumed run draws the same
    completions as one that never stopped, whatever the engine did before."""
    import msgspec
    from yatt_rollout.types import GenerateRequest, MediaRef, Prompt

    return [
        GenerateRequest(
            request_id=f"{tag}-p{i}",
            prompt=Prompt(
                token_ids=ids, text=row.prompt, media=[MediaRef(kind="image", uri=p) for p in row.images]
            ),
            sampling=sampling if seed is None else msgspec.structs.replace(sampling, seed=seed + i),
        )
        for i, (row, ids) in enumerate(zip(rows, prompt_ids, strict=True))
    ]


def prompt_index(completion: Any) -> int:
    """The prompt (GRPO group) a completion answers, from its request id `TAG-pI`."""
    return int(completion.request_id.rsplit("-p", 1)[1])


def pad_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> dict[str, Any]:
    """Right-padded [B, T] input_ids, attention_mask and response_mask (True on response tokens)."""
    import torch

    ends = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    width = max(ends)
    # one tensor from padded rows, the masks from positions: a few ops for the batch, not four a row
    input_ids = torch.tensor(
        [p + r + [pad_id] * (width - end) for p, r, end in zip(prompts, responses, ends, strict=True)],
        dtype=torch.long,
    ).reshape(len(prompts), width)
    position = torch.arange(width)
    attention = position < torch.tensor(ends)[:, None]
    response = attention & (position >= torch.tensor([len(p) for p in prompts])[:, None])
    return {"input_ids": input_ids, "attention_mask": attention, "response_mask": response}


def flat(parts: Any) -> list[Any]:
    return [item for part in parts for item in part]


def sample_seed(cfg: RunConfig, ctx: StepContext, wave: int = 0, *, step: int | None = None) -> int:
    """The base sampling seed of this controller's step (or of `step`, an async batch's launch step); prompt
    i of a wave samples from base + i (< 1000 prompts per wave). Refill waves (wave > 0, DAPO) draw from
    disjoint seeds: wave << 40."""
    step = ctx.step if step is None else step
    return (cfg.run.seed * 1_000_003 + step * 10_007 + ctx.rank * 1_009) * 1_000 + (wave << 40)


# ---- generation streamed into scoring ---------------------------------------------------------------------


@dataclass
class Scored:
    """A step's completions (prompt order, n per prompt) and their rewards. `keep[i]` False: the failure
    policy drops sample i. `stream` holds per-stage busy seconds and their overlap (this controller)."""

    completions: list
    owner: list[int]  # [N] prompt index of each completion
    scores: list[float]
    keep: list[bool]
    statuses: list[str]
    components: list[dict[str, float]]  # [N] each sample's reward terms (only terms that scored ok)
    stream: dict[str, float] = field(default_factory=dict)
    extra: dict[str, list] = field(default_factory=dict)  # a job's own per-sample records (CAPO's critiques)


def num_chunks(num_prompts: int, num_replicas: int, per_replica: int = 2) -> int:
    """Prompts travel in chunks so that judging starts while later chunks are still generating: `per_replica`
    chunks per rollout replica of this controller (fewer when there are fewer prompts)."""
    return max(1, min(num_prompts, per_replica * num_replicas))


def chunks_per_replica(cfg: RunConfig) -> int:
    """How many chunks each rollout replica's share of a step's prompts is cut into. Two with a judge model:
    judging the first chunk overlaps generating the second. One with rule rewards only: scoring takes
    milliseconds, so there is nothing to overlap, and an HF engine would run a chunk's generation as a batch
    of its own (two decode loops of half the rows cost nearly twice one loop of all of them on a small model)."""
    return 2 if cfg.judge is not None else 1


def reward_requests(rows: list[PromptRow], completions: list, tok: Any, *, token_ids: bool = False) -> list:
    """One `RewardRequest` per completion: the row's prompt and answer, the decoded response."""
    from yatt_multimodal.types import RewardRequest

    return [
        RewardRequest(
            request_id=c.request_id + f"-r{c.index}",
            prompt=rows[prompt_index(c)].prompt,
            response=tok.decode(c.token_ids, skip_special_tokens=True),
            reference=rows[prompt_index(c)].answer,
            response_token_ids=list(c.token_ids) if token_ids else [],
        )
        for c in completions
    ]


def generate_and_score(
    ctx: StepContext,
    rows: list[PromptRow],
    prompt_ids: list[list[int]],
    sampling: Any,
    tag: str,
    seed: int | None,
    tok: Any,
    *,
    method: str = "score",
    token_ids: bool = False,
    per_replica: int,
) -> Scored:
    """n completions per prompt on this controller's rollout replicas, each chunk of prompts (`per_replica`
    per replica: `chunks_per_replica`) handed to a reward replica (`method`, given the chunk's
    `RewardRequest`s, with response token ids if `token_ids`) the moment its completions are done
    (yatt_controller's streaming stages), so rollout and judging overlap wherever they run on different
    devices. All samples are checked to be made by the current policy version. `method` returns per-sample
    lists: scores, keep, statuses, sample_components, and any others (kept in `Scored.extra`)."""
    refs = submit_rollout(ctx, make_requests(rows, prompt_ids, sampling, tag, seed), per_replica)
    scored = score_stream(ctx, rows, refs, tok, method=method, token_ids=token_ids)
    check_completions(ctx, scored.completions)
    return scored


def rollout_and_score(
    ctx: StepContext,
    cfg: RunConfig,
    rows: list[PromptRow],
    tok: Any,
    *,
    wave: int | None = None,
    method: str = "score",
    token_ids: bool = False,
) -> tuple[list[list[int]], Scored]:
    """The steps' first phase: every row's chat-templated prompt, and n completions each streamed into scoring
    (`generate_and_score`), tagged with the step and controller (and refill `wave`, which also moves the
    sampling seed). Returns (prompt ids per row, `Scored`)."""
    prompt_ids = [render_prompt(tok, row, cfg.data.system_prompt) for row in rows]
    tag = f"s{ctx.step}-c{ctx.rank}" + ("" if wave is None else f"-w{wave}")
    seed = sample_seed(cfg, ctx, wave or 0)
    scored = generate_and_score(
        ctx,
        rows,
        prompt_ids,
        cfg.sampling,
        tag,
        seed,
        tok,
        method=method,
        token_ids=token_ids,
        per_replica=chunks_per_replica(cfg),
    )
    return prompt_ids, scored


def kept_batch(
    scored: Scored, prompt_ids: list[list[int]], tok: Any
) -> tuple[list[int], list[Any], dict[str, Any]]:
    """The samples a step trains on: indices of the kept completions, the completions, and their padded batch
    (`pad_batch`: each under its prompt's ids [B, T])."""
    kept = [i for i, k in enumerate(scored.keep) if k]
    samples = [scored.completions[i] for i in kept]
    prompts = [prompt_ids[scored.owner[i]] for i in kept]
    return kept, samples, pad_batch(prompts, [c.token_ids for c in samples], tok.pad_token_id)


def submit_rollout(ctx: StepContext, requests: list, per_replica: int) -> list:
    """Every chunk of `requests` (`per_replica` per rollout replica) sent to this controller's least-loaded
    rollout replicas now (object refs)."""
    from yatt_controller.dispatch import split_evenly

    rollout = rollout_of(ctx)
    chunks = [c for c in split_evenly(requests, num_chunks(len(requests), rollout.dp_size, per_replica)) if c]
    return [rollout.call_one("generate", chunk) for chunk in chunks]


def score_stream(
    ctx: StepContext,
    rows: list[PromptRow],
    refs: list,
    tok: Any,
    *,
    method: str = "score",
    token_ids: bool = False,
) -> Any:
    """The completions of each rollout ref handed to a reward replica the moment they are done; a `Scored`
    with the stream's busy and overlap seconds. Versions are not checked here (the caller knows its bound)."""
    from yatt_controller.stream import Stage, run_stream

    reward = ctx.services["reward"]

    def judge(_, done):
        return reward.call_one(method, reward_requests(rows, done, tok, token_ids=token_ids))

    result = run_stream(
        refs,
        [Stage("rollout", lambda ref, _: ref), Stage("reward", judge)],
        max_inflight=len(refs),
        fetch=ctx.get,
    )
    ctx.on_progress("")
    completions = flat(values[0] for values in result.values)
    parts = [values[1] for values in result.values]
    stream = {
        "rollout_s": result.busy_s("rollout"),
        "reward_s": result.busy_s("reward"),
        "overlap_s": result.overlap_s("rollout", "reward"),
        # 1.0: the reward service had its first request before the last completion of the step was done
        "early": float(result.first_submit["reward"] < result.last_done["rollout"]),
        # when this controller's rollout calls were in flight (perf_counter), for async overlap figures
        "rollout_start": result.first_submit["rollout"],
        "rollout_end": result.last_done["rollout"],
        "reward_end": result.last_done.get("reward", result.last_done["rollout"]),
    }
    standard = ("scores", "keep", "statuses", "sample_components")
    return Scored(
        completions=completions,
        owner=[prompt_index(c) for c in completions],
        scores=flat(p["scores"] for p in parts),
        keep=flat(p["keep"] for p in parts),
        statuses=flat(p["statuses"] for p in parts),
        components=flat(p["sample_components"] for p in parts),
        stream=stream,
        extra={key: flat(p[key] for p in parts) for key in parts[0] if key not in standard} if parts else {},
    )


def check_completions(ctx: StepContext, completions: list) -> None:
    """Never train on another policy's samples; a failed generation fails the step with its message."""
    ctx.check_versions([c.policy_version for c in completions])
    errors = [c.error for c in completions if c.finish_reason == "error"]
    if errors:
        raise ValueError(f"rollout failed for {len(errors)} completion(s): {errors[0]}")


def generate(
    ctx: StepContext,
    rows: list[PromptRow],
    prompt_ids: list[list[int]],
    sampling: Any,
    tag: str,
    seed: int | None,
) -> Any:
    """Completions only (evaluation): the same streaming call with one stage."""
    from yatt_controller.dispatch import split_evenly
    from yatt_controller.stream import Stage, run_stream

    rollout = rollout_of(ctx)
    requests = make_requests(rows, prompt_ids, sampling, tag, seed)
    chunks = [c for c in split_evenly(requests, rollout.dp_size) if c]
    result = run_stream(
        chunks, [Stage("rollout", lambda chunk, _: rollout.call_one("generate", chunk))], fetch=ctx.get
    )
    completions = flat(values[0] for values in result.values)
    check_completions(ctx, completions)
    return completions


# ---- advantages ---------------------------------------------------------------------------------------------


def group_advantages(
    cfg: RunConfig,
    scores: Any,
    mask: Any,
    group_ids: Any,
    components: list[dict[str, float]],
    inputs: dict[str, Any] | None = None,
) -> Any:
    """`algo.adv_estimator` over the kept rows: scores [B], mask [B, T], group_ids [B]; GDPO also gets each
    reward term's own score [B, K] (terms in `rewards` order; a term that did not score counts 0); `inputs`:
    the estimator's other inputs (`policy_inputs.advantage_inputs`)."""
    import torch
    from yatt_algos.advantages import ADVANTAGE_ESTIMATORS

    extra = dict(inputs or {})
    if cfg.algo.adv_estimator == "gdpo":
        names = [spec.name or spec.kind for spec in cfg.rewards]
        extra["reward_components"] = torch.tensor([[c.get(n, 0.0) for n in names] for c in components])
    advantages, _ = ADVANTAGE_ESTIMATORS[cfg.algo.adv_estimator](
        scores, mask, cfg.algo, group_ids=group_ids, **extra
    )
    return advantages


def pf_ppo_rows(cfg: RunConfig, ctx: StepContext, scores: Any) -> list[int]:
    """pf-PPO (arXiv 2503.05066): the rows to train on, drawn with replacement by reward (every row, in
    order, when `algo.pf_ppo_method` is "none"); seeded per controller and step."""
    import torch
    from yatt_algos.pf_ppo import pf_ppo_resample

    generator = torch.Generator().manual_seed(sample_seed(cfg, ctx) % 2**63)
    return pf_ppo_resample(scores, cfg.algo, generator=generator).tolist()


def take_rows(batch: dict[str, Any], rows: list[int]) -> dict[str, Any]:
    return {key: value[rows] for key, value in batch.items()}


# ---- the learner --------------------------------------------------------------------------------------------


def concat_rows(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-rank results of a `shard_rows` call joined back in row order."""
    import torch

    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}


def old_logprobs(
    ctx: StepContext, batch: dict[str, Any], responses: list, **options: bool
) -> tuple[dict[str, Any], Any]:
    """Old (this policy) and reference logprobs and entropy [B, T] from this controller's learner ranks, and
    the rollout engine's own logprobs of `responses` (one per row of `batch`) on the same tokens [B, T].
    `options`: `PolicyWorker.logprobs`'s (sum_pi_squared, policy)."""
    import torch

    parts = ctx.get(learner_of(ctx).shard_rows("logprobs", batch, **options))
    lp = concat_rows(parts) if parts[0] else {}
    rollout_lp = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
    for row, completion in enumerate(responses):
        logprobs = completion.logprobs
        if hasattr(completion, "response_mask"):  # a multi-turn trajectory: the model's tokens only
            logprobs = [v for v, m in zip(logprobs, completion.response_mask, strict=True) if m]
        rollout_lp[row, batch["response_mask"][row]] = torch.tensor(logprobs)
    return lp, rollout_lp


def train(ctx: StepContext, experience: dict[str, Any], group: str | None = None) -> dict[str, float]:
    """The SPMD update on this controller's learner ranks (or another learner group's, e.g. a critic);
    stats are global (reduced inside the learner), so rank 0's stand for all."""
    learner = learner_of(ctx) if group is None else ctx.services[group]
    return ctx.get(learner.shard_rows("train", experience))[0]


def train_policy(
    ctx: StepContext,
    batch: dict[str, Any],
    lp: dict[str, Any],
    rollout_lp: Any,
    advantages: Any,
    **extra: Any,
) -> dict[str, float]:
    """The policy's SPMD update on `batch` with its old/reference logprobs `lp` (entropy is a metric, not an
    input), the rollout engine's logprobs and the advantages; `extra` adds (or replaces) experience keys
    (`group_ids`, a loss `response_mask`)."""
    logprobs = {k: v for k, v in lp.items() if k != "entropy"}
    experience = {**batch, **logprobs, "advantages": advantages, "rollout_logprobs": rollout_lp}
    return train(ctx, experience | extra)


def push_weights(ctx: StepContext, cfg: RunConfig, plan: PlacementPlan) -> None:
    """The steps' last phase: the engines wake (where they slept) and version v+1 reaches every rollout
    replica; all controllers wait. Streamed bucket by bucket unless generation may overlap the push
    (`algo.max_staleness > 0`: an engine must not run between two buckets of one version)."""
    from yatt_apps.runtime.workers import learner_gathers_weights

    with ctx.phase("weight_sync"):
        wake_engines(ctx, cfg, plan)
        if pairwise_push(ctx, cfg, plan):
            push_pairs(ctx, ctx.policy_version + 1)
        else:
            gather = learner_gathers_weights(cfg)
            wait = not background_push(cfg)
            sync_weights(ctx, stream=not cfg.algo.max_staleness, gather=gather, wait=wait)


def background_push(cfg: RunConfig) -> bool:
    """Whether a push is left under way while the controller goes on (the step's metrics, the next step's
    prompts) and the engine receives and loads it: async training (`algo.max_staleness > 0`: no generation of
    the step waits on it) with one controller (another controller's generation would not know to wait) and
    a learner that gathers nothing for a push (DDP: it sends its live weights). The controller's next call to
    the learner or the rollout engines waits for it to land (`learner_of`, `rollout_of`), as does the end of
    the run. The attempt's first push is left under way too, so every step's `sync/bytes` is the push that
    landed during it: the previous step's, or at an attempt's first step the attempt's first push."""
    from yatt_apps.runtime.workers import learner_gathers_weights

    return (
        bool(cfg.algo.max_staleness)
        and cfg.controller.num_controllers == 1
        and not learner_gathers_weights(cfg)
    )


def pairwise_push(ctx: StepContext, cfg: RunConfig, plan: PlacementPlan) -> bool:
    """Whether each controller may push to its own engines alone (`push_pairs`): full colocation (a static
    plan whose every engine loads in process from the learner rank on its device; a host lost is a restart,
    so no replica is replaced between pushes), DDP (every rank holds the whole updated model, live: nothing
    to gather, no rank to wait for), no LoRA (its pushes hold exports) and no generation overlapping the
    push."""
    from yatt_apps.runtime.workers import learner_backend

    sync = ctx.weight_sync
    return (
        plan.sleeps
        and sync is not None
        and not sync.remote
        and learner_backend(cfg) == "ddp"
        and not cfg.learner.lora_rank
        and not cfg.algo.max_staleness
    )


def push_pairs(ctx: StepContext, version: int) -> None:
    """Version `version` pairwise: this controller copies its own learner ranks' live weights into the
    engines beside them, in process, while the other controllers do theirs; then one all-gather of the
    bytes, so no controller generates before every engine holds the version (a controller's rollout view may
    reach other devices' engines) and rank 0 reports the step's total. Against `push_version`'s path it
    skips the gather call, the barrier before the push and rank 0's roster check, and the copies run in
    every process at once instead of one after another from rank 0."""
    assert ctx.weight_sync is not None
    own = {w.label for w in learner_of(ctx).workers}
    received = sum(ctx.all_gather(int(ctx.weight_sync.push(version, sources=own) or 0)))
    ctx.policy_version = version
    if received and ctx.rank == 0:  # rank 0's metrics are the step's (`SyncBytes`)
        ctx.state[SYNC_BYTES] = ctx.state.get(SYNC_BYTES, 0) + received


def sync_weights(ctx: StepContext, *, stream: bool = True, gather: bool = True, wait: bool = True) -> None:
    """Version v+1 to every rollout replica: the in-process copy where a replica shares a learner rank's
    process, the broadcast group elsewhere (`push_version`)."""
    push_version(ctx, ctx.policy_version + 1, stream=stream, gather=gather, wait=wait)


def push_version(
    ctx: StepContext,
    version: int,
    *,
    stream: bool = True,
    first: bool = False,
    gather: bool = True,
    wait: bool = True,
) -> None:
    """The learner's weights to every rollout replica as `version`; every controller calls it together.

    An FSDP2 (or Megatron tensor-parallel) export is a collective over every learner rank. `stream`: the
    controllers step through it together, one bucket at a time: each has its own learner ranks gather bucket
    i (`next_weight_bucket`: the rank frees bucket i - 1 first; together the controllers cover every rank),
    then rank 0 pushes what the ranks hold, the same version for every bucket, and a barrier keeps any rank
    from freeing a bucket still being pushed. A rank so holds one bucket of unsharded weights beyond its
    shards. Else every rank gathers the whole model first and one push reads it. DDP gathers nothing: one
    push reads the live weights. `first`: the push when an attempt starts (`initial_push`: no replica was
    replaced yet, so rank 0 re-forms no sync). `gather=False`: the caller knows the learner ranks hold nothing
    for a push (`learner_gathers_weights`), so they are not asked (one call less per push). `wait=False` (one
    push of live weights only: `background_push`): rank 0 starts the push and returns; it lands when
    `settle_push` next runs, and its bytes count then."""
    if ctx.weight_sync is None:
        raise ValueError("sync_weights: the job's services define no weight_sync")
    learner, pushed, received = learner_of(ctx), 0, 0
    if gather and not stream:
        ctx.get(learner.broadcast("gather_weights"))
    elif gather:
        bucket_bytes = ctx.weight_sync.bucket_bytes
        while max(ctx.get(learner.broadcast("next_weight_bucket", bucket_bytes))) > 0:
            ctx.barrier()  # every rank holds bucket i (its gather is done)
            received += _push(ctx, version, before=not (pushed or first))
            ctx.barrier()  # bucket i is in every engine: the ranks may free it
            pushed += 1
    if not pushed:  # one push: the whole model gathered, or DDP's live weights
        ctx.barrier()  # every learner rank finished its update
        received += _push(ctx, version, before=not first, wait=wait)
        ctx.barrier()
    ctx.policy_version = version
    if received and not first:  # the step's `sync/bytes` (`SyncBytes`); an attempt's first push is no step's
        ctx.state[SYNC_BYTES] = ctx.state.get(SYNC_BYTES, 0) + received


def initial_push(ctx: StepContext, version: int, *, background: bool = False) -> None:
    """`yatt_controller.Job.initial_push`: the engines get the (restored) learner's weights when an attempt
    starts, streamed like every step's push, so no rank ever holds the whole unsharded model. `background`
    (`background_push`): left under way, it lands in the first step (which counts its bytes)."""
    push_version(ctx, version, first=True, wait=not background)


def _push(ctx: StepContext, version: int, *, before: bool, wait: bool = True) -> int:
    """Rank 0 pushes; returns the bytes the engines received (`WeightSync.push` counts them where they
    land: each in-process copy's tensors, each broadcast receiver's buckets); 0 on the other ranks, and for
    a push left under way (`wait=False`: `settle_push` counts it)."""
    if ctx.rank != 0:
        return 0
    assert ctx.weight_sync is not None
    if before:
        ctx.before_push()
    if not wait:
        ctx.weight_sync.start(version)
        return 0
    return int(ctx.weight_sync.push(version) or 0)


SYNC_BYTES = "sync_bytes"  # ctx.state key: the bytes of this step's pushes so far (rank 0)


class SyncBytes:
    """A job's step function with `sync/bytes` added to its metrics: the bytes the rollout engines received
    in the step's weight pushes (rank 0 pushes, and rank 0's metrics are the step's; the other ranks
    report 0). A LoRA run's pushes carry its adapters only (`learner_weights`)."""

    def __init__(self, step_fn: Any) -> None:
        self.step_fn = step_fn

    def __call__(self, ctx: StepContext, batch: list) -> Any:
        ctx.state.pop(SYNC_BYTES, None)
        metrics = self.step_fn(ctx, batch)
        received = ctx.state.pop(SYNC_BYTES, 0)
        return {**metrics, "sync/bytes": float(received)} if isinstance(metrics, dict) else metrics


def sleep_engines(ctx: Any, cfg: RunConfig, plan: PlacementPlan) -> None:
    """Full colocation time-shares devices: the engines release memory before the learner runs. The rollout
    engine sleeps at `placement.sleep_level` (1: caches, and weights offloaded off the accelerator; 2: weights
    discarded, the next weight push restores them); a judge never discards its frozen weights (level <= 1),
    nor does a LoRA run's rollout engine (its pushes carry the adapters, not the base)."""
    level = cfg.placement.sleep_level
    if cfg.learner.lora_rank:  # adapter-only pushes restore no discarded base: its weights stay (level 1)
        level = min(level, 1)
    if plan.sleeps and level:
        with ctx.phase("sleep"):
            rollout, reward = ctx.services["rollout"], ctx.services["reward"]
            ctx.get(rollout.broadcast("sleep", level) + reward.broadcast("sleep", 1))


def wake_engines(ctx: Any, cfg: RunConfig, plan: PlacementPlan) -> None:
    """The engines slept by `sleep_engines` wake before the next generation."""
    if plan.sleeps and cfg.placement.sleep_level:
        for name in ("rollout", "reward"):
            ctx.get(ctx.services[name].broadcast("wake_up"))
