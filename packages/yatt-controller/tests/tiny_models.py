"""Hosted classes with real tiny transformers models (hidden 64, 2 layers), built from configs: a learner
that trains data-parallel over gloo and an engine that generates greedily. torch is imported inside methods,
so a controller that unpickles the step function never loads it."""

from __future__ import annotations


def _tiny_llama(seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def _digest(model) -> dict[str, bytes]:
    return {name: p.detach().contiguous().view(-1).numpy().tobytes() for name, p in model.named_parameters()}


class TinyLearner:
    """One data-parallel rank: advantage-weighted log-likelihood of the completions, gradients averaged
    over its gloo group, SGD. Every rank starts from seed 0, so all ranks hold the same weights."""

    def __init__(self, port: int, worker_info=None):
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        self.model = _tiny_llama(seed=0).train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.5)
        self.world = worker_info.dp_size
        if self.world > 1:
            url = f"tcp://127.0.0.1:{port}"
            dist.init_process_group("gloo", init_method=url, rank=worker_info.dp_rank, world_size=self.world)

    def train(self, samples: list[dict]) -> float:
        import torch
        import torch.distributed as dist

        tokens = torch.tensor([s["prompt"] + s["completion"] for s in samples])  # [B, T]
        advantages = torch.tensor([s["advantage"] for s in samples])  # [B]
        start = len(samples[0]["prompt"])
        logits = self.model(tokens).logits[:, start - 1 : -1]  # [B, C, V] predicting the completion
        logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, start:, None])[..., 0]  # [B, C]
        loss = -(advantages[:, None] * logp).mean()
        self.opt.zero_grad()
        loss.backward()
        if self.world > 1:
            for p in self.model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= self.world
        self.opt.step()
        return float(loss)

    def named_weights(self):
        return self.model.named_parameters()

    def weights_digest(self) -> dict[str, bytes]:
        return _digest(self.model)


class TinyEngine:
    """A generation engine: greedy completions of `max_new_tokens`, stamped with the weights' version."""

    def __init__(self, seed: int = 1, max_new_tokens: int = 4):
        import torch

        torch.set_num_threads(1)
        self.model, self.max_new_tokens, self.version = _tiny_llama(seed), max_new_tokens, -1

    def generate(self, prompts: list[list[int]]) -> list[dict]:
        import torch

        with torch.no_grad():
            ids = torch.tensor(prompts)  # [B, P]: prompts of one length, no padding
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=self.max_new_tokens,
                min_new_tokens=self.max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        return [
            {"prompt": p, "completion": row[len(p) :].tolist(), "version": self.version}
            for p, row in zip(prompts, out, strict=True)
        ]

    def load_weights(self, named, version: int) -> None:
        import torch

        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named:
                params[name].copy_(tensor)
        self.version = version

    def weights_digest(self) -> dict[str, bytes]:
        return _digest(self.model)


def rl_step(ctx, batch: list[list[int]]) -> dict[str, float]:
    """Generate, score with a rule (count of even tokens), centre within this controller's batch, train,
    sync weights, and check that the engine now holds the learner's weights bit for bit."""
    with ctx.phase("rollout"):
        samples = [s for chunk in ctx.get(ctx.services["rollout"].scatter("generate", batch)) for s in chunk]
    ctx.check_versions([s["version"] for s in samples])
    rewards = [float(sum(t % 2 == 0 for t in s["completion"])) for s in samples]
    mean = sum(rewards) / len(rewards)
    for sample, reward in zip(samples, rewards, strict=True):
        sample["advantage"] = reward - mean
    with ctx.phase("train"):
        losses = ctx.get(ctx.learner.gather(ctx.learner.scatter("train", samples)))
    with ctx.phase("sync"):
        version = ctx.sync_weights()
    learner, engine = ctx.get(
        [ctx.learner.rank_zero("weights_digest"), ctx.services["rollout"].rank_zero("weights_digest")]
    )
    totals = ctx.all_reduce({"loss": sum(losses), "reward": sum(rewards), "num_samples": len(samples)})
    return {**totals, "version": version, "weights_equal": float(learner == engine)}
