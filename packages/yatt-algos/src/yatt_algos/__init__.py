"""yatt-algos: the RL math and the learner.

Advantage estimators, policy and value losses, KL, loss aggregation, filters, CAPO credit and Bone Soup, as
pure functions on torch tensors; the policy and critic learners. `import yatt_algos` loads msgspec only;
the math modules import torch. Import them by name:

- `advantages`: ADVANTAGE_ESTIMATORS (gae, grpo, rloo, reinforce_pp, reinforce_pp_baseline, remax, opo, gpg,
  grpo_passk, gdpo, optimal_token_baseline)
- `policy_losses`: POLICY_LOSSES (ppo_clip, dual_clip, gspo, cispo, and from `policy_losses_extra` gmpo, gpg,
  sapo, clip_cov, kl_cov, dppo_tv, dppo_kl, reinforce); `rollout_correction` (truncated IS, IcePop, batch
  normalization, rejection sampling); `pf_ppo` (policy filtration by resampling)
- `aggregation`: AGG_MODES, aggregate (global normalizers for accumulation and data parallelism)
- `kl`: KL_ESTIMATORS (k1, k2, k3, abs, straight-through k1+/k3+/abs+, verl's low_var_kl names), kl_penalty,
  apply_kl_penalty, adaptive_kl_coef
- `value`: value_loss, logprobs/entropy from logits (chunked)
- `filters`: DAPO dynamic sampling, overlong penalty and masking
- `capo`: critique voting, step spans, token rewards, group normalization
- `dpo`: offline preference losses (LOSS_TYPES sigmoid/DPO, ipo, hinge; label smoothing), dpo_loss, preference_sums
- `bone_soup`: backbone matrix, merging coefficients, state-dict merging
- `groups`, `checks`: group statistics by id; input checks
"""

from importlib.metadata import version as _version

__version__ = _version("yatt-algos")
