"""The torch backend: policy and critic learners over HF models.

`TorchPolicyLearner` wraps an HF causal LM (`Qwen2ForCausalLM`, `LlamaForCausalLM`, ...): it computes
per-token logprobs and entropy of the tokens of a batch (for the policy itself, a reference model built with
`optim_config=None`, and the rollout/train mismatch) and runs PPO-style updates with any loss and aggregation
mode of the registries. `TorchCriticLearner` wraps an HF token-classification model with one label (the value
head) and trains it with the clipped value loss.

Alignment: outputs are [B, T] like `input_ids`; position t holds the logprob of input_ids[t] given the tokens
before it (from the logits at t - 1), or the value of that state. Position 0 has no predecessor and holds 0.
Data parallel runs over the process group the caller gives (DDP or FSDP2); the learner creates none.

Mixture-of-experts policies: a batch may carry the rollout's expert ids under "routed_experts"
[B, T, layers, k] (`learner.routing`); every forward then measures the routing agreement, replays them when
`algo.routing_replay` is on, and a training forward adds `algo.router_aux_coef` x the load-balancing loss.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from yatt_algos.learner.export import NamedTensors
from yatt_algos.learner.lm_head import chunked_head, head_token_outputs, hidden_states_only
from yatt_algos.learner.packing import Batch, as_batch, split_mini_batches
from yatt_algos.learner.routing import (
    BatchRouting,
    moe_routers,
    routed_forward,
    router_shape,
    routing_objective,
    split_routes,
)
from yatt_algos.learner.sharded import FileEntries, PendingSave
from yatt_algos.learner.torch_engine import TorchEngine
from yatt_algos.learner.update_loop import Normalizer, critic_objective, policy_objective
from yatt_algos.types import AlgoConfig, Experience, LearnerConfig, OptimConfig, TrainStats
from yatt_algos.value import logprobs_and_entropy_from_logits, logprobs_from_logits


def _shift_right(x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[b, t - 1] outputs predicting tokens 1..t-1 -> [b, t] aligned to input_ids, 0 at position 0 and at
    padding."""
    return torch.where(attention_mask, torch.nn.functional.pad(x, (1, 0)), 0.0)


def token_outputs(
    logits: torch.Tensor, mb: Batch, *, chunk_size: int, temperature: float = 1.0, entropy: str = "none"
) -> dict[str, torch.Tensor]:
    """Logprobs [b, t] (and entropy [b, t] when `entropy` is "grad" or "detached") from full-vocabulary
    causal-LM logits [b, t, V], aligned to mb["input_ids"]."""
    logits = logits[:, :-1]  # [b, t - 1, V]: logits[:, i] predict input_ids[:, i + 1]
    mask = mb["attention_mask"]
    if temperature != 1.0:
        logits = logits / temperature
    labels = mb["input_ids"][:, 1:]
    if entropy == "none":
        return {"logprobs": _shift_right(logprobs_from_logits(logits, labels, chunk_size=chunk_size), mask)}
    # one pass over the logits for both; a "detached" entropy is a metric only
    logprobs, ent = logprobs_and_entropy_from_logits(logits, labels, chunk_size=chunk_size)
    result = {"logprobs": _shift_right(logprobs, mask)}
    result["entropy"] = _shift_right(ent if entropy == "grad" else ent.detach(), mask)
    return result


