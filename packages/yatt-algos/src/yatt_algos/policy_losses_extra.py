"""The policy losses verl users bring along: GMPO, GPG, plain REINFORCE, SAPO, Clip-Cov, KL-Cov, DPPO (TV, KL).

Same signature and conventions as `policy_losses` (which registers them in `POLICY_LOSSES`): per-token loss
[B, T], zero where masked, aggregated by the caller under `config.loss_agg_mode`; detached scalar metrics;
the rollout mismatch weight and rejection of `policy_loss_common.finish`. Unlike verl, no loss here forces an
aggregation mode: where verl hard-codes one (GMPO, SAPO) the docstring names it, so set `loss_agg_mode` to it
for parity.
"""

from __future__ import annotations

import torch

from yatt_algos.policy_loss_common import clip_frac, finish, prepare, ratio_metrics
from yatt_algos.types import AlgoConfig


def _masked_logprobs(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, logprobs, 0.0)  # padding may hold anything; it must not reach the graph


def gmpo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    rollout_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO, geometric-mean policy optimization (Zhao et al., arXiv 2507.20673); verl's "geo_mean".

    Per token the log ratio l = log(pi / pi_old) is clipped in log space on the side its advantage's sign
    pushes: l' = sgn(A) min(sgn(A) l, sgn(A) clip(l, -clip_ratio_low, clip_ratio_high)). Per sequence
    s_i = exp(mean_t l'), A_i = mean_t A, loss_i = -A_i s_i (the geometric mean of the token ratios, so one
    outlier token moves the sequence less than in the arithmetic mean). Every unmasked token of sequence i
    carries loss_i [B, T]: "seq-mean-token-mean" gives verl's mean over sequences (verl ignores
    loss_agg_mode here). clip_frac / clip_frac_lower: tokens whose log ratio is outside the range, with
    A > 0 / A < 0 (as verl counts them, whichever side the min picks).
    Departures: the log ratio is clamped to +-20 first (verl leaves it); a rollout mismatch weight multiplies
    each token (verl takes the geometric mean of the token weights per sequence).
    """
    mask, log_ratio = prepare(logprobs, old_logprobs, advantages, response_mask, rollout_logprobs)
    sign = torch.sign(advantages)
    clamped = log_ratio.clamp(-config.clip_ratio_low, config.clip_ratio_high)
    clipped_log = sign * torch.minimum(sign * log_ratio, sign * clamped)  # [B, T]
    lengths = mask.sum(dim=-1).clamp(min=1)  # [B]
    seq_ratio = (torch.where(mask, clipped_log, 0.0).sum(-1) / lengths).exp()  # [B]
    seq_adv = torch.where(mask, advantages, 0.0).sum(-1) / lengths  # [B]
    loss = (-seq_adv * seq_ratio).unsqueeze(-1).expand_as(log_ratio)
    metrics = ratio_metrics(log_ratio, mask)
    was_clipped = log_ratio.detach() != clamped.detach()
    metrics["clip_frac"] = clip_frac(was_clipped & (advantages > 0), mask)
    metrics["clip_frac_lower"] = clip_frac(was_clipped & (advantages < 0), mask)
    return finish(loss, mask, metrics, old_logprobs, rollout_logprobs, config)


def reinforce(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    rollout_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain REINFORCE (Williams 1992, "Simple statistical gradient-following algorithms"):
    loss = -A log pi per token [B, T], no ratio and no clip: on-policy, so one update per batch
    (num_updates_per_batch = 1) is what it assumes; pi_old enters only the metrics and the mismatch weight.
    verl's `compute_policy_loss_reinforce` (its bypass mode) with the IS weight of `rollout_is_level`.
    """
    mask, log_ratio = prepare(logprobs, old_logprobs, advantages, response_mask, rollout_logprobs)
    loss = -advantages * _masked_logprobs(logprobs, mask)
    metrics = {**ratio_metrics(log_ratio, mask), "clip_frac": log_ratio.new_zeros(())}  # nothing is clipped
    return finish(loss, mask, metrics, old_logprobs, rollout_logprobs, config)


