"""TEST-ONLY CPU shim for Megatron-Core 0.16 inside a job's learner workers; never a product path.

The Megatron backend targets CUDA. Its forward calls CUDA in two places that have nothing to do with the math:
RoPE moves `inv_freq` to `torch.cuda.current_device()`, and the RNG tracker forks CUDA generator states around
dropout regions. `install()` (called by a learner worker only when $YATT_TEST_MEGATRON_CPU_SHIM=1 and no CUDA is
visible) makes `torch.cuda.current_device` return the CPU device for the rest of that worker process and puts
Megatron's inference RNG tracker in place (its `fork()` does nothing; the tiny test models have no dropout).
The same two patches as the learner tests' conftest shim (packages/yatt-algos/tests/learner/conftest.py).
"""

from __future__ import annotations


def install() -> None:
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: torch.device("cpu")
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
