"""The typed config of a YATT job, and the named presets.

A run is `RunConfig`: frozen msgspec data, validated on decode, unknown keys rejected. Presets are Python
functions returning a `RunConfig` (`tiny_cpu`, the default, runs here in minutes; the production presets
validate and plan but need a GPU cluster). A YAML file overlays a preset and `--set key=value` overrides a
leaf (`yatt_apps.overlay`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeVar

import msgspec
from yatt_algos.types import AlgoConfig, LearnerConfig, OptimConfig
from yatt_controller.types import ControllerSpec
from yatt_multimodal.types import JudgeSpec, RewardSpec
from yatt_placement.types import ClusterSpec, PlacementMode, ReplanConfig
from yatt_rollout.types import SamplingParams

C = TypeVar("C", bound="RunConfig")


class _Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of the app's configs: immutable, unknown fields are an error (kw_only stated per class)."""


class ModelSpec(_Config, frozen=True, kw_only=True):
    """A model: an HF directory (`path`), or, with `path` empty, a tiny one built from this config and a
    tokenizer trained locally on the task's text (nothing is downloaded)."""

    path: str = ""
    # tiny model: qwen2, llama, qwen3_moe (a mixture of experts: 4 experts, top-2; see algo.routing_replay), or
    # qwen2_vl (a vision-language policy, grpo-vlm)
    arch: Literal["qwen2", "llama", "qwen2_vl", "qwen3_moe"] = "qwen2"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 32
    vocab_size: int = 384
    max_position_embeddings: int = 256
    seed: int = 0
    num_params: float = 0.0  # for placement planning; 0: counted from the model where it is built
    tensor_parallel: int = 1
    pipeline_parallel: int = 1  # learner pipeline stages (Megatron); actor replica: tp x pp devices
    trust_remote_code: bool = False
    # the engine serving this model where it is served: hf or vllm (the judge's; the policy's: rollout.engine)
    engine: Literal["hf", "vllm"] = "hf"
    # auto (bf16 on CUDA, fp32 on CPU), bf16, fp16 or fp32
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    # A tiny model (path empty) warm-started by a short SFT on the embedded arithmetic task (yatt_apps.runtime.warmstart):
    # "policy" on its answers, "genrm" as a verify_yes_no judge, "step_critique" as CAPO's step critic. The result
    # is cached under $YATT_CACHE_DIR (default ~/.cache/yatt/models), keyed by everything that shapes it.
    warm_start: Literal["none", "policy", "genrm", "step_critique"] = "none"
    warm_start_steps: int = 0  # optimizer steps; 0: no warm start
    warm_start_lr: float = 3e-3  # the warm start's learning rate (AdamW)
    warm_start_batch_size: int = 32  # examples per warm-start step

    def __post_init__(self) -> None:
        if self.warm_start_steps < 0 or self.warm_start_batch_size < 1 or self.warm_start_lr <= 0:
            raise ValueError(
                "model.warm_start_steps must be >= 0, warm_start_batch_size >= 1, warm_start_lr > 0"
            )
        if self.warm_start != "none" and (self.path or self.arch == "qwen2_vl"):
            raise ValueError(
                f"model.warm_start={self.warm_start!r} warm-starts a tiny text model: it needs "
                "model.path empty and arch qwen2 or llama"
            )


class DataSpec(_Config, frozen=True, kw_only=True):
    """Prompts with answers. Empty `train` uses the embedded arithmetic task."""

    train: str = ""
    val: str = ""
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    image_key: str = "images"
    num_train_rows: int = 512  # embedded task only
    num_val_rows: int = 32
    max_prompt_tokens: int = 64
    system_prompt: str = ""

    def __post_init__(self) -> None:
        if self.max_prompt_tokens < 1:
            raise ValueError(f"data.max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")


class PlacementConfig(_Config, frozen=True, kw_only=True):
    """Where roles run. `num_devices` logical devices on one node for CPU runs; a `cluster` for real ones."""

    mode: PlacementMode = "colocated"
    cluster: ClusterSpec = ClusterSpec(num_nodes=1, devices_per_node=2, device_memory_gb=16.0)
    cpus_per_device: float = 1.0  # Ray CPUs per device; also each hosted role's torch threads (at least 1)
    # colocated: the rollout engine's sleep level between generation and training (0: never sleep; 1: caches
    # and weights off the accelerator; 2: weights discarded, restored by the next weight push)
    sleep_level: int = 2
    # partial / dynamic / disaggregated: rollout replicas at the start (0: the planner's split)
    rollout_replicas: int = 0
    # measured device-seconds per role and step (a `JobProfile`): the planner sizes the split from it
    profile: dict[str, float] = {}
    # dynamic: when a measured imbalance moves devices; every move is checked by the step times after it (the
    # median of 3 against the 3 before it, undone when more than 5% slower): busy time alone can mislead where
    # logical devices share cores
    replan: ReplanConfig = ReplanConfig(verify_steps=3, verify_tolerance=0.05)

    def __post_init__(self) -> None:
        if self.sleep_level not in (0, 1, 2):
            raise ValueError(f"placement.sleep_level must be 0, 1 or 2, got {self.sleep_level}")
        if self.rollout_replicas < 0:
            raise ValueError(f"placement.rollout_replicas must be >= 0, got {self.rollout_replicas}")


