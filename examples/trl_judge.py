"""A YATT judge in TRL: yatt-multimodal's rule rewards and its GenRM judge (served by a yatt-rollout engine) as
the reward function of TRL's `GRPOTrainer`, through `yatt_multimodal.trl_adapter.TRLReward`.

The reward is one YATT `CombinedReward`: the exact answer (math_verify, weight 1), a format rule (the
completion starts with an integer, weight 0.5) and a GenRM judge (K = 2 sampled "Verdict: Yes/No"
judgements, weight 0.25) run by a tiny Qwen2 in yatt-rollout's `HFEngine`. The adapter turns TRL's batch of
prompts and completions into `RewardRequest`s, applies the failure policy (a judgement without a verdict is a
`parse_error`: scored zero by the judge spec's policy, counted, logged as a TRL metric and in a status
column, never a silent zero) and hands TRL one float (or None for a dropped sample) per completion.

The policy is a tiny Qwen2 with a tokenizer trained here on the arithmetic task (nothing is downloaded);
TRL trains it for 2 GRPO steps on CPU (4 prompts x 2 completions per step). The judge is another tiny
Qwen2, taught the verdict phrase by 30 supervised steps here: its verdicts are mostly well-formed and barely
informed; the point is the path, not the judgement. At the end TRL's own reward column (the one it turns into
advantages) is compared with the scores the adapter returned: they are the same numbers.

    uv run python examples/trl_judge.py

The last printed line is one JSON object.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

PROMPTS_PER_STEP, GENERATIONS, STEPS, MAX_COMPLETION = 4, 2, 2, 8


def arithmetic(num_rows: int = 32) -> list[dict]:
    """Your dataset: chat prompts and an "answer" column (the adapter's reference)."""
    import random

    rng = random.Random(0)
    rows = []
    for _ in range(num_rows):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        rows.append({"prompt": [{"role": "user", "content": f"{a} + {b} ="}], "answer": str(a + b)})
    return rows


def tiny_models(root: Path, rows: list[dict]):
    """The policy directory TRL loads, and the judge model with the shared tokenizer."""
    from yatt_multimodal.templates import get_template
    from yatt_rollout.tiny import save_tiny, tiny_causal_lm, train_tokenizer

    template = get_template("verify_yes_no", 1)  # the judge prompt's words tokenize compactly
    judge_text = [template.system, template.user, template.reference_block, "Verdict: Yes. Verdict: No."]
    corpus = [f"{r['prompt'][0]['content']} {r['answer']}" for r in rows] + judge_text
    tok = train_tokenizer(corpus, vocab_size=512)
    ids = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    policy_dir = save_tiny(tiny_causal_lm(len(tok), seed=0, **ids), tok, root / "policy")
    judge = tiny_causal_lm(len(tok), seed=1, max_position_embeddings=1024, **ids)
    return str(policy_dir), judge, tok


def teach_judge(judge, tok, rows: list[dict], steps: int = 30):
    """A few supervised steps that teach the random tiny judge the verdict phrase ("Verdict: Yes" for a
    correct answer, "Verdict: No" for a wrong one) on judge prompts rendered exactly as the GenRM renders
    them. A 30-step judge mostly learns the format, not the arithmetic: its verdicts show the path, and
    some samples still state none (parse errors, counted)."""
    import torch
    from yatt_multimodal.prompt_codecs import HFChatCodec
    from yatt_multimodal.templates import get_template

    codec, template = HFChatCodec(tok), get_template("verify_yes_no", 1)
    pairs = []
    for i, row in enumerate(rows):
        correct = i % 2 == 0
        response = row["answer"] if correct else str(int(row["answer"]) + 1)
        question = row["prompt"][0]["content"]
        system, user = template.render(question=question, response=response, reference=row["answer"])
        verdict = [*tok.encode(f"Verdict: {'Yes' if correct else 'No'}"), tok.eos_token_id]
        pairs.append((codec.encode_prompt(system, user), verdict))
    width = max(len(p) + len(v) for p, v in pairs)
    ids = torch.full((len(pairs), width), tok.pad_token_id)
    labels, attention = torch.full_like(ids, -100), torch.zeros_like(ids)
    for i, (prompt, verdict) in enumerate(pairs):
        end = len(prompt) + len(verdict)
        ids[i, :end], attention[i, :end] = torch.tensor(prompt + verdict), 1
        labels[i, len(prompt) : end] = torch.tensor(verdict)  # the loss is on the verdict only
    judge.train()
    optimizer = torch.optim.Adam(judge.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = judge(input_ids=ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return judge.eval(), loss.item()


def yatt_reward(judge_engine, tok):
    """The adapter: YATT reward specs -> the callable TRL takes."""
    from yatt_multimodal.prompt_codecs import HFChatCodec
    from yatt_multimodal.trl_adapter import trl_reward
    from yatt_multimodal.types import JudgeSpec, RewardSpec

    specs = [
        RewardSpec(kind="math_verify", weight=1.0),
        RewardSpec(kind="regex", name="format", weight=0.5, options={"pattern": r"^\s*-?\d+"}),
        RewardSpec(
            kind="genrm",
            weight=0.25,
            judge=JudgeSpec(num_samples=2, max_new_tokens=8, on_parse_error="zero", timeout_s=120.0),
        ),
    ]
    return trl_reward(specs, engine=judge_engine, codec=HFChatCodec(tok), seed=0, name="yatt_reward")


def reward_column_recorder():
    """A TrainerCallback copying TRL's per-completion reward column after each step (`trainer` set later)."""
    from transformers import TrainerCallback

    class RewardColumn(TrainerCallback):
        trainer = None

        def __init__(self) -> None:
            self.columns: list[list[float]] = []
            self.logged_means: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.columns.append(list(self.trainer._logs["rewards"]["yatt_reward"]))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "rewards/yatt_reward/mean" in logs:
                self.logged_means.append(logs["rewards/yatt_reward/mean"])

    return RewardColumn()


def train(policy_dir: str, reward, rows: list[dict], out: Path):
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    config = GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        use_vllm=False,
        bf16=False,
        fp16=False,
        per_device_train_batch_size=PROMPTS_PER_STEP * GENERATIONS,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=GENERATIONS,
        max_completion_length=MAX_COMPLETION,
        temperature=1.0,
        beta=0.0,
        num_iterations=1,
        learning_rate=1e-3,
        max_steps=STEPS,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        model_init_kwargs={"dtype": torch.float32},
        dataloader_num_workers=0,
        disable_tqdm=True,
        log_completions=False,
    )
    recorder = reward_column_recorder()
    trainer = GRPOTrainer(
        model=policy_dir,
        reward_funcs=[reward],
        args=config,
        train_dataset=Dataset.from_list(rows),
        callbacks=[recorder],
    )
    recorder.trainer = trainer
    trainer.train()
    return recorder


def same(trl_column: list[float], adapter_scores: list[float | None]) -> bool:
    """TRL's column (float32, NaN for None) equals the adapter's scores exactly (the weights are dyadic)."""
    return len(trl_column) == len(adapter_scores) and all(
        (math.isnan(t) and a is None) or t == a for t, a in zip(trl_column, adapter_scores, strict=True)
    )


def main(argv: list[str] | None = None) -> dict:
    import torch
    from yatt_rollout.hf_engine import HFEngine

    del argv  # no options
    torch.manual_seed(0)
    rows = arithmetic()
    with tempfile.TemporaryDirectory() as tmp:
        policy_dir, judge, tok = tiny_models(Path(tmp), rows)
        judge, judge_loss = teach_judge(judge, tok, rows)
        print(f"judge taught the verdict phrase: loss {judge_loss:.3f}")
        engine = HFEngine(judge, tok, max_batch_size=32)
        try:
            reward = yatt_reward(engine, tok)
            recorder = train(policy_dir, reward, rows, Path(tmp) / "trl")
        finally:
            engine.close()
    calls = list(reward.calls)
    steps = []
    for i, (call, column) in enumerate(zip(calls, recorder.columns, strict=True)):
        statuses = [r.status for r in call.batch.rewards]
        steps.append(
            {
                "step": call.step,
                "adapter_scores": call.scores,
                "trl_reward_column": column,
                "equal": same(column, call.scores),
                "statuses": {s: statuses.count(s) for s in sorted(set(statuses))},
                "judge_judgements": call.batch.metrics.num_judgements,
                "trl_logged_mean": recorder.logged_means[i],
            }
        )
        print(f"step {call.step}: adapter {call.scores}")
        print(f"        TRL     {column}  equal: {steps[-1]['equal']}, statuses {steps[-1]['statuses']}")
    result = {
        "judge_loss": judge_loss,
        "num_steps": len(recorder.columns),
        "num_reward_calls": len(calls),
        "completions_per_step": PROMPTS_PER_STEP * GENERATIONS,
        "all_equal": all(s["equal"] for s in steps),
        "steps": steps,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
