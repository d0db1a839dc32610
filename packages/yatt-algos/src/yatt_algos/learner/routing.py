"""Routing replay for mixture-of-experts policies (R2 / R3), the routing agreement metric, the router's
load-balancing loss.

Rollout routing replay (R3, Ma et al., arXiv 2510.23027): the learner's MoE layers use the experts the
rollout engine chose for each token instead of their own top-k, so that a small numerical difference between
engine and learner cannot flip a near-tie choice and change the token's computation; the weights of the
replayed experts are still the learner router's softmax probabilities (renormalized over them where the
model renormalizes its top-k), so the router gets gradients. R2 replays the learner's own choices from the
old-logprob pass instead. Departure from the paper: positions without a recorded choice (-1: padding, each
sequence's last token) route by the learner's own top-k.

The routers of transformers' Qwen2-MoE, Qwen3-MoE and Mixtral are `*TopKRouter` modules returning
`(router_logits [N, E], top_k_weights [N, k], top_k_index [N, k])` over the forward's flattened tokens.
`RouterHooks` hooks them for one forward: it replaces their choice (replay), records their own choice
(R2, and the agreement metric) and keeps their logits (load-balancing loss).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router modules of `model` in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def router_shape(model: torch.nn.Module) -> tuple[int, int]:
    """(MoE layers, experts per token) of `model`'s routers."""
    routers = moe_routers(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts routers")
    return len(routers), int(getattr(routers[0], "top_k"))  # noqa: B009  (an nn.Module attribute mypy cannot see)


def replayed_weights(logits: torch.Tensor, index: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """The router weights [N, k] of the experts `index` [N, k]: softmax(logits [N, E]) at them, divided by
    their sum when the model renormalizes its top-k (as transformers' routers do), in the logits' dtype."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights = probs.gather(-1, index)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype)


def load_balancing_loss(logits: list[torch.Tensor], top_k: int, valid: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss (arXiv 2101.03961), averaged over layers: E * sum_e f_e * P_e, f_e
    the share of the valid tokens' top-k slots routed to expert e, P_e their mean router probability.
    logits: per layer [N, E]; valid [N] bool. 1.0 when the load is uniform."""
    losses = []
    for layer in logits:
        probs = torch.softmax(layer.float(), dim=-1)[valid]  # [n, E]
        num_experts = probs.shape[-1]
        chosen = torch.topk(probs, top_k, dim=-1).indices
        counts = torch.zeros(num_experts, device=probs.device).index_add_(
            0, chosen.reshape(-1), torch.ones(chosen.numel(), device=probs.device)
        )
        share = counts / max(chosen.numel(), 1)
        losses.append(num_experts * (share * probs.mean(0)).sum())
    return torch.stack(losses).mean()


class RouterHooks:
    """Hooks on every router of `model` for the forwards inside `with`.

    `replay` [b, t, layers, k] (int, -1 where a position routes by its own choice): the experts each position
    uses. After the forward: `own` [b * t, layers, k] the routers' own top-k, `logits` per layer [b * t, E].
    """

    def __init__(self, model: torch.nn.Module, replay: torch.Tensor | None = None) -> None:
        self.routers = moe_routers(model)
        self.replay = None if replay is None else replay.reshape(-1, *replay.shape[2:]).long()
        if self.replay is not None and self.replay.shape[1] != len(self.routers):
            raise ValueError(
                f"routed_experts has {self.replay.shape[1]} layers, the model {len(self.routers)} MoE layers"
            )
        self._own: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        self._handles: list[Any] = []

    @property
    def own(self) -> torch.Tensor:
        return torch.stack(self._own, dim=1)

    def __enter__(self) -> RouterHooks:
        self._handles = [
            r.register_forward_hook(self._hook_of(layer)) for layer, r in enumerate(self.routers)
        ]
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook_of(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
            logits, _weights, index = output
            self._own.append(index.detach())
            self.logits.append(logits)
            if self.replay is None:
                return None
            forced = self.replay[:, layer].to(index.device)  # [N, k]
            if forced.shape != index.shape:
                raise ValueError(
                    f"routed_experts gives {tuple(forced.shape)} choices for layer {layer}, the router made "
                    f"{tuple(index.shape)}"
                )
            index = torch.where(forced >= 0, forced, index)
            renormalize = bool(getattr(module, "norm_topk_prob", True))
            return logits, replayed_weights(logits, index, renormalize), index

        return hook


def agreement(own: torch.Tensor, given: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position, the share of layers whose own top-k set equals the given one, and whether the position
    has a given choice. own, given [N, layers, k] (given -1: none) -> ([N] float, [N] bool)."""
    same = (own.sort(-1).values == given.sort(-1).values.to(own.device)).all(-1)  # [N, layers]
    valid = (given >= 0).all(-1).all(-1).to(own.device)
    return same.float().mean(-1), valid


def routes_to_batch(rows: list[torch.Tensor | None], width: int, layers: int, top_k: int) -> torch.Tensor:
    """Each row's expert ids [positions, layers, k] (None: none recorded) as a batch [B, width, layers, k],
    -1 past a row's positions (int16)."""
    out = torch.full((len(rows), width, layers, top_k), -1, dtype=torch.int16)
    for i, ids in enumerate(rows):
        if ids is not None:
            n = min(ids.shape[0], width)
            out[i, :n] = ids[:n].to(torch.int16)
    return out


ROUTES_KEY = "routed_experts"  # a learner batch's expert ids [B, T, layers, k] (-1: none), beside its tensors


@dataclass
class BatchRouting:
    """What a learner's MoE forwards do with routing for one batch. Rows are the batch's (`row_index`).

    `given` [B, T, layers, k]: the batch's expert ids (-1: none), replayed when `replay`, else only compared
    (the agreement metric). `record` [B, T, layers, k] int16: filled with the learner's own choices (R2's
    old-logprob pass; -1 at padding). `aux_coef`: the load-balancing loss's weight in a training forward.
    """

    given: torch.Tensor | None = None
    replay: bool = False
    record: torch.Tensor | None = None
    aux_coef: float = 0.0


def split_routes(batch: Mapping[str, Any]) -> tuple[dict[str, Any], torch.Tensor | None]:
    """The batch without its expert ids (`ROUTES_KEY`), with `row_index` [B] (so a micro-batch finds its rows'
    ids), and the ids [B, T, layers, k] or None. ValueError when their shape does not match input_ids."""
    out = dict(batch)
    given = out.pop(ROUTES_KEY, None)
    ids = out["input_ids"]
    if given is not None and (given.dim() != 4 or tuple(given.shape[:2]) != tuple(ids.shape)):
        raise ValueError(
            f"{ROUTES_KEY} has shape {tuple(given.shape)}, expected {tuple(ids.shape)} + (layers, k) like input_ids"
        )
    out.setdefault("row_index", torch.arange(ids.shape[0]))
    return out, given


def routed_forward(
    model: torch.nn.Module,
    mb: Mapping[str, torch.Tensor],
    routing: BatchRouting,
    grad: bool,
    forward: Callable[[], dict[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """`forward()` of the micro-batch `mb` under `RouterHooks`, plus (aligned like logprobs: position t holds
    the routing of position t - 1, the forward that predicted token t) "routing_agreement" [b, t] and
    "routing_valid" [b, t] where the batch gives ids, and in a training forward with `aux_coef` the scalar
    "router_aux"."""
    rows, (b, t) = mb["row_index"].cpu(), mb["input_ids"].shape
    given = None if routing.given is None else routing.given[rows, :t]
    if routing.replay and any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
        raise ValueError(
            "algo.routing_replay needs learner.gradient_checkpointing off: the backward's recomputation "
            "would route by the model's own top-k"
        )
    with RouterHooks(model, given if routing.replay else None) as hooks:
        out = forward()
    own, mask = hooks.own, mb["attention_mask"].bool()  # [b * t, layers, k], [b, t]
    if routing.record is not None:
        keep = mask.reshape(-1, 1, 1).cpu()
        routing.record[rows, :t] = torch.where(keep, own.cpu(), -1).view(b, t, *own.shape[1:]).to(torch.int16)
    if given is not None:
        share, valid = agreement(own, given.reshape(b * t, *given.shape[2:]))
        valid = valid.view(b, t) & mask
        out["routing_agreement"] = _shift_right(torch.where(valid, share.view(b, t), 0.0), mask)
        out["routing_valid"] = _shift_right(valid.float(), mask)
    if grad and routing.aux_coef:
        out["router_aux"] = load_balancing_loss(hooks.logits, own.shape[-1], mask.reshape(-1))
    return out


def _shift_right(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[b, t] per position -> [b, t] per predicted token (position t gets position t - 1's), 0 at padding."""
    return torch.where(mask, torch.nn.functional.pad(x[:, :-1], (1, 0)), 0.0)


def routing_objective(
    loss: torch.Tensor,
    metrics: dict[str, torch.Tensor],
    out: Mapping[str, torch.Tensor],
    mb: Mapping[str, torch.Tensor],
    aux_coef: float,
    num_tokens: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy objective (loss share, metrics) plus the MoE terms: `aux_coef` * the load-balancing loss
    (this micro-batch's share: its response tokens / the mini-batch's `num_tokens`), and the metrics
    "moe/router_aux" and "moe/routing_agreement" (over response tokens with given ids) as micro-batch means."""
    mask = mb["response_mask"].bool()
    if "router_aux" in out:
        aux = out["router_aux"]
        loss = loss + aux_coef * aux * (float(mask.sum()) / num_tokens if num_tokens else 0.0)
        metrics = {**metrics, "moe/router_aux": aux.detach()}
    if "routing_agreement" in out:
        valid = (out["routing_valid"] > 0) & mask
        mean = out["routing_agreement"][valid].mean() if bool(valid.any()) else torch.tensor(0.0)
        metrics = {**metrics, "moe/routing_agreement": mean.detach()}
    return loss, metrics