def causal_lm_forward(
    model: torch.nn.Module,
    mb: Batch,
    *,
    chunk_size: int,
    temperature: float = 1.0,
    entropy: str = "none",
    sum_pi_squared: bool = False,
    score_prompt: bool = True,
) -> dict[str, torch.Tensor]:
    """`token_outputs` of an HF causal LM (or a Qwen2-VL style VLM, see `vision_kwargs`) on the micro-batch:
    logprobs [b, t] (and entropy [b, t]; and "sum_pi_squared" [b, t], sum_v pi(v)^2 of the distribution
    that predicted each token, when asked) aligned to mb["input_ids"].

    The model runs to its final hidden states; the output projection, final logit transform, temperature and
    log-softmax then run `chunk_size` tokens at a time over the positions whose target is not padding
    (with `score_prompt=False`, whose target is a response token, `mb["response_mask"]`; 0 elsewhere),
    recomputed in backward (`lm_head.head_token_outputs`, `chunked_logprobs`), so the [b, t, V] logits never
    exist. A model type whose final transform is unknown takes the full logits (with a warning): the fallback
    where no backbone/projection split is known (it scores every non-padding token)."""
    kwargs = {
        "input_ids": mb["input_ids"],
        "attention_mask": mb["attention_mask"].long(),
        "use_cache": False,
        **vision_kwargs(mb),
    }
    mask = mb["attention_mask"]
    head = chunked_head(model)
    if head is None:
        logits = model(**kwargs).logits
        out = token_outputs(logits, mb, chunk_size=chunk_size, temperature=temperature, entropy=entropy)
        if sum_pi_squared:
            probs = torch.softmax((logits[:, :-1] / temperature).float(), dim=-1)  # [b, t - 1, V]
            out["sum_pi_squared"] = _shift_right(probs.square().sum(-1), mask)
        return out
    with hidden_states_only(head.inner) as keep:
        model(**kwargs)
    hidden = keep.hidden  # [b, t, H]: the input the model gave its lm_head
    if hidden is None:
        raise RuntimeError(f"{type(head.inner).__name__}'s forward did not call its lm_head")
    b, t, width = hidden.shape
    # hidden[:, i] predicts input_ids[:, i + 1]; only the positions whose target is a token the caller scores
    # run the head: with `score_prompt=False` and a response mask in the micro-batch, the response's tokens
    # (no policy or value loss, KL or entropy reads the prompt's: their outputs are 0, as TRL's
    # `logits_to_keep` skips them), else every real token. Padding costs no [chunk, V] work either way
    scored = mask
    if not score_prompt and "response_mask" in mb:
        response = mask & mb["response_mask"].bool()
        if bool(response[:, 1:].any()):  # a filler micro-batch (no response token) keeps its graph
            scored = response
    rows = scored[:, 1:].reshape(-1).nonzero().squeeze(-1)  # [n] flat indices into [b * (t - 1)]
    labels = mb["input_ids"][:, 1:].reshape(-1)[rows].long()
    flat = head_token_outputs(
        hidden[:, :-1].reshape(b * (t - 1), width)[rows],
        head.head,
        labels,
        transform=head.transform,
        chunk_size=chunk_size,
        temperature=temperature,
        entropy=entropy != "none",
        sum_pi_squared=sum_pi_squared,
    )  # [n] or [n, k]
    full = flat.new_zeros((b * (t - 1), *flat.shape[1:])).index_copy(0, rows, flat)
    if entropy == "none" and not sum_pi_squared:
        return {"logprobs": _shift_right(full.view(b, t - 1), mask)}
    full = full.view(b, t - 1, -1)
    result = {"logprobs": _shift_right(full[..., 0], mask)}
    if entropy != "none":
        result["entropy"] = _shift_right(full[..., 1] if entropy == "grad" else full[..., 1].detach(), mask)
    if sum_pi_squared:
        result["sum_pi_squared"] = _shift_right(full[..., 2].detach(), mask)
    return result


def vision_kwargs(mb: Batch) -> dict[str, torch.Tensor]:
    """The VLM inputs of a micro-batch in the model's flat form (none for a text batch).

    Per row in the batch: pixel_values [b, P, D] (zero padded), image_grid_thw [b, N, 3] (all-zero rows pad).
    Out: pixel_values [sum of patches, D] and image_grid_thw [num_images, 3], in row order, and
    mm_token_type_ids [b, t] (0 text, 1 image) as the Qwen2-VL family in transformers 5 needs it."""
    if "pixel_values" not in mb:
        return {}
    grids = mb["image_grid_thw"].long()  # [b, N, 3]
    patches = grids.prod(dim=-1)  # [b, N]: patches per image, 0 for padding
    out = {"mm_token_type_ids": mb["mm_token_type_ids"].long()} if "mm_token_type_ids" in mb else {}
    if int(patches.sum()) == 0:  # a micro-batch of text-only rows
        return out
    pixels = [mb["pixel_values"][row, : int(patches[row].sum())] for row in range(grids.shape[0])]
    return out | {"pixel_values": torch.cat(pixels), "image_grid_thw": grids[patches > 0]}


def value_forward(model: torch.nn.Module, mb: Batch) -> dict[str, torch.Tensor]:
    """Values [b, t] from a token-classification model with one label, aligned like logprobs."""
    out = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"].long())
    if out.logits.shape[-1] != 1:
        raise ValueError(f"the critic model must have one output label, got {out.logits.shape[-1]}")
    return {"values": _shift_right(out.logits[:, :-1, 0].float(), mb["attention_mask"])}


