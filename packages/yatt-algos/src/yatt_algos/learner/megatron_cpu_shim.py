"""TEST-ONLY CPU shim for megatron-core 0.16, never a product path: the Megatron backend targets GPUs.

Megatron-Core calls CUDA in places that have nothing to do with the math: RoPE moves its `inv_freq` to
`torch.cuda.current_device()`, the RNG tracker forks CUDA generator states around dropout regions, and at
pipeline size > 1 the 1F1B schedule makes its token counter with `device="cuda"`
(pipeline_parallel/schedules.py, `forward_backward_pipelining_without_interleaving`) and the p2p shape exchange
calls `torch.cuda.synchronize()` after its (gloo-capable) `batch_isend_irecv` (pipeline_parallel/
p2p_communication.py, `_communicate_shapes`). Under the shim `torch.cuda.current_device` returns the CPU
device, `torch.cuda.synchronize` does nothing (no CUDA work exists), the schedules module's `torch.zeros` puts
its "cuda" tensors on the CPU, and the tracker is Megatron's own inference tracker, whose `fork()` does nothing
(the tiny test models have no dropout).

Two users, one shim: yatt-algos' learner tests (`megatron_cpu_shim()`, a context that restores everything) and
yatt-apps' job tests, whose learner workers call `install()` for the rest of their process when
$YATT_TEST_MEGATRON_CPU_SHIM=1 and no CUDA is visible.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class _ScheduleTorch:
    """`torch` as Megatron's pipeline schedules module sees it under the shim: the same, except `zeros`, whose
    one `device="cuda"` call there (the schedule's token counter) makes its tensor on the CPU."""

    def __getattr__(self, name: str):
        import torch

        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        import torch

        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def install() -> tuple:
    """Apply the shim for the rest of this process; returns what it replaced (see `megatron_cpu_shim`)."""
    import torch
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom

    real = torch.cuda.current_device, torch.cuda.synchronize, schedules.torch
    # Megatron only hands the "current device" on to tensor constructors, where a torch.device works
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None
    schedules.torch = _ScheduleTorch()
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return real


@contextlib.contextmanager
def megatron_cpu_shim() -> Iterator[None]:
    """The shim inside this context only; everything is restored after it."""
    import torch
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom

    real = install()
    try:
        yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize, schedules.torch = real
        mrandom.initialize_rng_tracker(force_reset=True)
