"""TEST-ONLY CPU shim for Megatron-Core 0.16 inside a job's learner workers; never a product path.

The Megatron backend targets CUDA. Its forward calls CUDA in two places that have nothing to do with the math:
RoPE moves `inv_freq` to `torch.cuda.current_device()`, and the RNG tracker forks CUDA generator states around
dropout regions. At pipeline size > 1 two more: the 1F1B schedule makes its token counter with `device="cuda"`
(pipeline_parallel/schedules.py, `forward_backward_pipelining_without_interleaving`), and the p2p shape
exchange calls `torch.cuda.synchronize()` after its gloo-capable `batch_isend_irecv`
(pipeline_parallel/p2p_communication.py, `_communicate_shapes`). `install()` (called by a learner worker only
when $YATT_TEST_MEGATRON_CPU_SHIM=1 and no CUDA is visible) makes, for the rest of that worker process,
`torch.cuda.current_device` return the CPU device, `torch.cuda.synchronize` do nothing (no CUDA work exists),
the schedules module's `torch.zeros` put its "cuda" tensors on the CPU, and puts Megatron's inference RNG
tracker in place (its `fork()` does nothing; the tiny test models have no dropout). The same patches as the
learner tests' conftest shim (packages/yatt-algos/tests/learner/conftest.py).
"""

from __future__ import annotations


class _ScheduleTorch:
    """`torch` as Megatron's schedules module sees it under the shim: the same, but `device="cuda"` in
    `zeros` (its one use there: the token counter) means the CPU."""

    def __getattr__(self, name: str):
        import torch

        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        import torch

        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def install() -> None:
    import torch
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None
    schedules.torch = _ScheduleTorch()
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