class TorchPolicyLearner:
    """Policy learner over an HF causal LM. `optim_config=None` builds an inference-only learner (reference).
    `micro_batch_size`: sequences per no-grad forward (default: `optim_config.micro_batch_size`, else 4); a job
    gives its reference the policy's, so both forwards run at the size the user set.

    All ranks of `group` must call `update`, `export_weights` (under FSDP2) and `state_dict` (under FSDP2)
    together, each with its own shard of the batch.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        algo: AlgoConfig,
        optim_config: OptimConfig | None,
        learner: LearnerConfig | None = None,
        group: dist.ProcessGroup | None = None,
        micro_batch_size: int | None = None,
    ) -> None:
        learner = learner or LearnerConfig()
        self.engine = TorchEngine(model, algo=algo, optim_config=optim_config, learner=learner, group=group)
        self.micro_batch_size = micro_batch_size or (optim_config.micro_batch_size if optim_config else 4)
        self.moe = bool(
            moe_routers(model)
        )  # a mixture-of-experts policy: its forwards run under router hooks

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.model

    def _forward(self, entropy: str, routing: BatchRouting | None = None, *, sum_pi_squared: bool = False):
        cfg = self.engine.learner

        def forward(model: torch.nn.Module, mb: Batch, grad: bool) -> dict[str, torch.Tensor]:
            def plain() -> dict[str, torch.Tensor]:
                return causal_lm_forward(
                    model,
                    mb,
                    chunk_size=cfg.logits_chunk_size,
                    temperature=cfg.temperature,
                    entropy=entropy,
                    sum_pi_squared=sum_pi_squared,
                    score_prompt=cfg.score_prompt_tokens,
                )

            return plain() if routing is None else routed_forward(model, mb, routing, grad, plain)

        return forward

    def _routing(self, batch: Experience | dict[str, Any]) -> tuple[Any, BatchRouting | None]:
        """(the batch without its expert ids, what the forwards do with routing; None for a dense policy or
        an `Experience`, which carries no expert ids)."""
        if not self.moe or isinstance(batch, Experience):
            return batch, None
        batch, given = split_routes(batch)
        algo = self.engine.algo
        replay = algo.routing_replay != "off" and given is not None
        return batch, BatchRouting(given=given, replay=replay, aux_coef=algo.router_aux_coef)

    def compute_logprobs(self, batch: Experience | dict[str, Any]) -> torch.Tensor:
        """Logprobs [B, T] of `batch["input_ids"]` (0 at position 0 and at padding), without grad."""
        batch, routing = self._routing(batch)
        return self.engine.infer(batch, self._forward("none", routing), self.micro_batch_size)["logprobs"]

    def compute_logprobs_and_entropy(
        self, batch: Experience | dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs [B, T], entropy [B, T]) without grad."""
        batch, routing = self._routing(batch)
        out = self.engine.infer(batch, self._forward("detached", routing), self.micro_batch_size)
        return out["logprobs"], out["entropy"]

    def compute_old_logprobs(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The old-logprob pass of an MoE policy: "old_logprobs" and "entropy" [B, T], the learner's own expert
        ids "routed_experts" [B, T, layers, k] (int16, -1 at padding: what R2 replays in the update), and
        where the batch gives ids, "routing_agreement" and "routing_valid" [B, T] (`learner.routing`)."""
        batch, routing = self._routing(batch)
        if routing is None:
            raise ValueError(
                "compute_old_logprobs records expert ids: the policy is not a mixture of experts"
            )
        b, t = batch["input_ids"].shape
        routing.record = torch.full((b, t, *router_shape(self.model)), -1, dtype=torch.int16)
        out = self.engine.infer(batch, self._forward("detached", routing), self.micro_batch_size)
        out["old_logprobs"] = out.pop("logprobs")
        return {**out, "routed_experts": routing.record}

    def compute_logprobs_and_sum_pi_squared(
        self, batch: Experience | dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs [B, T], sum_pi_squared [B, T]) without grad: the optimal token baselines' inputs
        (`advantages.optimal_token_baseline`'s old_logprobs and sum_pi_squared), from one forward."""
        batch, routing = self._routing(batch)
        forward = self._forward("none", routing, sum_pi_squared=True)
        out = self.engine.infer(batch, forward, self.micro_batch_size)
        return out["logprobs"], out["sum_pi_squared"]

    def update(self, experience: Experience | dict[str, Any]) -> TrainStats:
        """One PPO-style update on this rank's shard (see `update_loop.run_update`)."""
        algo = self.engine.algo
        experience, routing = self._routing(experience)
        forward = self._forward("grad" if algo.entropy_coef else "detached", routing)

        def objective(out: dict[str, torch.Tensor], mb: Batch, norm: Normalizer):
            loss, metrics = policy_objective(out["logprobs"], out.get("entropy"), mb, algo, norm)
            return routing_objective(loss, metrics, out, mb, algo.router_aux_coef, norm.num_tokens)

        required = ("response_mask", "old_logprobs", "advantages")
        return self.engine.update(experience, forward, objective, required)

    def update_from_current(
        self, experience: Experience | dict[str, Any]
    ) -> tuple[TrainStats, dict[str, torch.Tensor]]:
        """`update` when the old policy is this one and the batch makes exactly one optimizer step: the
        training forward's own logprobs, detached, are the old logprobs (no separate no-grad forward; the
        parameters do not change before the only step, so they are the values that forward would give).
        Returns the stats and that forward's old logprobs and entropy [B, T] (0 at position 0 and padding),
        as `compute_logprobs_and_entropy` returns them."""
        algo, optim_config = self.engine.algo, self.engine.optim_config
        experience, routing = self._routing(experience)
        batch = as_batch(experience)
        if "old_logprobs" in batch:
            raise ValueError("update_from_current computes old_logprobs itself: the batch must not hold them")
        b, t = batch["input_ids"].shape
        num_minis = len(split_mini_batches(b, optim_config.mini_batch_size if optim_config else 0))
        if algo.num_updates_per_batch != 1 or num_minis != 1:
            raise ValueError(
                "update_from_current needs one optimizer step per batch (AlgoConfig.num_updates_per_batch=1 and "
                f"one mini-batch), got num_updates_per_batch={algo.num_updates_per_batch} and {num_minis} "
                "mini-batches"
            )
        seen = {"old_logprobs": torch.zeros(b, t), "entropy": torch.zeros(b, t)}
        forward = self._forward("grad" if algo.entropy_coef else "detached", routing)

        def objective(out: dict[str, torch.Tensor], mb: Batch, norm: Normalizer):
            old, entropy = out["logprobs"].detach(), out["entropy"].detach()
            rows, width = mb["row_index"].cpu(), old.shape[1]
            seen["old_logprobs"][rows, :width] = old.float().cpu()
            seen["entropy"][rows, :width] = entropy.float().cpu()
            mb = {**mb, "old_logprobs": old}
            loss, metrics = policy_objective(out["logprobs"], out.get("entropy"), mb, algo, norm)
            return routing_objective(loss, metrics, out, mb, algo.router_aux_coef, norm.num_tokens)

        batch["row_index"] = torch.arange(b)
        stats = self.engine.update(batch, forward, objective, ("response_mask", "advantages"))
        return stats, seen

    def export_weights(self, bucket_bytes: int = 512 << 20) -> Iterator[NamedTensors]:
        """Buckets of (HF name, tensor), LoRA merged, for weight sync."""
        return self.engine.export_weights(bucket_bytes)

    def state_dict(self) -> dict[str, Any]:
        return self.engine.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.load_state_dict(state)

    def save_shards(self, path: str, *, background: bool = False) -> PendingSave:
        """Sharded (DCP) checkpoint of this rank into `path` (`TorchEngine.save_shards`)."""
        return self.engine.save_shards(path, background=background)

    def wait_shards(self) -> FileEntries:
        return self.engine.wait_shards()

    def load_shards(self, path: str) -> None:
        self.engine.load_shards(path)


class TorchCriticLearner:
    """Critic learner (PPO with GAE) over an HF token-classification model with `num_labels=1`."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        algo: AlgoConfig,
        optim_config: OptimConfig,
        learner: LearnerConfig | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        learner = learner or LearnerConfig()
        self.engine = TorchEngine(model, algo=algo, optim_config=optim_config, learner=learner, group=group)
        self.micro_batch_size = optim_config.micro_batch_size

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.model

    def compute_values(self, batch: Experience | dict[str, Any]) -> torch.Tensor:
        """Values [B, T] aligned like logprobs (0 at position 0 and at padding), without grad."""
        return self.engine.infer(batch, lambda m, mb, grad: value_forward(m, mb), self.micro_batch_size)[
            "values"
        ]

    def update(self, experience: Experience | dict[str, Any]) -> TrainStats:
        """Clipped value-loss update toward `returns`, clipped around `old_values`."""
        algo, learner = self.engine.algo, self.engine.learner

        def objective(out: dict[str, torch.Tensor], mb: Batch, norm: Normalizer):
            return critic_objective(out["values"], mb, algo, learner, norm)

        required = ("response_mask", "returns", "old_values")
        return self.engine.update(experience, lambda m, mb, grad: value_forward(m, mb), objective, required)

    def state_dict(self) -> dict[str, Any]:
        return self.engine.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.load_state_dict(state)

    def save_shards(self, path: str, *, background: bool = False) -> PendingSave:
        """Sharded (DCP) checkpoint of this rank into `path` (`TorchEngine.save_shards`)."""
        return self.engine.save_shards(path, background=background)

    def wait_shards(self) -> FileEntries:
        return self.engine.wait_shards()

    def load_shards(self, path: str) -> None:
        self.engine.load_shards(path)