class RolloutSpec(_Config, frozen=True, kw_only=True):
    """How the policy's completions are produced: the engine, multi-turn environments, async behaviour."""

    engine: Literal["hf", "vllm"] = "hf"
    env: str = ""  # a registered multi-turn environment (yatt_rollout); "": single-turn completions
    max_turns: int = 1
    partial: bool = False  # async: pause in-flight generations at a weight update and resume them
    # a tiny policy (model.path empty) fine-tuned first on `sft_demos` of the environment's multi-turn
    # demonstrations for this many steps (yatt_apps.runtime.agent_warmstart, cached); 0: no such warm start
    sft_steps: int = 0
    sft_demos: int = 1024
    # the environment's tools in every prompt, through the chat template's own tools support (Qwen's
    # `tools=`; the Hermes block as a system message where the template has none). Off by default: the schemas
    # take hundreds of tokens, more than the default tiny policy's context (tiny_cpu_agent turns it on)
    tools_in_prompt: bool = False

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"rollout.max_turns must be >= 1, got {self.max_turns}")
        if self.sft_steps < 0 or self.sft_demos < 1:
            raise ValueError("rollout.sft_steps must be >= 0 and rollout.sft_demos >= 1")
        if not self.env and (self.tools_in_prompt or self.sft_steps):
            raise ValueError(
                "rollout.tools_in_prompt and rollout.sft_steps need an environment: set rollout.env"
            )


class RaySpec(_Config, frozen=True, kw_only=True):
    """Which Ray: `address` joins an existing cluster ("auto", "ray://host:10001", "host:6379") and uses its real
    resources; empty starts the embedded local Ray ($RAY_ADDRESS is honoured when this is empty)."""

    address: str = ""


class RunSpec(_Config, frozen=True, kw_only=True):
    """The loop: how many steps, how many prompts each (global), evaluation, checkpoints, output."""

    name: str = "grpo-tiny"
    out_dir: str = "runs"
    num_steps: int = 30
    prompts_per_step: int = 16
    # evaluate the validation split every k steps and at the run's last step (0: never); checkpoints: controller
    eval_every: int = 10
    seed: int = 0
    progress: bool = True
    # the learning-rate schedule spans this many steps' optimizer updates (0: num_steps, so extending a run with
    # `yatt resume --set run.num_steps=N` stretches it); optim.num_training_steps is derived from it
    schedule_steps: int = 0

    def __post_init__(self) -> None:
        if self.num_steps < 1 or self.prompts_per_step < 1:
            raise ValueError("run.num_steps and run.prompts_per_step must be >= 1")
        if self.schedule_steps < 0:
            raise ValueError(f"run.schedule_steps must be >= 0, got {self.schedule_steps}")
        if self.eval_every < 0:
            raise ValueError(f"run.eval_every must be >= 0, got {self.eval_every}")


class DynamicSamplingSpec(_Config, frozen=True, kw_only=True):
    """DAPO's dynamic sampling (filter-and-refill, PAPERS.md), used by `yatt dapo`: at most 1 + max_refill
    waves per step, ceil(gap x expansion x safety) prompts per refill, the expansion an EMA of total/valid
    groups (start 1.0) capped at max_expansion; surplus valid prompts buffered (0: 4 x prompts per controller)."""

    max_refill: int = 3
    safety: float = 1.2
    ema_decay: float = 0.9
    max_expansion: float = 10.0
    max_buffer: int = 0

    def __post_init__(self) -> None:
        if self.max_refill < 0 or self.max_buffer < 0:
            raise ValueError("dynamic_sampling.max_refill and max_buffer must be >= 0")
        if self.safety < 1.0 or self.max_expansion < 1.0:
            raise ValueError("dynamic_sampling.safety and max_expansion must be >= 1")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"dynamic_sampling.ema_decay must be in [0, 1), got {self.ema_decay}")


