"""Recording a mixture-of-experts router's choices during generation (rollout routing replay, R3).

The MoE blocks of transformers' Qwen2-MoE, Qwen3-MoE and Mixtral call a router module (`*TopKRouter`) that
returns `(router_logits, top_k_weights, top_k_index)` for the flattened tokens [N, H] of the forward.
`RoutingRecorder` hooks every router and keeps each forward's `top_k_index` [N, k] per layer;
`RouteBuffer` writes them, forward by forward, into a batch's [B, width, layers, k] table (prefill columns,
then one column per decode step, for the rows still running) and cuts each row's `RoutedExperts` out of it
at the end: its prompt positions and every generated token but the last. `encode_routes` / `decode_routes`
convert between tensors and the compact wire form.
"""

from __future__ import annotations

from typing import Any

import torch

from yatt_rollout.types import RoutedExperts


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router modules of `model` in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def encode_routes(ids: torch.Tensor) -> RoutedExperts:
    """Expert ids [positions, layers, k] (any integer dtype, values in [0, 32768)) as `RoutedExperts`."""
    if ids.dim() != 3:
        raise ValueError(f"routed expert ids must be [positions, layers, k], got shape {tuple(ids.shape)}")
    small = ids.numel() == 0 or int(ids.max()) < 256
    dtype = torch.uint8 if small else torch.int16
    data = ids.to("cpu", dtype).contiguous().numpy().tobytes()
    return RoutedExperts(
        num_layers=ids.shape[1], top_k=ids.shape[2], dtype="uint8" if small else "int16", data=data
    )


def decode_routes(routes: RoutedExperts) -> torch.Tensor:
    """`RoutedExperts` as an int64 tensor [positions, layers, k]."""
    dtype = torch.uint8 if routes.dtype == "uint8" else torch.int16
    if not routes.data:
        return torch.zeros((0, routes.num_layers, routes.top_k), dtype=torch.long)
    flat = torch.frombuffer(bytearray(routes.data), dtype=dtype)
    return flat.view(-1, routes.num_layers, routes.top_k).long()


class RoutingRecorder:
    """Forward hooks on every router of `model`; `take()` gives the ids of the forwards since the last take.

    Hooks stay until `close()`. Each router call appends its `top_k_index` [N, k]; a forward calls every
    router once, in layer order, so `take()` stacks them to [N, layers, k].
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = moe_routers(model)
        self._seen: list[torch.Tensor] = []
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    @property
    def top_k(self) -> int:
        return int(getattr(self.routers[0], "top_k", 0)) if self.routers else 0

    def _hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._seen.append(output[2])

    def take(self) -> torch.Tensor:
        """Ids [N, layers, k] of the one forward since the last take (cleared)."""
        seen, self._seen = self._seen, []
        if len(seen) != self.num_layers:
            raise RuntimeError(f"expected one call of each of {self.num_layers} routers, saw {len(seen)}")
        return torch.stack(seen, dim=1)

    def clear(self) -> None:
        self._seen = []

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class RouteBuffer:
    """One batch's routing table [B, width + max_new, layers, k] on the device, filled forward by forward.

    Column c is the forward of the left-padded sequence's token c: prompts end at column `width`, generated
    token s sits at column `width + s`.
    """

    def __init__(
        self, recorder: RoutingRecorder, num_rows: int, width: int, max_new: int, device: torch.device
    ) -> None:
        self.recorder = recorder
        self.width = width
        shape = (num_rows, width + max_new, recorder.num_layers, recorder.top_k)
        self.table = torch.zeros(shape, dtype=torch.int16, device=device)
        recorder.clear()

    def prefill(self, live: torch.Tensor, num_cols: int) -> None:
        """The prefill of rows `live` [L] over columns [0, num_cols) (a re-prefill overwrites)."""
        ids = self.recorder.take()  # [L * num_cols, layers, k]
        self.table[live, :num_cols] = ids.view(len(live), num_cols, *ids.shape[1:]).to(torch.int16)

    def step(self, live: torch.Tensor, step: int) -> None:
        """The decode forward of rows `live` [L] feeding their token `step`."""
        ids = self.recorder.take()  # [L, layers, k]
        self.table[live, self.width + step] = ids.to(torch.int16)

    def rows(self, prompt_lens: list[int], num_tokens: list[int]) -> list[RoutedExperts]:
        """Each row's positions: its prompt, then its tokens but the last; one transfer to the host."""
        table = self.table.cpu()
        return [
            encode_routes(table[i, self.width - p : self.width + n - 1])
            for i, (p, n) in enumerate(zip(prompt_lens, num_tokens, strict=True))
        ]
