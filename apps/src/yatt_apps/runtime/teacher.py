"""The distillation teacher: its worker (a frozen model in its own process, placed like a GenRM judge), the
tokenizer check made before a run starts, and the controller-side pieces of the step that read its answers.

`TeacherWorker` is the reward service of `yatt distill`: the rule terms of `rewards` (the optional task reward)
plus the teacher model, served by an HF engine on the worker's own device. `score_and_teach` returns, beside
the rule scores, the teacher's log-probability of every token the student sampled, from a no-grad HF forward of
the teacher on prompt + response (the prompt rendered with the student's chat template, exactly as the
controller rendered it for the student). So the teacher's log-probs come from the teacher's engine, never from
the learner's process, and chunks of completions stream into it as rollout finishes them (`score_stream`).

The teacher forward runs at `distill.teacher_temperature` (1: the teacher's own distribution; below 1 a
sharper target, nearer the teacher's greedy answers); the student's log-probs are the sampling policy's (the
rollout engine's, at `sampling.temperature`; the tiny preset samples at 1.0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from yatt_apps.config import RunConfig
from yatt_apps.io.data import PromptRow
from yatt_apps.runtime.workers import PolicyWorker, RewardWorker

if TYPE_CHECKING:
    from yatt_controller.controller import StepContext

# enough probe text to exercise a tokenizer's merges: the task's prompts and answers, and chat markup
PROBE_TEXT = (
    "What is 12 + 7? 19",
    "-3 - 45 = -48",
    "Verify the solution step by step. Is the answer correct? Yes No",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
)


def check_tokenizers(student_dir: str, teacher_dir: str) -> None:
    """Student and teacher must read text as the same token ids (the teacher scores the student's ids): same
    vocabulary (token -> id) and the same ids for probe text. ValueError naming both model folders and the
    first token that differs, otherwise."""
    from yatt_apps.io.models import load_tokenizer

    student, teacher = load_tokenizer(student_dir), load_tokenizer(teacher_dir)
    where = f"the student ({student_dir}) and the teacher ({teacher_dir})"
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    for token, index in sorted(s_vocab.items(), key=lambda item: item[1]):
        if t_vocab.get(token) != index:
            theirs = t_vocab.get(token)
            raise ValueError(
                f"tokenizers differ: {where}: the student's token {token!r} is id {index}, the teacher's "
                f"{'has no such token' if theirs is None else f'is id {theirs}'}; distillation needs one "
                "tokenizer (use a teacher of the student's model family)"
            )
    extra = sorted(set(t_vocab) - set(s_vocab), key=t_vocab.__getitem__)
    if extra:
        raise ValueError(
            f"tokenizers differ: {where}: the teacher's token {extra[0]!r} (id {t_vocab[extra[0]]}) is not in "
            "the student's vocabulary; distillation needs one tokenizer"
        )
    for text in PROBE_TEXT:
        a, b = student.encode(text), teacher.encode(text)
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            raise ValueError(
                f"tokenizers differ: {where} split {text!r} differently from token {at} on "
                f"({a[at : at + 3]} vs {b[at : at + 3]}); distillation needs one tokenizer"
            )


def teacher_dir(cfg: RunConfig, policy_dir: str) -> str:
    """The teacher's model folder once the run's models are prepared: `distill.teacher.path` (held in `judge`,
    see `yatt_apps.jobs.distill.serve_teacher`), else the tiny teacher built beside the tiny student under
    RUN_DIR/models (`launch.prepare_models` writes the judge's slot to RUN_DIR/models/judge)."""
    assert cfg.judge is not None, "distill serves its teacher in the judge's slot (serve_teacher)"
    if cfg.judge.path:
        from yatt_apps.io.model_sources import resolve_model_dir

        return str(resolve_model_dir(cfg.judge.path, key="distill.teacher.path"))
    return str(Path(policy_dir).parent / "judge")


def token_logprobs(
    model: Any,
    batch: dict[str, Any],
    *,
    chunk_size: int,
    micro_batch_size: int,
    temperature: float = 1.0,
    score_prompt: bool = True,
) -> Any:
    """Log-probs [B, T] of each token of `batch["input_ids"]` under `model` (its logits / `temperature`) given
    the tokens before it (0 at position 0), no grad, in micro-batches, on the model's device; returned on the
    CPU in float32."""
    import torch
    from yatt_algos.learner.torch_backend import causal_lm_forward

    dev = next(model.parameters()).device
    parts = []
    with torch.no_grad():
        for start in range(0, batch["input_ids"].shape[0], micro_batch_size):
            mb = {k: v[start : start + micro_batch_size].to(dev) for k, v in batch.items()}
            out = causal_lm_forward(
                model, mb, chunk_size=chunk_size, temperature=temperature, score_prompt=score_prompt
            )
            parts.append(out["logprobs"].float().cpu())
    return torch.cat(parts)


def topk_logprobs(
    model: Any,
    batch: dict[str, Any],
    k: int,
    *,
    chunk_size: int,
    micro_batch_size: int,
    temperature: float = 1.0,
) -> dict[str, Any]:
    """`yatt_algos.distill_topk.teacher_topk_outputs` of `model` over `batch` in micro-batches: "logprobs"
    [B, T] of each response token, the top-k "topk_ids" [B, T, k] and "topk_values" [B, T, k + 1] (k log-probs
    and the tail's) of the distribution that predicted it; 0 off the response; on the CPU."""
    import torch
    from yatt_algos.distill_topk import teacher_topk_outputs

    dev = next(model.parameters()).device
    parts: dict[str, list] = {}
    for start in range(0, batch["input_ids"].shape[0], micro_batch_size):
        mb = {key: v[start : start + micro_batch_size].to(dev) for key, v in batch.items()}
        out = teacher_topk_outputs(model, mb, k, chunk_size=chunk_size, temperature=temperature)
        for key, value in out.items():
            parts.setdefault(key, []).append(value.cpu())
    return {key: torch.cat(values) for key, values in parts.items()}


class TeacherWorker(RewardWorker):
    """`yatt distill`'s reward service: the rule terms of `rewards` (the task reward) and the teacher model on
    an HF engine in this process (slept and woken as a judge is: `RewardWorker.sleep` / `wake_up`)."""

    def __init__(
        self,
        cfg: RunConfig,
        teacher_dir: str,
        policy_dir: str,
        *,
        temperature: float = 1.0,
        topk: int = 0,
        shared_device: bool = True,
    ) -> None:
        from yatt_rollout.hf_engine import HFEngine

        from yatt_apps.io.models import load_causal_lm, load_tokenizer
        from yatt_apps.runtime.workers import device, dtype_name

        super().__init__(cfg)  # the rule terms only: the teacher is served below
        spec = cfg.judge
        assert spec is not None, "distill serves its teacher in the judge's slot (serve_teacher)"
        self.system_prompt = cfg.data.system_prompt
        self.temperature = temperature  # the teacher's logits / temperature: < 1 sharpens the target
        self.topk = topk  # > 0: also the top-k ids and log-probs (and the tail's) at every response position
        self.chunk_size = cfg.learner.logits_chunk_size
        self.score_prompt = cfg.learner.score_prompt_tokens  # only the response's tokens are taught
        self.micro_batch_size = cfg.optim.micro_batch_size or 32
        # the student's tokenizer renders prompts exactly as the controllers did (one vocabulary: checked)
        self.tok = load_tokenizer(policy_dir)
        model = load_causal_lm(teacher_dir, trust_remote_code=spec.trust_remote_code, dtype=dtype_name(spec))
        teacher_tok = load_tokenizer(teacher_dir, trust_remote_code=spec.trust_remote_code)
        # shared_device only matters to vLLM's memory share; the HF engine allocates as it goes
        self.teacher = HFEngine(
            model, teacher_tok, max_batch_size=256, seed=cfg.run.seed + 1, device=device()
        )
        self.engine = self.teacher  # slept (weights off the accelerator) and woken as a judge's engine

    def teacher_logprobs(self, requests: list) -> dict[str, list]:
        """Per `RewardRequest` (with response token ids), in order: "teacher_logprobs", the teacher's log-prob
        of each response token (a list of floats); with `topk` also "teacher_topk_ids" [n, k] and
        "teacher_topk_values" [n, k + 1] (tensors; n: the request's response tokens)."""
        import torch

        from yatt_apps.runtime.phases import pad_batch, render_prompt

        if not requests:
            return {"teacher_logprobs": []} | (
                {"teacher_topk_ids": [], "teacher_topk_values": []} if self.topk else {}
            )
        prompts = [
            render_prompt(self.tok, PromptRow(prompt=r.prompt, answer=r.reference), self.system_prompt)
            for r in requests
        ]
        batch = pad_batch(prompts, [list(r.response_token_ids) for r in requests], self.tok.pad_token_id)
        sizes = {"chunk_size": self.chunk_size, "micro_batch_size": self.micro_batch_size}
        if not self.topk:
            lp = token_logprobs(
                self.teacher.model,
                batch,
                temperature=self.temperature,
                score_prompt=self.score_prompt,
                **sizes,
            )
            mask = batch["response_mask"]
            return {"teacher_logprobs": [lp[i][mask[i]].tolist() for i in range(len(requests))]}
        out = topk_logprobs(self.teacher.model, batch, self.topk, temperature=self.temperature, **sizes)
        rows = range(len(requests))
        mask = batch["response_mask"]
        return {
            "teacher_logprobs": [out["logprobs"][i][mask[i]].tolist() for i in rows],
            "teacher_topk_ids": [out["topk_ids"][i][mask[i]].to(torch.int32) for i in rows],
            "teacher_topk_values": [out["topk_values"][i][mask[i]] for i in rows],
        }

    def score_and_teach(self, requests: list) -> dict[str, Any]:
        """The rule terms (task reward) and the teacher's token log-probs of each request (and its top-k), in
        one call (one stream stage)."""
        return {**self.score(requests), **self.teacher_logprobs(requests)}

    def generate(self, requests: list) -> list:
        """The teacher's own completions (its validation accuracy)."""
        return self.teacher.generate(requests)


class StudentWorker(PolicyWorker):
    """The student's learner rank: a `PolicyWorker` whose `train` runs the dense loss
    (`yatt_algos.distill_topk.update_topk`) when the experience carries the teacher's top-k (`distill.topk`:
    "teacher_topk_ids" [B, T, k], "teacher_topk_values" [B, T, k + 1])."""

    def __init__(self, cfg: RunConfig, model_dir: str, key: str, *, worker_info: Any) -> None:
        super().__init__(cfg, model_dir, key, worker_info=worker_info)
        spec = getattr(cfg, "distill", None)  # a DistillConfig's DistillSpec (any RunConfig: the default)
        self.direction = "reverse" if spec is None else spec.topk_divergence

    def train(self, experience: dict[str, Any]) -> dict[str, float]:
        if "teacher_topk_ids" not in experience:
            return super().train(experience)
        from yatt_algos.distill_topk import update_topk

        self.weights.release()
        rest = dict(experience)
        ids, values = rest.pop("teacher_topk_ids"), rest.pop("teacher_topk_values")
        stats = update_topk(self.learner, rest, ids, values, direction=self.direction)
        return {
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "lr": stats.lr,
            "num_skipped_steps": float(stats.num_skipped_steps),
            **stats.metrics,
        }


def teacher_tensor(batch: dict[str, Any], values: list) -> Any:
    """Per-sample teacher outputs laid on the batch's response tokens, 0 elsewhere: lists of floats (one per
    response token) -> [B, T] float32; tensors [n, ...] -> [B, T, ...] (int64 for integer ones, e.g. top-k
    ids; float32 otherwise)."""
    import torch

    parts = [torch.as_tensor(v) for v in values]
    trailing = tuple(parts[0].shape[1:]) if parts else ()
    integer = bool(parts) and not parts[0].dtype.is_floating_point
    dtype = torch.long if integer else torch.float32
    out = torch.zeros((*batch["input_ids"].shape, *trailing), dtype=dtype)
    for row, part in enumerate(parts):
        out[row, batch["response_mask"][row]] = part.to(dtype)
    return out


def evaluate_teacher(ctx: StepContext, val_rows: Any, cfg: RunConfig, tok: Any) -> dict[str, float]:
    """The teacher's greedy accuracy (math_verify against the answer) on this controller's share of the
    validation rows, generated by the teacher's engine: sums `val/teacher_correct`, `val/teacher_total`."""
    from yatt_multimodal.rules import math_reward
    from yatt_multimodal.types import RewardRequest
    from yatt_rollout.types import SamplingParams

    from yatt_apps.runtime.phases import make_requests, prompt_index, render_prompt

    mine = val_rows()[ctx.rank :: ctx.world_size]
    if not mine:
        return {"val/teacher_correct": 0.0, "val/teacher_total": 0.0}
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.sampling.max_new_tokens)
    ids = [render_prompt(tok, row, cfg.data.system_prompt) for row in mine]
    requests = make_requests(mine, ids, greedy, "teacher-eval", None)
    outs = sorted(ctx.get(ctx.services["reward"].call_one("generate", requests)), key=prompt_index)
    correct = sum(
        math_reward(
            RewardRequest(
                request_id="teacher-eval",
                prompt=row.prompt,
                response=tok.decode(c.token_ids, skip_special_tokens=True),
                reference=row.answer,
            )
        )
        for row, c in zip(mine, outs, strict=True)
    )
    return {"val/teacher_correct": float(correct), "val/teacher_total": float(len(mine))}


@dataclass
class TeacherAccuracy:
    """`val/teacher_accuracy`: the teacher is frozen, so each controller measures its share once (its first
    evaluated step in this process) and the same sums are reported at every evaluated step after."""

    sums: dict[int, dict[str, float]] = field(default_factory=dict)  # controller rank -> its sums

    def of(self, ctx: StepContext, val_rows: Any, cfg: RunConfig, tok: Any) -> dict[str, float]:
        if ctx.rank not in self.sums:
            with ctx.phase("eval_teacher"):
                self.sums[ctx.rank] = evaluate_teacher(ctx, val_rows, cfg, tok)
        return dict(self.sums[ctx.rank])