class CapoSpec(_Config, frozen=True, kw_only=True):
    """CAPO's credit assignment (arXiv 2508.02298, PAPERS.md), used by `yatt capo`: the judge model critiques
    each response `critic.num_samples` (K) times with the step-critique template; the K wrong-step sets are
    voted (`voting`) and each token gets R_t = r_v * w_whole - 1[t in a wrong step] * w_process."""

    voting: Literal["intersection", "majority", "union", "average"] = "intersection"
    w_whole: float = 2.0
    w_process: float = 1.0
    critic: JudgeSpec = JudgeSpec(template_name="step_critique", num_samples=4)

    def __post_init__(self) -> None:
        if self.w_whole < 0 or self.w_process < 0:
            raise ValueError("capo.w_whole and capo.w_process must be >= 0")


class LogSpec(_Config, frozen=True, kw_only=True):
    """Where metrics go besides metrics.jsonl and TensorBoard: an optional W&B run (`pip install
    'yatt-apps[wandb]'`; `WANDB_MODE=offline` writes it locally without a network), same metric names."""

    wandb: bool = False
    project: str = "yatt"
    run_name: str = ""  # "": the run directory's name


class SFTSpec(_Config, frozen=True, kw_only=True):
    """`yatt sft`'s data: prompt/response rows (jsonl or parquet); empty `train` uses the embedded task's
    answers. Steps come from `run.num_steps` and `run.prompts_per_step` rows each (the data cycles in epochs)."""

    train: str = ""  # a .jsonl or .parquet file of prompt/response rows; "": the embedded task's answers
    prompt_key: str = "prompt"  # the column holding the prompt
    response_key: str = "response"  # the column holding the response to learn


class RunConfig(_Config, frozen=True, kw_only=True):
    """The run config every job shares (grpo and grpo-vlm use it as is); a job with keys of its own extends
    it (`DapoConfig`, `PpoConfig`, `CapoConfig`, `SftConfig`), so each job's config holds only the keys it uses
    and rejects another job's. `app` names its job (`JobDef.name`)."""

    app: str = "grpo"
    run: RunSpec = RunSpec()
    model: ModelSpec = ModelSpec()
    judge: ModelSpec | None = None  # the GenRM model; None: no generative judge
    data: DataSpec = DataSpec()
    sampling: SamplingParams = SamplingParams(n=4, temperature=1.0, max_new_tokens=6)
    rewards: list[RewardSpec] = []
    algo: AlgoConfig = AlgoConfig()
    optim: OptimConfig = OptimConfig()
    # the jobs score response tokens only: the output projection and log-softmax skip the prompt's positions
    learner: LearnerConfig = LearnerConfig(score_prompt_tokens=False)
    controller: ControllerSpec = ControllerSpec()
    placement: PlacementConfig = PlacementConfig()
    rollout: RolloutSpec = RolloutSpec()
    ray: RaySpec = RaySpec()
    log: LogSpec = LogSpec()

    def __post_init__(self) -> None:
        if self.run.prompts_per_step % self.controller.num_controllers:
            raise ValueError(
                f"run.prompts_per_step ({self.run.prompts_per_step}) must divide evenly over "
                f"controller.num_controllers ({self.controller.num_controllers})"
            )
        if any(spec.kind == "genrm" for spec in self.rewards) and self.judge is None:
            raise ValueError("rewards has a 'genrm' term but judge (the judge model) is not set")
        for problem in hardware_problems(self):
            raise ValueError(problem)


class DapoConfig(RunConfig, frozen=True, kw_only=True):
    """`yatt dapo`: the shared keys and DAPO's dynamic sampling."""

    app: str = "dapo"
    dynamic_sampling: DynamicSamplingSpec = DynamicSamplingSpec()


class PpoConfig(RunConfig, frozen=True, kw_only=True):
    """`yatt ppo`: the shared keys and the critic's optimizer."""

    app: str = "ppo"
    critic_optim: OptimConfig | None = None  # the critic's optimizer; None: the policy's `optim`


class CapoConfig(RunConfig, frozen=True, kw_only=True):
    """`yatt capo`: the shared keys and CAPO's credit assignment."""

    app: str = "capo"
    capo: CapoSpec = CapoSpec()


class SftConfig(RunConfig, frozen=True, kw_only=True):
    """`yatt sft`: the shared keys and the supervised data."""

    app: str = "sft"
    sft: SFTSpec = SFTSpec()


def as_config(cls: type[C], cfg: RunConfig, **changes: Any) -> C:
    """`cfg` as the config class `cls` (a job's): the keys `cls` has are kept, `changes` applied on top, keys
    it lacks are dropped (e.g. `yatt grpo --preset tiny_cpu_ppo` keeps the shared keys of PPO's preset) and
    `app` is the class's default unless `changes` name it."""
    # `app` is the class's own (a job's config names its job); every other shared key is kept
    keep = {n: getattr(cfg, n) for n in cfg.__struct_fields__ if n in cls.__struct_fields__ and n != "app"}
    return cls(**{**keep, **changes})


