"""The learner: policy and critic update engines, the part that runs inside each trainer rank.

Two backends with one interface (`interface.PolicyLearner`, `interface.CriticLearner`):

- `torch_backend`: HF causal LMs (and token-classification critics), data parallel by DDP or FSDP2 over a
  process group the caller gives it (gloo on CPU, NCCL on GPU), optional LoRA (peft) and gradient checkpointing.
- `megatron_backend`: Megatron-Core `GPTModel` built from an HF config, tensor and pipeline parallel, with
  `megatron_convert` moving weights between HF and Megatron naming.

The pieces both use are plain modules: `packing` (mini- and micro-batches, token-budget packing), `optim`
(AdamW, warmup + cosine, the non-finite guard), `update_loop` (one PPO-style update with global normalizers),
`checkpoint` (state with RNG, atomic files), `export` (named-tensor buckets for weight sync) and `mismatch`
(the rollout/train logprob mismatch metric).
The learner knows nothing of Ray. This package file imports nothing heavy: import the backend module you use.
"""
