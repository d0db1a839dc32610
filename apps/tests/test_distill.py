"""`yatt distill`: the teacher's token log-probs and the advantages against separate forwards of both models,
the tokenizer check, the config errors, the teacher's place in every placement mode the job accepts, and the
job end to end with an exact resume (slow)."""

from __future__ import annotations

import math
import shutil

import msgspec
import pytest
import torch
from yatt_algos.distill import reverse_kl_advantages
from yatt_apps.config import ModelSpec
from yatt_apps.io.data import PromptRow, arithmetic_task
from yatt_apps.io.models import load_tokenizer, prepare_model, tokenizer_corpus
from yatt_apps.jobs.distill import (
    JOB,
    TEACHER,
    DistillSpec,
    check,
    check_plan,
    serve_teacher,
    tiny_cpu_distill,
)
from yatt_apps.runtime.launch import placement_plan
from yatt_apps.runtime.phases import pad_batch, render_prompt
from yatt_apps.runtime.teacher import TeacherWorker, check_tokenizers, teacher_tensor, token_logprobs
from yatt_multimodal.types import RewardRequest
from yatt_placement.types import ClusterSpec

ROWS = arithmetic_task(32, seed=3)
MODES = ("colocated", "partial", "disaggregated")  # the placements distill accepts (dynamic: check_plan)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny student and a wider tiny teacher (random init, built from configs) with one tokenizer."""
    root = tmp_path_factory.mktemp("distill")
    corpus = tokenizer_corpus(ROWS)
    student = prepare_model(ModelSpec(seed=0), root / "student", corpus)
    teacher = prepare_model(ModelSpec(seed=1, hidden_size=128, num_heads=4), root / "teacher", corpus)
    return str(student), str(teacher)


