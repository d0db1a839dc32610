"""Wire and config types of yatt-algos: algorithm and optimizer configs, the training batch, train stats.

Configs are frozen and reject unknown fields; messages tolerate them. Tensors cross process boundaries as
`EncodedTensor` (dtype, shape, one zero-copy buffer); `yatt_algos.tensor_codec` converts to and from numpy
and torch without importing either here.
"""

from __future__ import annotations

from typing import Literal, get_args

import msgspec

AdvantageEstimator = Literal[
    "gae",
    "grpo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "opo",
    "gpg",
    "grpo_passk",
    "gdpo",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
]
PolicyLoss = Literal[
    "ppo_clip",
    "dual_clip",
    "gspo",
    "cispo",
    "gmpo",
    "gpg",
    "sapo",
    "clip_cov",
    "kl_cov",
    "dppo_tv",
    "dppo_kl",
    "reinforce",
    "dro",
    "bypass_mode",
]
LossAggMode = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum"
]
# "+" names are straight-through: the named estimate's value, k2's gradient; low_var_kl is verl's name of k3.
KLEstimator = Literal["k1", "k2", "k3", "abs", "k1+", "k3+", "abs+", "low_var_kl", "low_var_kl+"]
RolloutISLevel = Literal["none", "token", "sequence"]
RolloutISMode = Literal["truncate", "mask"]
PfPpoMethod = Literal["none", "pow", "max_min", "max_random"]
RoutingReplay = Literal["off", "r2", "r3"]