def hardware_problems(cfg: RunConfig) -> list[str]:
    """Engine, backend, tensor-parallel and device combinations that cannot run, each naming its keys."""
    per_node = cfg.placement.cluster.devices_per_node
    engines = [("model", "rollout.engine", cfg.rollout.engine, cfg.model)]
    if cfg.judge is not None:
        engines.append(("judge", "judge.engine", cfg.judge.engine, cfg.judge))
    problems = []
    for name, engine_key, engine, spec in engines:
        tp = spec.tensor_parallel
        if tp < 1:
            problems.append(f"{name}.tensor_parallel must be >= 1, got {tp}")
        elif engine == "hf" and tp > 1:
            problems.append(
                f"{engine_key}='hf' cannot use {name}.tensor_parallel={tp} (the HF engine runs on one "
                f"device); set {engine_key}=vllm or {name}.tensor_parallel=1"
            )
        elif per_node % tp:
            problems.append(
                f"{name}.tensor_parallel={tp} does not divide placement.cluster.devices_per_node="
                f"{per_node} (a replica spans devices of one host)"
            )
    vlm = cfg.model.arch == "qwen2_vl"
    if vlm and cfg.rollout.engine == "vllm":
        problems.append("rollout.engine='vllm' does not serve a VLM policy (model.arch='qwen2_vl'): use 'hf'")
    problems += pipeline_problems(cfg)
    backend = cfg.learner.backend
    if backend == "megatron":
        if vlm:
            problems.append(
                "learner.backend='megatron' converts Llama/Qwen2 text models, not model.arch='qwen2_vl'"
            )
        if cfg.learner.lora_rank:
            problems.append(
                "learner.backend='megatron' has no LoRA (learner.lora_rank > 0): use 'ddp' or 'fsdp2'"
            )
        if not megatron_device_ok(cfg):
            problems.append(MEGATRON_NEEDS_CUDA)
    return problems + moe_problems(cfg) + lora_problems(cfg)


def lora_problems(cfg: RunConfig) -> list[str]:
    """LoRA runs sync adapters only; vLLM serves them through its LoRA requests, which a running request keeps
    (no partial rollouts), at ranks up to 512."""
    rank = cfg.learner.lora_rank
    if not rank or cfg.rollout.engine != "vllm":
        return []
    problems = []
    if cfg.rollout.partial:
        problems.append(
            "rollout.partial with rollout.engine='vllm' and learner.lora_rank > 0: a running vLLM request keeps "
            "the LoRA adapter it started with; use rollout.engine=hf or rollout.partial=false"
        )
    if rank > 512:
        problems.append(f"learner.lora_rank={rank}: vLLM serves LoRA ranks up to 512 (rollout.engine='vllm')")
    return problems


def moe_problems(cfg: RunConfig) -> list[str]:
    """Mixture-of-experts settings that cannot run: routing replay and the router loss live in the torch
    learner; R3 needs the rollout's recorded choices, which the HF engine gives."""
    problems = []
    moe_keys = cfg.algo.routing_replay != "off" or cfg.algo.router_aux_coef
    if cfg.learner.backend == "megatron" and (moe_keys or cfg.model.arch == "qwen3_moe"):
        problems.append(
            "learner.backend='megatron' trains dense Llama/Qwen2 models: model.arch='qwen3_moe', "
            "algo.routing_replay and algo.router_aux_coef need 'ddp' or 'fsdp2'"
        )
    if cfg.algo.routing_replay == "r3" and cfg.rollout.engine == "vllm":
        problems.append(
            "algo.routing_replay='r3' replays the rollout's recorded expert choices, which YATT takes from "
            "rollout.engine='hf' only (vLLM's enable_return_routed_experts is not wired yet): use 'hf' or 'r2'"
        )
    return problems