def _forward_logprobs(
    model_dir: str, input_ids: torch.Tensor, temperature: float = 1.0, *, full_vocab: bool = False
) -> torch.Tensor:
    """log p(token t | tokens < t) [B, T] by a plain full-logits forward (0 at t = 0): the reference; with
    `full_vocab`, the whole distribution that predicts token t [B, T, V] (zeros at t = 0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits.float() / temperature
    lp = logits[:, :-1].log_softmax(-1)
    if full_vocab:
        return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
    picked = lp.gather(-1, input_ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(input_ids.shape[0], 1), picked], dim=1)


def test_teacher_logprobs_and_advantages_equal_separate_forwards(models):
    """The TeacherWorker's log-probs of the student's tokens equal a separate forward of the teacher, and the
    advantages equal -(log p_student - log p_teacher) of separate forwards of both models on every response
    token. Rows have equal lengths so that the reference forward needs no padding."""
    student_dir, teacher_dir = models
    cfg = serve_teacher(tiny_cpu_distill(), None)  # type: ignore[arg-type]  # the run folder is not read
    cfg = msgspec.structs.replace(cfg, judge=ModelSpec(seed=1, hidden_size=128, num_heads=4))
    worker = TeacherWorker(cfg, teacher_dir, student_dir)
    tok = load_tokenizer(student_dir)
    rows = [PromptRow(prompt="3 + 4 =", answer="7"), PromptRow(prompt="5 - 9 =", answer="-4")]
    responses = [[*tok.encode(text), tok.eos_token_id] for text in ("7", "9")]
    requests = [
        RewardRequest(
            request_id=f"r{i}",
            prompt=row.prompt,
            response=tok.decode(ids, skip_special_tokens=True),
            reference=row.answer,
            response_token_ids=ids,
        )
        for i, (row, ids) in enumerate(zip(rows, responses, strict=True))
    ]
    out = worker.score_and_teach(requests)
    assert out["scores"] == [1.0, 0.0]  # the task reward (math_verify) beside the teacher's log-probs

    prompts = [render_prompt(tok, row, "") for row in rows]
    batch = pad_batch(prompts, responses, tok.pad_token_id)
    assert bool(batch["attention_mask"].all())  # equal lengths: the plain forward below needs no mask
    mask = batch["response_mask"]
    teacher_ref = _forward_logprobs(teacher_dir, batch["input_ids"])
    student_ref = _forward_logprobs(student_dir, batch["input_ids"])
    teacher = teacher_tensor(batch, out["teacher_logprobs"])
    torch.testing.assert_close(teacher[mask], teacher_ref[mask], rtol=0, atol=1e-5)
    advantages = reverse_kl_advantages(student_ref, teacher, mask)
    torch.testing.assert_close(advantages[mask], -(student_ref - teacher_ref)[mask], rtol=0, atol=1e-5)
    assert bool((advantages[~mask] == 0).all())
    assert (student_ref - teacher_ref)[mask].abs().min() > 1e-3  # two different models: a real difference

    # distill.teacher_temperature: the teacher's logits / T before its log-probs
    sharp = token_logprobs(worker.teacher.model, batch, chunk_size=4, micro_batch_size=1, temperature=0.5)
    torch.testing.assert_close(
        sharp, _forward_logprobs(teacher_dir, batch["input_ids"], 0.5), rtol=0, atol=1e-5
    )

    # distill.topk: the same log-probs, and per response token the teacher's top-k and tail of a full forward
    worker.topk = 3
    dense = worker.score_and_teach(requests)
    assert dense["teacher_logprobs"] == out["teacher_logprobs"]
    ids, values = (teacher_tensor(batch, dense[f"teacher_topk_{key}"]) for key in ("ids", "values"))
    assert ids.shape == (*mask.shape, 3) and ids.dtype == torch.long and values.shape == (*mask.shape, 4)
    full = _forward_logprobs(teacher_dir, batch["input_ids"], full_vocab=True)[mask]  # [N, V]
    top = full.topk(3, dim=-1)
    assert torch.equal(ids[mask], top.indices)
    torch.testing.assert_close(values[mask][:, :3], top.values, rtol=0, atol=1e-5)
    rest = full.exp().sum(-1) - top.values.exp().sum(-1)  # the tail's mass: every other token's
    torch.testing.assert_close(values[mask][:, 3].exp(), rest, rtol=1e-4, atol=1e-6)


def test_matching_tokenizers_pass_and_mismatched_ones_are_refused(models, tmp_path):
    student_dir, teacher_dir = models
    check_tokenizers(student_dir, teacher_dir)  # one corpus, one vocabulary size: the same tokenizer
    other = prepare_model(
        ModelSpec(seed=1), tmp_path / "other", tokenizer_corpus(arithmetic_task(32, seed=9))[:5]
    )
    with pytest.raises(ValueError) as err:
        check_tokenizers(student_dir, str(other))
    message = str(err.value)
    assert message.startswith(f"tokenizers differ: the student ({student_dir}) and the teacher ({other}):")
    # the first differing token is named with its ids on both sides
    s_vocab, t_vocab = load_tokenizer(student_dir).get_vocab(), load_tokenizer(str(other)).get_vocab()
    first = next(tok for tok, i in sorted(s_vocab.items(), key=lambda kv: kv[1]) if t_vocab.get(tok) != i)
    assert f"the student's token {first!r} is id {s_vocab[first]}" in message


def test_config_errors_name_their_keys():
    cfg = tiny_cpu_distill()
    with pytest.raises(ValueError, match="leave judge null"):
        check(msgspec.structs.replace(cfg, judge=ModelSpec(seed=7)))
    dynamic = msgspec.structs.replace(cfg.placement, mode="dynamic")
    with pytest.raises(ValueError, match=r"distill moves no devices between steps: set placement\.mode"):
        check_plan(placement_plan(msgspec.structs.replace(cfg, placement=dynamic), JOB))
    with pytest.raises(ValueError, match=r"model\.path is set"):
        check(msgspec.structs.replace(cfg, model=ModelSpec(path="/models/student")))
    vllm = msgspec.structs.replace(
        cfg.distill, teacher=msgspec.structs.replace(cfg.distill.teacher, engine="vllm")
    )
    with pytest.raises(ValueError, match=r"distill\.teacher\.engine=hf"):
        check(msgspec.structs.replace(cfg, distill=vllm))
    coef = msgspec.structs.replace(cfg.distill, reward_coef=0.5)
    with pytest.raises(ValueError, match="rewards is empty"):
        check(msgspec.structs.replace(cfg, distill=coef, rewards=[]))
    dense = msgspec.structs.replace(cfg.distill, topk=8)
    replay = msgspec.structs.replace(cfg.algo, routing_replay="r3")
    with pytest.raises(ValueError, match=r"distill\.topk > 0 \(the dense loss\) runs on torch learners"):
        check(msgspec.structs.replace(cfg, distill=dense, algo=replay))
    with pytest.raises(ValueError, match=r"distill\.topk must be >= 0"):
        DistillSpec(topk=-1)
    # the config the run uses holds the teacher in the judge's slot, and passes the check again (resume)
    served = serve_teacher(cfg, None)  # type: ignore[arg-type]
    assert served.judge == cfg.distill.teacher
    check(served)


@pytest.mark.parametrize("mode", MODES)
def test_the_teacher_is_placed_in_every_mode(mode):
    """colocated: the teacher time-shares every device with the student (engines sleep); partial: it takes
    the devices the rollout leaves and rollout streams into it; disaggregated: devices of its own."""
    cfg = tiny_cpu_distill()
    cluster = ClusterSpec(num_nodes=1, devices_per_node=4, device_memory_gb=16.0)
    cfg = msgspec.structs.replace(
        cfg, placement=msgspec.structs.replace(cfg.placement, mode=mode, cluster=cluster)
    )
    plan = placement_plan(cfg, JOB)
    check_plan(plan)
    assert sorted(plan.role_keys()) == ["actor", "rollout", TEACHER]
    assert plan.placement(TEACHER).role == "genrm"
    teacher, rollout, actor = (set(plan.devices(key)) for key in (TEACHER, "rollout", "actor"))
    if mode == "colocated":
        assert teacher == rollout == actor == {0, 1, 2, 3} and plan.sleeps
        assert not plan.streams_into_judge
    elif mode == "partial":
        assert teacher and rollout and not teacher & rollout and teacher | rollout == actor
        assert plan.streams_into_judge and not plan.sleeps
    else:
        assert teacher and not teacher & (rollout | actor) and plan.streams_into_judge


def _finite(metrics: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        assert key in metrics and math.isfinite(metrics[key]), (key, metrics.get(key))


@pytest.mark.slow
def test_distill_runs_and_resumes_exactly(tmp_path, ray_session):
    """Two steps of the tiny preset (two controllers, colocated; 8 prompts x 4 samples, both steps evaluated):
    the distillation metrics are present and finite, RUN_DIR/final is written; then the last checkpoint is
    removed and the run resumed from step 0: step 1 is redone with the same loss, reverse KL, rewards and
    validation accuracy, bit for bit."""
    from yatt_apps.runtime.launch import run_job
    from yatt_controller.types import ControllerSpec

    base = tiny_cpu_distill()
    cfg = msgspec.structs.replace(
        base,
        run=msgspec.structs.replace(
            base.run, num_steps=2, prompts_per_step=8, eval_every=1, schedule_steps=2, progress=False
        ),
        data=msgspec.structs.replace(base.data, num_val_rows=16),
        sampling=msgspec.structs.replace(base.sampling, n=4),
        controller=msgspec.structs.replace(base.controller, checkpoint_every=1, keep_checkpoints=2),
    )
    assert isinstance(base.controller, ControllerSpec)
    run_dir = tmp_path / "run"
    first = run_job(cfg, run_dir, JOB, existing="refuse")
    keys = (
        "distill/reverse_kl",
        "distill/teacher_logprob",
        "train/loss",
        "val/accuracy",
        "val/teacher_accuracy",
    )
    _finite(first, keys)
    assert first["distill/teacher_logprob"] < 0 and 0 <= first["val/teacher_accuracy"] <= 1
    assert (run_dir / "final" / "config.json").is_file()

    newest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    assert newest.name.endswith("1")  # step 1's checkpoint: removed, so the resume redoes step 1
    shutil.rmtree(newest)
    again = run_job(cfg, run_dir, JOB, existing="resume")
    for key in (
        "train/loss",
        "distill/reverse_kl",
        "distill/teacher_logprob",
        "reward/mean",
        "train/grad_norm",
        "val/accuracy",
        "val/teacher_accuracy",
    ):
        assert again[key] == first[key], key