def gpg(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    rollout_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG's loss (Chu et al., arXiv 2504.02546): loss = -A log pi per token [B, T], REINFORCE's, with no
    surrogate, clip or KL; GPG's correction lives in its advantage (`advantages.gpg`). As verl's "gpg"."""
    return reinforce(
        logprobs, old_logprobs, advantages, response_mask, config, rollout_logprobs=rollout_logprobs
    )


def sapo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    rollout_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO, soft adaptive policy optimization (Gao et al., arXiv 2511.20347).

    The hard clip becomes a smooth gate: f(r) = sigmoid(tau (r - 1)) * 4 / tau, loss = -f(r) A [B, T], with
    tau = sapo_tau_pos where A > 0 and sapo_tau_neg elsewhere. At r = 1 the gradient equals PPO's (f'(1) = 1)
    and it decays smoothly as r leaves 1, faster for the larger tau. As verl's "sapo", which forces
    "seq-mean-token-mean" aggregation; here `loss_agg_mode` decides. Metric gate_mean: mean f(r).
    """
    mask, log_ratio = prepare(logprobs, old_logprobs, advantages, response_mask, rollout_logprobs)
    tau = torch.where(advantages > 0, config.sapo_tau_pos, config.sapo_tau_neg).to(log_ratio.dtype)
    gate = torch.sigmoid(tau * (log_ratio.exp() - 1.0)) * (4.0 / tau)
    loss = -gate * advantages
    metrics = ratio_metrics(log_ratio, mask)
    metrics["gate_mean"] = torch.where(mask, gate.detach(), 0.0).sum() / mask.sum().clamp(min=1)
    metrics["clip_frac"] = log_ratio.new_zeros(())  # a soft gate clips nothing
    return finish(loss, mask, metrics, old_logprobs, rollout_logprobs, config)


def _covariance(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(A - mean A)(log pi - mean log pi) per token, means over this call's unmasked tokens; detached. [B, T]"""
    n = mask.sum().clamp(min=1)
    lp, adv = logprobs.detach(), advantages.detach()
    lp_mean = torch.where(mask, lp, 0.0).sum() / n
    adv_mean = torch.where(mask, adv, 0.0).sum() / n
    return (adv - adv_mean) * (lp - lp_mean)


def clip_cov(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    rollout_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Cui et al., "The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617).

    PPO-clip (clip_ratio_low/high), and then up to max(1, int(clip_cov_ratio * N)) tokens (N: this call's
    response tokens) whose covariance (A - mean A)(log pi - mean log pi) lies strictly inside
    (clip_cov_lb, clip_cov_ub) and which PPO did not clip already are cut out of the loss (value and
    gradient 0): the high-covariance tokens are the ones that drive entropy collapse. [B, T].
    clip_frac: share of the cut tokens (as verl's pg_clipfrac here). Departure: verl picks the cut tokens
    from the candidates with the global torch RNG; here a fixed-seed permutation, so a call is a pure
    function of its inputs.
    """
    mask, log_ratio = prepare(logprobs, old_logprobs, advantages, response_mask, rollout_logprobs)
    ratio = log_ratio.exp()
    loss_plain = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)
    by_ppo = (loss_clipped.detach() > loss_plain.detach()) & mask
    cov = _covariance(logprobs, advantages, mask)
    candidates = (mask & ~by_ppo & (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub)).flatten()
    index = candidates.nonzero().flatten()
    budget = max(int(config.clip_cov_ratio * int(mask.sum())), 1)
    if len(index) > budget:
        order = torch.randperm(len(index), generator=torch.Generator().manual_seed(0))
        index = index[order[:budget].to(index.device)]
    cut = torch.zeros_like(candidates).index_fill_(0, index, True).view_as(mask)
    loss = torch.where(cut, 0.0, torch.maximum(loss_plain, loss_clipped))
    metrics = ratio_metrics(log_ratio, mask)
    metrics["clip_frac"] = clip_frac(cut, mask)
    metrics["ppo_clip_frac"] = clip_frac(by_ppo, mask)
    return finish(loss, mask, metrics, old_logprobs, rollout_logprobs, config)


def kl_cov(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    rollout_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (Cui et al., arXiv 2505.22617): the unclipped surrogate -A r on every token, plus
    kl_cov_coef * |log r| on the max(1, int(kl_cov_ratio * N)) tokens of largest covariance
    (A - mean A)(log pi - mean log pi) (N: this call's response tokens; ranked over those N only). [B, T]. No ratio clip: the KL term
    on the high-covariance tokens is the only restraint. clip_frac: the share of penalized tokens.
    As verl's "kl_cov" (its ppo_kl_coef is kl_cov_coef here).
    """
    mask, log_ratio = prepare(logprobs, old_logprobs, advantages, response_mask, rollout_logprobs)
    loss = -advantages * log_ratio.exp()
    # top-k over the valid tokens only (their flat indices in row-major order), as verl selects: padding never
    # enters the ranking, so ties break among valid tokens exactly as verl's topk does
    valid = mask.flatten().nonzero(as_tuple=True)[0]  # [N]
    cov = _covariance(logprobs, advantages, mask).flatten()[valid]
    picked = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    if valid.numel():
        top = torch.topk(cov, max(1, int(valid.numel() * config.kl_cov_ratio))).indices
        picked = picked.index_fill_(0, valid[top], True)
    picked = picked.view_as(mask)
    loss = torch.where(picked, loss + config.kl_cov_coef * log_ratio.abs(), loss)
    metrics = ratio_metrics(log_ratio, mask)
    metrics["clip_frac"] = clip_frac(picked, mask)
    return finish(loss, mask, metrics, old_logprobs, rollout_logprobs, config)


def _dppo(logprobs, old_logprobs, advantages, response_mask, config, rollout_logprobs, inside):
    """The shared DPPO loss: -A sg(min(r, dppo_is_cap)) log pi on tokens whose update stays inside the
    trust region (`inside(log p, log p_old) -> (ok if A > 0, ok if A <= 0)`, bool [B, T] each), 0 elsewhere."""
    mask, log_ratio = prepare(logprobs, old_logprobs, advantages, response_mask, rollout_logprobs)
    ratio = log_ratio.detach().exp()
    with torch.no_grad():
        ok_pos, ok_neg = inside(_masked_logprobs(logprobs, mask), _masked_logprobs(old_logprobs, mask))
        valid = torch.where(advantages > 0, ok_pos, ok_neg)
    weight = ratio.clamp(max=config.dppo_is_cap)
    loss = torch.where(valid, -advantages * weight * _masked_logprobs(logprobs, mask), 0.0)
    metrics = ratio_metrics(log_ratio, mask)
    metrics["clip_frac"] = clip_frac(~valid, mask)
    metrics["is_cap_frac"] = clip_frac(valid & (ratio > config.dppo_is_cap), mask)
    return finish(loss, mask, metrics, old_logprobs, rollout_logprobs, config)


def dppo_tv(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    rollout_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-TV (Qi et al., "Rethinking the Trust Region in LLM RL", arXiv 2602.04879).

    The trust region is on the sampled token's probability change, not on the ratio: a token with A > 0 is
    kept while p - p_old <= dppo_tv_high, one with A <= 0 while p - p_old >= -dppo_tv_low; kept tokens get
    loss -A sg(min(r, dppo_is_cap)) log pi (the policy gradient with a truncated IS weight), others 0. [B, T].
    As verl's "dppo_tv", whose thresholds are its actor clip_ratio_low/high and whose cap is clip_ratio_c.
    clip_frac: tokens outside the region; is_cap_frac: kept tokens whose ratio hit the cap.
    """

    def inside(lp, old_lp):
        p, p_old = lp.exp(), old_lp.exp()
        return p - p_old <= config.dppo_tv_high, p - p_old >= -config.dppo_tv_low

    return _dppo(logprobs, old_logprobs, advantages, response_mask, config, rollout_logprobs, inside)


def dppo_kl(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    rollout_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-KL (arXiv 2602.04879): as `dppo_tv` with the binary KL of the sampled token,
    KL(p_old || p) = p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p)) (1e-8 guards the second
    log). A token with A > 0 is kept while the KL <= dppo_kl_high or p <= p_old (the update is not pushing
    it up); one with A <= 0 while the KL <= dppo_kl_low or p >= p_old. [B, T]. As verl's "dppo_kl".
    """

    def inside(lp, old_lp):
        p, p_old = lp.exp(), old_lp.exp()
        kl = p_old * (old_lp - lp) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        return (kl <= config.dppo_kl_high) | (p <= p_old), (kl <= config.dppo_kl_low) | (p >= p_old)

    return _dppo(logprobs, old_logprobs, advantages, response_mask, config, rollout_logprobs, inside)


def dro(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig,
    *,
    rollout_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DRO (direct reward optimization with a quadratic log-ratio penalty, verl's / SkyRL's "dro"):
    loss_t = -(A_t log pi_t - dro_beta / 2 (log pi_t - log pi_old_t)^2). [B, T].

    Gradient per token: -A_t + dro_beta (log pi_t - log pi_old_t) times d log pi_t; at the old policy it is
    the REINFORCE gradient, and the penalty pulls the update back as the log-ratio grows (no clipping).
    """
    mask, log_ratio = prepare(logprobs, old_logprobs, advantages, response_mask, rollout_logprobs)
    lp = _masked_logprobs(logprobs, mask)  # padding may hold inf/NaN: no gradient may flow from it
    diff = lp - torch.where(mask, old_logprobs, 0.0).detach()
    loss = -(torch.where(mask, advantages, 0.0) * lp - 0.5 * config.dro_beta * diff.square())
    loss = torch.where(mask, loss, 0.0)
    metrics = {**ratio_metrics(log_ratio, mask), "clip_frac": log_ratio.new_zeros(())}  # nothing is clipped
    return finish(loss, mask, metrics, old_logprobs, rollout_logprobs, config)