def pipeline_problems(cfg: RunConfig) -> list[str]:
    """`model.pipeline_parallel`: Megatron only, stages that split the layers evenly, and an actor replica of
    tensor_parallel x pipeline_parallel devices inside one host; Megatron's TP splits the key/value heads. The
    judge is never pipelined. Model facts are checked where known here (a tiny model, a local folder)."""
    pp, tp, per_node = (
        cfg.model.pipeline_parallel,
        cfg.model.tensor_parallel,
        cfg.placement.cluster.devices_per_node,
    )
    if cfg.judge is not None and cfg.judge.pipeline_parallel != 1:
        return [
            f"judge.pipeline_parallel={cfg.judge.pipeline_parallel}: the judge is not trained; set it to 1"
        ]
    if pp < 1:
        return [f"model.pipeline_parallel must be >= 1, got {pp}"]
    if cfg.learner.backend != "megatron":
        if pp == 1:
            return []
        return [
            f"model.pipeline_parallel={pp} needs learner.backend=megatron (got {cfg.learner.backend!r}): only "
            "the Megatron learner runs pipeline stages"
        ]
    arch, problems = _known_arch(cfg.model), []
    if tp > 1 and arch.get("kv_heads", tp) % tp:
        problems.append(
            f"model.tensor_parallel={tp} does not divide the model's {arch['kv_heads']} key/value heads "
            "(learner.backend=megatron splits them over tensor-parallel ranks)"
        )
    if pp == 1:
        return problems
    if arch.get("layers", pp) % pp:
        problems.append(f"model.pipeline_parallel={pp} does not divide the model's {arch['layers']} layers")
    if arch.get("tied"):
        problems.append(
            f"model.pipeline_parallel={pp}: the model ties its embeddings (tie_word_embeddings), which the "
            "Megatron learner supports only at model.pipeline_parallel=1"
        )
    if tp >= 1 and per_node % (tp * pp):
        problems.append(
            f"model.tensor_parallel={tp} x model.pipeline_parallel={pp} = {tp * pp} does not divide "
            f"placement.cluster.devices_per_node={per_node} (an actor replica spans devices of one host)"
        )
    return problems


def _known_arch(spec: ModelSpec) -> dict[str, int]:
    """What is known here of the model's shape: `layers`, `kv_heads`, `tied` (embeddings). A tiny model (path
    empty; never tied) from the spec, a local folder from its config.json; {} for a hub id."""
    if not spec.path:
        return {"layers": spec.num_layers, "kv_heads": spec.num_kv_heads, "tied": 0}
    import json
    from pathlib import Path

    config = Path(spec.path).expanduser() / "config.json"
    if not config.is_file():
        return {}
    hf = json.loads(config.read_text())
    hf = hf.get("text_config", hf)
    known = {"layers": hf.get("num_hidden_layers"), "tied": int(bool(hf.get("tie_word_embeddings", False)))}
    known["kv_heads"] = hf.get("num_key_value_heads", hf.get("num_attention_heads"))
    return {k: v for k, v in known.items() if isinstance(v, int)}


# the test-only CPU shim (yatt_algos.learner.megatron_cpu_shim)
MEGATRON_CPU_SHIM = "YATT_TEST_MEGATRON_CPU_SHIM"
MEGATRON_NEEDS_CUDA = (
    "learner.backend='megatron' needs CUDA devices and none is visible here (ray.address is empty, so the job "
    "runs on this machine); use learner.backend=ddp or fsdp2 on CPU"
)


def megatron_device_ok(cfg: RunConfig) -> bool:
    """Megatron-Core runs on CUDA only (outside the labelled test shim). Checked here when the job runs on this
    machine; a job joining a cluster (`ray.address` / $RAY_ADDRESS) is checked by its learner workers."""
    import os

    if os.environ.get(MEGATRON_CPU_SHIM) == "1" or cfg.ray.address or os.environ.get("RAY_ADDRESS"):
        return True
    import torch

    return torch.cuda.is_available()


# ---- presets --------------------------------------------------------------------------------------------

# The tiny judge's verdicts are constrained to the two phrases its parser reads (`JudgeSpec.choices`); it reads
# verify_yes_no v2 (the solution last, next to the verdict: a tiny judge learns that comparison quickly). The
# warm start (yatt_apps.runtime.warmstart) trains the tiny judges on exactly these templates.
TINY_VERDICTS = ["Verdict: Yes", "Verdict: No"]
TINY_JUDGE = JudgeSpec(
    template_version=2,
    num_samples=2,
    temperature=0.7,
    top_p=0.9,
    max_new_tokens=8,
    on_parse_error="zero",
    choices=TINY_VERDICTS,
)
# CAPO's tiny step critic (step_critique v2: the steps last): a one-step answer is right or wrong, so two
# constrained critiques
TINY_CRITIC = JudgeSpec(
    template_name="step_critique",
    template_version=2,
    num_samples=2,
    temperature=0.7,
    max_new_tokens=8,
    choices=["Wrong steps: none", "Wrong steps: 1"],
)


