"""How an engine treats its device: which attention kernels decoding may use, and handing freed memory back
to the system after a sleep."""

from __future__ import annotations

import contextlib

import torch


def decode_attention(device: torch.device) -> contextlib.AbstractContextManager:
    """On CUDA, decoding leaves cuDNN's attention out: it builds a graph for every new (batch, KV length) shape,
    and decoding meets a new KV length at every token until those caches are warm (H100, a 1024-wide 8-layer
    Qwen2 in bf16, 64 prompts x 128 tokens: 918 tokens/s on first sight of the shapes with it, 10,054 without
    it; warm, 8,184 with it). Flash, memory-efficient and math kernels need no per-shape build."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def release_free_memory(device: torch.device) -> None:
    """Hand the allocators' free memory back to the system: CUDA's caching allocator, glibc's heap."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed blocks under the mmap threshold stay in the heap
    except (OSError, AttributeError):  # not glibc: freed memory returns as that allocator decides
        pass