class _Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of typed configuration: immutable, unknown fields are an error. (kw_only is not inherited:
    every subclass states it.)"""


class _Wire(msgspec.Struct, omit_defaults=True):
    """Base of messages: unknown fields are ignored, defaults are not sent."""


class EncodedTensor(_Wire, kw_only=True):
    """A dense tensor as dtype, shape and its raw little-endian bytes (C order).

    Producer: `tensor_codec.encode` on any side of a process boundary. Consumer: `tensor_codec.decode_*`,
    which view `data` without copying. After a msgpack decode, `data` points into the received message.
    """

    dtype: str  # torch-style name without prefix: "float32", "bfloat16", "int64", "bool", ...
    shape: list[int]
    data: memoryview


class AlgoConfig(_Config, frozen=True, kw_only=True):  # frozen is inherited; said again for mypy
    """The RL objective. Names index the registries in `yatt_algos` (estimators, losses, KL, aggregation).

    Producer: the app's config. Consumer: the controller's step (advantages) and the learner (loss).
    Defaults follow the GRPO-with-GenRM recipe of WeChat-YATT (clip 0.2, KL loss 1e-2).
    """

    adv_estimator: AdvantageEstimator = "grpo"
    policy_loss: PolicyLoss = "ppo_clip"
    loss_agg_mode: LossAggMode = "token-mean"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual-clip lower bound for negative advantages
    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: bool = True  # False gives Dr.GRPO
    adv_eps: float = 1e-6
    kl_estimator: KLEstimator = "k3"
    kl_loss_coef: float = 0.0  # KL as a loss term (GRPO style)
    kl_reward_coef: float = 0.0  # KL as a reward penalty (PPO style)
    entropy_coef: float = 0.0
    num_updates_per_batch: int = 1
    # Appended in 0.2.0. GSPO clips its length-normalized sequence ratio far tighter than PPO (arXiv 2507.18071).
    gspo_clip_ratio_low: float = 3e-4
    gspo_clip_ratio_high: float = 4e-4
    # CISPO clips the detached IS weight to [1 - low, 1 + high]; low = 1 is no lower bound (arXiv 2506.13585).
    cispo_clip_ratio_low: float = 1.0
    cispo_clip_ratio_high: float = 0.28
    # Rollout/train mismatch correction: weight exp(old - rollout) logprobs, truncated or masked above the threshold.
    rollout_is_level: RolloutISLevel = "none"
    rollout_is_mode: RolloutISMode = "truncate"
    rollout_is_threshold: float = 2.0
    # Adaptive KL-reward coefficient (Ziegler et al. 2019): 0 keeps kl_reward_coef fixed.
    kl_target: float = 0.0
    kl_horizon: int = 10000
    # Dr.GRPO's constant normalizer for "seq-mean-token-sum-norm"; 0 means the batch's padded length T.
    loss_agg_max_len: int = 0
    # DAPO overlong reward shaping: a linear penalty over the last `overlong_buffer_len` tokens before the
    # maximum response length, reaching -overlong_penalty_factor at it; 0 disables it.
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    # Appended in 0.3.0. SAPO's gate temperatures for A > 0 and A <= 0 (arXiv 2511.20347; verl tau_pos/tau_neg).
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    # Clip-Cov and KL-Cov (arXiv 2505.22617): the share of response tokens they treat, Clip-Cov's covariance
    # window [lb, ub] and KL-Cov's |log ratio| coefficient (verl policy_loss.clip_cov_* / kl_cov_ratio /
    # ppo_kl_coef).
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    kl_cov_coef: float = 0.1
    # DPPO (arXiv 2602.04879): trust-region thresholds on the probability change (TV) or the binary KL, for
    # A > 0 (high) and A < 0 (low), and the truncation of its detached IS ratio.
    dppo_tv_low: float = 0.15
    dppo_tv_high: float = 0.15
    dppo_kl_low: float = 0.05
    dppo_kl_high: float = 0.05
    dppo_is_cap: float = 20.0
    # IcePop (arXiv 2510.18855): with rollout_is_mode "mask", weights below this are masked too; 0: no bound.
    rollout_is_threshold_lower: float = 0.0
    # Divide the mismatch weights by their mean (over tokens, or over sequences at sequence level).
    rollout_is_batch_normalize: bool = False
    # Rejection sampling: drop tokens (or whole sequences, by the product of their ratios) whose
    # pi_old / pi_rollout lies outside [rollout_rs_threshold_lower, rollout_rs_threshold]; lower 0 means
    # 1 / rollout_rs_threshold.
    rollout_rs_level: RolloutISLevel = "none"
    rollout_rs_threshold: float = 2.0
    rollout_rs_threshold_lower: float = 0.0
    # Appended in 0.4.0. DRO's quadratic log-ratio penalty coefficient (loss "dro").
    dro_beta: float = 0.1
    # Loss "bypass_mode" (verl): the batch's old_logprobs are the rollout's; "ppo_clip" or "reinforce" (then
    # weighted by rollout_is_level / rollout_is_threshold); rejection by comma-chained verl criteria
    # (offpolicy.REJECTION_CRITERIA) with verl's threshold spec, "" for none.
    bypass_loss_type: str = "ppo_clip"
    bypass_rs_criteria: str = ""
    bypass_rs_threshold: str = ""
    # The optimal token baseline: past the second-longest response of a group, the longest one (if unique) has no
    # baseline (its advantage is its return); verl's handle_zero_tail, True by default since early 2026.
    otb_handle_zero_tail: bool = True
    # GDPO (arXiv 2601.05242): weight of each reward component; empty: all 1.
    gdpo_reward_weights: tuple[float, ...] = ()
    # pf-PPO (arXiv 2409.06957): resample the batch by reward-derived weights before the update; "none": off.
    pf_ppo_method: PfPpoMethod = "none"
    pf_ppo_weight_pow: float = 2.0
    # Asynchronous training: samples may be made by a policy up to this many versions older than the one
    # being updated (0: on-policy, every step waits for its own generation). Consumer: the apps' producer.
    max_staleness: int = 0
    # Routing replay of a mixture-of-experts policy: "r3" makes the learner's MoE layers use the rollout engine's
    # recorded experts (arXiv 2510.23027), "r2" the learner's own from the old-logprob pass, "off" their own
    # top-k. The router's probabilities of the replayed experts still weigh them and get gradients; the
    # agreement with given ids is measured in every mode (learner/routing.py).
    routing_replay: RoutingReplay = "off"
    # The router's load-balancing loss (Switch Transformer, arXiv 2101.03961) added with this weight; 0: off.
    router_aux_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"AlgoConfig.max_staleness must be >= 0, got {self.max_staleness}")
        if self.routing_replay not in ("off", "r2", "r3"):
            raise ValueError(
                f"AlgoConfig.routing_replay must be 'off', 'r2' or 'r3', got {self.routing_replay!r}"
            )
        if self.router_aux_coef < 0:
            raise ValueError(f"AlgoConfig.router_aux_coef must be >= 0, got {self.router_aux_coef}")
        self._check_names()
        self._check_new_losses()
        self._check_rollout_correction()
        if self.clip_ratio_low < 0 or self.clip_ratio_high < 0:
            raise ValueError("AlgoConfig.clip_ratio_low and clip_ratio_high must be >= 0")
        for name in (
            "gspo_clip_ratio_low",
            "gspo_clip_ratio_high",
            "cispo_clip_ratio_low",
            "cispo_clip_ratio_high",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"AlgoConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.rollout_is_threshold <= 1:
            raise ValueError(f"AlgoConfig.rollout_is_threshold must be > 1, got {self.rollout_is_threshold}")
        if self.loss_agg_max_len < 0 or self.overlong_buffer_len < 0:
            raise ValueError("AlgoConfig.loss_agg_max_len and overlong_buffer_len must be >= 0")
        if self.kl_target < 0 or self.kl_horizon < 1:
            raise ValueError(
                f"AlgoConfig.kl_target must be >= 0 and kl_horizon >= 1, got {self.kl_target}, {self.kl_horizon}"
            )
        if self.clip_ratio_c <= 1:
            raise ValueError(f"AlgoConfig.clip_ratio_c must be > 1, got {self.clip_ratio_c}")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ValueError("AlgoConfig.gamma and lam must be in [0, 1]")
        if self.num_updates_per_batch < 1:
            raise ValueError(
                f"AlgoConfig.num_updates_per_batch must be >= 1, got {self.num_updates_per_batch}"
            )

    def _check_names(self) -> None:
        """Names index the registries; a decoded config is checked by msgspec, a constructed one here."""
        for name, kind in (
            ("adv_estimator", AdvantageEstimator),
            ("policy_loss", PolicyLoss),
            ("loss_agg_mode", LossAggMode),
            ("kl_estimator", KLEstimator),
            ("rollout_is_level", RolloutISLevel),
            ("rollout_is_mode", RolloutISMode),
            ("rollout_rs_level", RolloutISLevel),
            ("pf_ppo_method", PfPpoMethod),
        ):
            if getattr(self, name) not in get_args(kind):
                raise ValueError(
                    f"AlgoConfig.{name} {getattr(self, name)!r} is not one of {list(get_args(kind))}"
                )

    def _check_new_losses(self) -> None:
        positive = (
            "sapo_tau_pos",
            "sapo_tau_neg",
            "dppo_tv_low",
            "dppo_tv_high",
            "dppo_kl_low",
            "dppo_kl_high",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"AlgoConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"AlgoConfig.{name} must be in (0, 1], got {getattr(self, name)}")
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(
                f"AlgoConfig.clip_cov_lb must be < clip_cov_ub, got {self.clip_cov_lb}, {self.clip_cov_ub}"
            )
        if self.kl_cov_coef < 0:
            raise ValueError(f"AlgoConfig.kl_cov_coef must be >= 0, got {self.kl_cov_coef}")
        if self.dppo_is_cap < 1:
            raise ValueError(f"AlgoConfig.dppo_is_cap must be >= 1, got {self.dppo_is_cap}")
        if any(w < 0 for w in self.gdpo_reward_weights):
            raise ValueError(f"AlgoConfig.gdpo_reward_weights must be >= 0, got {self.gdpo_reward_weights}")
        if self.pf_ppo_weight_pow <= 0:
            raise ValueError(f"AlgoConfig.pf_ppo_weight_pow must be > 0, got {self.pf_ppo_weight_pow}")

    def _check_rollout_correction(self) -> None:
        lower = self.rollout_is_threshold_lower
        if lower < 0 or lower >= self.rollout_is_threshold:
            raise ValueError(
                f"AlgoConfig.rollout_is_threshold_lower must be in [0, rollout_is_threshold), got {lower}"
            )
        if lower > 0 and self.rollout_is_mode != "mask":
            raise ValueError(
                "AlgoConfig.rollout_is_threshold_lower > 0 (IcePop) needs rollout_is_mode='mask', "
                f"got {self.rollout_is_mode!r}"
            )
        if self.rollout_rs_threshold <= 1:
            raise ValueError(f"AlgoConfig.rollout_rs_threshold must be > 1, got {self.rollout_rs_threshold}")
        if not 0 <= self.rollout_rs_threshold_lower < 1:
            raise ValueError(
                f"AlgoConfig.rollout_rs_threshold_lower must be in [0, 1), got {self.rollout_rs_threshold_lower}"
            )


class OptimConfig(_Config, frozen=True, kw_only=True):
    """AdamW with linear warmup then cosine decay to `min_lr_ratio * lr`.

    Producer: the app's config. Consumer: the learner.
    """

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    num_warmup_steps: int = 0
    num_training_steps: int = 1000
    min_lr_ratio: float = 0.0
    clip_grad_norm: float = 1.0
    micro_batch_size: int = 4
    mini_batch_size: int = 0  # 0: the whole batch is one mini-batch

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"OptimConfig.lr must be > 0, got {self.lr}")
        if self.micro_batch_size < 1:
            raise ValueError(f"OptimConfig.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.num_training_steps < 1:
            raise ValueError(f"OptimConfig.num_training_steps must be >= 1, got {self.num_training_steps}")


class Experience(_Wire, kw_only=True):
    """A training batch of B sequences of length T (prompt + response, right padded).

    Producer: the controller's step (after rollout, reward, logprobs, advantages). Consumer: the learner's
    `update`. Shapes: every tensor is [B, T] except `group_ids` [B]; `response_mask` marks the tokens
    the loss sees (response, not padding); logprobs and advantages are aligned to `input_ids`.
    """

    input_ids: EncodedTensor  # [B, T] int64
    attention_mask: EncodedTensor  # [B, T] bool or int
    response_mask: EncodedTensor  # [B, T] bool
    old_logprobs: EncodedTensor  # [B, T] float32
    advantages: EncodedTensor  # [B, T] float32
    ref_logprobs: EncodedTensor | None = None  # [B, T]
    rollout_logprobs: EncodedTensor | None = None  # [B, T], for rollout/train mismatch correction
    returns: EncodedTensor | None = None  # [B, T], critic targets
    old_values: EncodedTensor | None = None  # [B, T], for the clipped value loss
    group_ids: EncodedTensor | None = None  # [B] int64, prompt group of each sequence
    policy_version: int = 0


class TrainStats(_Wire, kw_only=True):
    """What one `update` reports. `metrics` holds loss-specific figures (clip fraction, approx KL, ...).

    Producer: the learner. Consumer: the controller (all-reduced across ranks) and the run's metrics log.
    """

    step: int
    loss: float
    grad_norm: float
    lr: float
    num_tokens: int
    num_skipped_steps: int = 0
    metrics: dict[str, float] = {}


class LearnerConfig(_Config, frozen=True, kw_only=True):
    """How the learner runs an update; the objective is `AlgoConfig`, the optimizer `OptimConfig`.

    Producer: the app's config. Consumer: `yatt_algos.learner` (torch and Megatron-Core backends).
    """

    data_parallel: Literal["ddp", "fsdp2"] = "ddp"  # torch backend only
    max_tokens_per_micro_batch: int = 0  # > 0: pack micro-batches by padded tokens, not micro_batch_size
    gradient_checkpointing: bool = False
    lora_rank: int = 0  # > 0: train LoRA adapters through peft instead of all weights
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    logits_chunk_size: int = 1024  # positions per chunk in logprob and entropy
    # torch backend: False runs the output projection and log-softmax only where the target is a response
    # token (`response_mask`), as TRL's `logits_to_keep` does: the prompt's positions get 0, which no policy or
    # value loss, KL or entropy reads (the jobs' default; about 2.8x less learner time at a 32k vocabulary with
    # prompts twice the response). True scores every real token (this library's default: the logprobs of the
    # whole sequence)
    score_prompt_tokens: bool = True
    value_clip_range: float = 0.2  # the critic's clipped value loss
    temperature: float = 1.0  # logits are divided by the rollout's sampling temperature before log_softmax
    # which learner a job builds: the torch backend with DDP or FSDP2 over its ranks, or Megatron-Core (TP, PP:
    # the job's model.tensor_parallel, model.pipeline_parallel). "fsdp2" and data_parallel="fsdp2" are the same.
    backend: Literal["ddp", "fsdp2", "megatron"] = "ddp"

    def __post_init__(self) -> None:
        if self.backend == "megatron" and self.data_parallel == "fsdp2":
            raise ValueError(
                "LearnerConfig.backend='megatron' conflicts with data_parallel='fsdp2' (a torch-backend setting)"
            )
        for name in ("max_tokens_per_micro_batch", "lora_rank"):
            if getattr(self, name) < 0:
                raise ValueError(f"LearnerConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.logits_chunk_size < 1:
            raise ValueError(f"LearnerConfig.logits_chunk_size must be >= 1, got {self.logits_chunk_size}")
        if self.value_clip_range < 0:
            raise ValueError(f"LearnerConfig.value_clip_range must be >= 0, got {self.value_clip_range}")
        if self.temperature <= 0:
            raise ValueError(f"LearnerConfig.temperature must be > 0, got {self.temperature}")