def tiny_cpu() -> RunConfig:
    """The default: GRPO on the embedded arithmetic task, a tiny Qwen2 policy and a tiny Qwen2 judge built from
    configs, two parallel controllers on two logical devices (colocated), a few minutes on a 2-core CPU.

    Both tiny models are warm-started on the task (`yatt_apps.runtime.warmstart`, cached): the policy partly (it
    answers some validation prompts, leaving headroom for RL), the judge as a verify_yes_no (v2) grader of
    right, near-miss and malformed answers. Rewards: exact answer (math_verify), a format term (the response
    starts with an integer), and the GenRM judge with K=2 verdicts constrained to its two verdict phrases (every
    verdict parses). 32 prompts x 8 samples per step at lr 5e-4: with 16 x 4 at lr 1e-3 the noisy updates
    drifted the policy (KL 0.9 nats/token) and validation accuracy fell. Measured (seed 0, yatt-apps 0.6.0's
    shipped warm starts): val/accuracy 0.48 at step 0, 0.66 at step 10, 0.67 at steps 20 and 29;
    judge/agreement 0.81-0.97; judge/parse_rate 1.0; 49 s on an idle 2-core machine."""
    base = _tiny_base()
    return msgspec.structs.replace(
        base,
        run=msgspec.structs.replace(base.run, prompts_per_step=32),
        sampling=msgspec.structs.replace(base.sampling, n=8),
        optim=msgspec.structs.replace(base.optim, lr=5e-4),
    )


def _tiny_base() -> RunConfig:
    """What the other tiny presets build on: `tiny_cpu` with 16 prompts x 4 samples per step at lr 1e-3 (their
    tests and figures were measured with these)."""
    return RunConfig(
        model=ModelSpec(warm_start="policy", warm_start_steps=700, warm_start_batch_size=64),
        # judge prompts hold whole multi-turn episodes (rollout.env), hence the longer context
        judge=ModelSpec(seed=1, max_position_embeddings=1024, warm_start="genrm", warm_start_steps=800),
        data=DataSpec(num_val_rows=64),
        rewards=[
            RewardSpec(kind="math_verify", weight=1.0),
            RewardSpec(
                kind="regex",
                name="format",
                weight=0.2,
                options={"pattern": r"^\s*-?\d+", "mode": "search"},
            ),
            RewardSpec(kind="genrm", weight=0.1, judge=TINY_JUDGE),
        ],
        # 2 updates per batch as in the paper's recipe; the warm-started policy moves at the warm start's lr
        algo=AlgoConfig(adv_estimator="grpo", kl_loss_coef=1e-3, adv_eps=1e-4, num_updates_per_batch=2),
        optim=OptimConfig(
            lr=1e-3, num_warmup_steps=2, num_training_steps=30, micro_batch_size=32, clip_grad_norm=1.0
        ),
        controller=ControllerSpec(
            num_controllers=2,
            heartbeat_interval_s=1.0,
            hang_timeout_s=300.0,
            checkpoint_every=10,
            keep_checkpoints=2,
        ),
    )


def tiny_cpu_agent() -> RunConfig:
    """Agentic GRPO (`yatt grpo --preset tiny_cpu_agent`): "347 * 86 =" (`yatt_rollout.tool_tasks.MultiplyEnv`),
    out of a tiny model's reach without its calculator, within it with. The calculator's schema is in the
    prompt (the chat template's tools support). The policy is warm-started by a multi-turn SFT on the
    environment's demonstrations (some with the tool, some answered directly with a guess, some with a wrong
    first call corrected: `rollout.sft_steps`; the demonstrator mostly calls for multipliers >= 50 only), so
    it knows the format and copies results but calls the tool only for part of the prompts; GRPO on the
    exact answer (math_verify) teaches it to call for the others. Validation runs with the tools and without
    (`val/accuracy`, `val/accuracy_no_tools`). Measured (seed 0, 800 SFT steps, 20 GRPO steps):
    val/accuracy 0.44 at step 0 (greedy calls on the b >= 50 half only), 0.75 at step 19; without the
    tools 0.0 at both."""
    base = _tiny_base()
    return msgspec.structs.replace(
        base,
        run=msgspec.structs.replace(
            base.run, name="agent-tiny", num_steps=20, prompts_per_step=16, eval_every=19
        ),
        model=ModelSpec(
            hidden_size=128,
            num_heads=4,
            num_kv_heads=2,
            vocab_size=1024,
            max_position_embeddings=512,
            warm_start_lr=3e-3,
            warm_start_batch_size=32,
        ),
        judge=None,
        rewards=[RewardSpec(kind="math_verify", weight=1.0)],
        data=DataSpec(num_train_rows=512, num_val_rows=64, max_prompt_tokens=256),
        rollout=RolloutSpec(env="multiply", max_turns=3, sft_steps=800, sft_demos=1024, tools_in_prompt=True),
        sampling=msgspec.structs.replace(base.sampling, n=8, max_new_tokens=32),
        algo=msgspec.structs.replace(base.algo, num_updates_per_batch=1),
        optim=msgspec.structs.replace(base.optim, lr=1e-3),
    )


def tiny_cpu_dapo() -> DapoConfig:
    """`yatt dapo` on the tiny task (DAPO, arXiv 2503.14476): the rule terms of `tiny_cpu` without the judge (a
    noisy judge would make every group vary, leaving dynamic sampling nothing to filter), clip-higher 0.28,
    token-mean loss, no KL term, responses up to 8 tokens with the overlong penalty over the last 2 (down to
    -0.5), and dynamic sampling with up to 3 refill waves."""
    base = _tiny_base()
    return as_config(
        DapoConfig,
        base,
        run=msgspec.structs.replace(base.run, name="dapo-tiny"),
        judge=None,
        rewards=[spec for spec in base.rewards if spec.kind != "genrm"],
        sampling=msgspec.structs.replace(base.sampling, max_new_tokens=8),
        algo=AlgoConfig(
            adv_estimator="grpo",
            loss_agg_mode="token-mean",
            clip_ratio_low=0.2,
            clip_ratio_high=0.28,
            kl_loss_coef=0.0,
            adv_eps=1e-4,
            overlong_buffer_len=2,
            overlong_penalty_factor=0.5,
        ),
    )


def tiny_cpu_ppo() -> PpoConfig:
    """`yatt ppo` on the tiny task: the rule terms of `tiny_cpu` (no judge), a critic built from the policy's
    config (a one-label token-classification head) with its own learning rate, GAE (gamma 1, lambda 0.95),
    the k1 KL to the reference as a reward penalty (0.01 per token) and no KL loss term."""
    base = _tiny_base()
    return as_config(
        PpoConfig,
        base,
        run=msgspec.structs.replace(base.run, name="ppo-tiny"),
        judge=None,
        rewards=[spec for spec in base.rewards if spec.kind != "genrm"],
        algo=AlgoConfig(
            adv_estimator="gae", gamma=1.0, lam=0.95, kl_reward_coef=0.01, kl_estimator="k1", kl_loss_coef=0.0
        ),
        critic_optim=msgspec.structs.replace(base.optim, lr=1e-3, num_warmup_steps=0),
    )


def tiny_cpu_capo() -> CapoConfig:
    """`yatt capo` on the tiny task (CAPO, arXiv 2508.02298): a rule verifier r_v in {0, 1} as the only reward
    term (math_verify on the warm-started policy), the tiny judge warm-started as the step critic (K = 2
    critiques constrained to "Wrong steps: none" / "Wrong steps: 1": a one-step answer is right or wrong),
    intersection voting, W_whole = 2, W_process = 1, token advantages normalized per prompt, PPO-clip.

    Two settings make it learn (issue 34: with `_tiny_base`'s settings reward fell 0.25 -> 0.08 in 10 steps):
    - `tiny_cpu`'s update size, 32 prompts x 8 samples per step at lr 5e-4. At 16 x 4 and lr 1e-3 the policy
      drifted 0.5-1.0 nats/token from its reference within 3 steps; over 10 steps (seed 0, val at 0/3/6/9)
      val/accuracy went 0.53 -> 0.28, 0.34, 0.38, and 0.53 -> 0.36, 0.38, 0.34 with the critique penalty off
      (capo.w_process=0): the update size, not the credit, unlearned. At 32 x 8, lr 5e-4 (the old critic):
      0.53 -> 0.56, 0.55, 0.55, reward 0.27 -> 0.43, KL <= 0.15.
    - the critic's warm start runs 1500 steps: at 800 it sat on a plateau, flagging a right and an off-by-one
      answer alike (P("none") 0.42 each; held-out accuracy 0.625, about "always wrong" on its data), so the
      process penalty was noise that the per-prompt normalization scaled to unit size wherever r_v was
      constant; it leaves the plateau after ~1000 steps (held-out accuracy 0.984 at 1500).
    Measured, the default 30 steps (seed 0): val/accuracy 0.53 at step 0, 0.56 at 10, 0.64 at 20, 0.64 at 29;
    reward 0.27 at step 0, 0.48 over the last five; KL <= 0.28; the vote flags 0-3% of right answers and
    94-100% of wrong ones. The old settings, same 30 steps: val 0.53, 0.31, 0.31, 0.34; reward 0.34 -> 0.27;
    KL up to 1.13; flagged 33% of right and 38% of wrong answers."""
    base = tiny_cpu()
    return as_config(
        CapoConfig,
        base,
        run=msgspec.structs.replace(base.run, name="capo-tiny"),
        # the critique prompt is long; the critic compares the answer with the reference only after ~1000
        # warm-start steps (see above)
        judge=ModelSpec(
            seed=1, max_position_embeddings=1024, warm_start="step_critique", warm_start_steps=1500
        ),
        rewards=[
            msgspec.structs.replace(spec, weight=1.0) for spec in base.rewards if spec.kind == "math_verify"
        ],
        capo=CapoSpec(critic=TINY_CRITIC),
    )


def tiny_cpu_vlm() -> RunConfig:
    """`yatt grpo-vlm` on the embedded image task ("how many red squares?", small PNGs generated into the run
    directory): a tiny Qwen2-VL policy built from a config (vision tower included), rule rewards only (exact
    count, and a format term: the response starts with an integer), GRPO with a small KL loss."""
    base = _tiny_base()
    return msgspec.structs.replace(
        base,
        app="grpo-vlm",
        run=msgspec.structs.replace(base.run, name="grpo-vlm-tiny", prompts_per_step=8),
        model=ModelSpec(arch="qwen2_vl", max_position_embeddings=1024),
        judge=None,
        data=DataSpec(num_train_rows=64, num_val_rows=8, max_prompt_tokens=64),
        rewards=[spec for spec in base.rewards if spec.kind != "genrm"],
    )


def tiny_cpu_sft() -> SftConfig:
    """`yatt sft` on the embedded task: a tiny Qwen2 built from a config, trained on the worked answers
    (prompt "a + b =", response the answer) with the loss on response tokens only, 32 rows per step over two
    controllers (data parallel), greedy accuracy on the validation rows every 10 steps; writes RUN_DIR/final."""
    base = _tiny_base()
    return as_config(
        SftConfig,
        base,
        run=msgspec.structs.replace(base.run, name="sft-tiny", prompts_per_step=32),
        model=ModelSpec(),  # from its random init: SFT is what teaches it the task
        judge=None,
        rewards=[],
        algo=AlgoConfig(),
        optim=OptimConfig(
            lr=3e-3, num_warmup_steps=2, num_training_steps=30, micro_batch_size=32, clip_grad_norm=1.0
        ),
    )


def qwen2_5_math_1_5b_genrm_72b() -> RunConfig:
    """WeChat-YATT's flagship recipe (PAPERS.md): Qwen2.5-Math-1.5B policy, Qwen2.5-Math-72B-Instruct judge on
    GSM8K, 64 devices, partial colocation; 4 samples per prompt at temperature 1.0, top-p 0.9; lr 5e-7 with 20
    warmup steps, clip 0.2, KL loss 1e-2, 2 updates per batch; the judge samples 8 verdicts at temperature 0.7,
    top-p 0.9, up to 512 tokens. Plans and validates here; runs on a GPU cluster with the model directories."""
    return RunConfig(
        run=RunSpec(name="grpo-genrm-1.5b-72b", num_steps=500, prompts_per_step=512, eval_every=20),
        model=ModelSpec(path="/models/Qwen2.5-Math-1.5B-SFT", num_params=1.5e9),
        judge=ModelSpec(
            path="/models/Qwen2.5-Math-72B-Instruct", num_params=72e9, tensor_parallel=8, engine="vllm"
        ),
        rollout=RolloutSpec(engine="vllm"),
        data=DataSpec(
            train="/data/gsm8k/train.parquet", val="/data/gsm8k/test.parquet", max_prompt_tokens=512
        ),
        sampling=SamplingParams(n=4, temperature=1.0, top_p=0.9, max_new_tokens=1024),
        rewards=[RewardSpec(kind="genrm", judge=JudgeSpec())],
        algo=AlgoConfig(kl_loss_coef=1e-2, adv_eps=1e-4, num_updates_per_batch=2),
        optim=OptimConfig(
            lr=5e-7, num_warmup_steps=20, num_training_steps=500, micro_batch_size=8, clip_grad_norm=1.0
        ),
        controller=ControllerSpec(num_controllers=64, checkpoint_every=50),
        placement=PlacementConfig(
            mode="partial", cluster=ClusterSpec(num_nodes=8, devices_per_node=8, device_memory_gb=96.0)
        ),
    )


PRESETS: dict[str, Callable[[], RunConfig]] = {
    "tiny_cpu": tiny_cpu,
    "tiny_cpu_dapo": tiny_cpu_dapo,
    "tiny_cpu_ppo": tiny_cpu_ppo,
    "tiny_cpu_capo": tiny_cpu_capo,
    "tiny_cpu_vlm": tiny_cpu_vlm,
    "tiny_cpu_sft": tiny_cpu_sft,
    "tiny_cpu_agent": tiny_cpu_agent,
    "qwen2_5_math_1_5b_genrm_72b": qwen2_5_math_1_5b_genrm_72b,
}
