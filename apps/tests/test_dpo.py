"""`yatt dpo`: the pair batch against a hand-built pair, reference log-probs against a separate forward, the
learner rank's first step (policy = reference) and its learning, bad preference rows (file:line and field, exit
2 through the command), and the job end to end with an exact resume (slow)."""

from __future__ import annotations

import json
import math
import shutil

import msgspec
import pytest
import torch
from yatt_apps.config import ModelSpec
from yatt_apps.io.data import arithmetic_task
from yatt_apps.io.models import load_causal_lm, load_tokenizer, prepare_model, tokenizer_corpus
from yatt_apps.io.pref_data import PrefRow, arithmetic_pairs, load_pref_rows, pair_batch
from yatt_apps.io.sft_data import chat_messages, encode_pair
from yatt_apps.jobs.dpo import JOB, DPOWorker, tiny_cpu_dpo
from yatt_controller.types import WorkerInfo

PAIRS = [
    PrefRow(prompt="3 + 9 =", chosen="12", rejected="= 13 13"),
    PrefRow(prompt="1 - 4 =", chosen="-3", rejected="3"),
    PrefRow(prompt="7 + 7 =", chosen="14", rejected="15"),
]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    """A tiny policy from its random init (no warm start: cheap); the learner rank's tests need no skill."""
    corpus = tokenizer_corpus(arithmetic_task(64, seed=0))
    return str(prepare_model(ModelSpec(), tmp_path_factory.mktemp("dpo") / "policy", corpus))


@pytest.fixture(scope="module")
def tok(policy_dir):
    return load_tokenizer(policy_dir)


def _worker(policy_dir, **dpo) -> DPOWorker:
    cfg = tiny_cpu_dpo()
    cfg = msgspec.structs.replace(cfg, dpo=msgspec.structs.replace(cfg.dpo, **dpo))
    return DPOWorker(cfg, policy_dir, "unused", worker_info=WorkerInfo(role="actor", dp_rank=0, dp_size=1))


def _sequence_logp(model, prompt: list[int], response: list[int]) -> float:
    """log p(response | prompt) of one unpadded sequence, token by token."""
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + response])).logits[0].float(), -1)
    return sum(float(logp[len(prompt) + j - 1, t]) for j, t in enumerate(response))


def test_pair_batch_of_hand_built_pairs(tok):
    """Each pair is one row: chosen in input_ids, rejected beside it, both right padded to the longer of the
    batch; the response masks are encode_pair's; the unions are what packing and token counts read."""
    batch = pair_batch(tok, PAIRS, "")
    width = batch["input_ids"].shape[1]
    assert all(v.shape == (3, width) for v in batch.values())
    for i, row in enumerate(PAIRS):
        messages = chat_messages("", row.prompt)
        for side, text in (("chosen", row.chosen), ("rejected", row.rejected)):
            prompt, response = encode_pair(tok, messages, text)
            n = len(prompt) + len(response)
            ids = batch["input_ids" if side == "chosen" else "rejected_input_ids"][i]
            assert ids[:n].tolist() == prompt + response
            assert ids[n:].eq(tok.pad_token_id).all()
            assert batch[f"{side}_attention_mask"][i].tolist() == [True] * n + [False] * (width - n)
            assert batch[f"{side}_response_mask"][i].tolist() == (
                [False] * len(prompt) + [True] * len(response) + [False] * (width - n)
            )
    assert torch.equal(
        batch["response_mask"], batch["chosen_response_mask"] | batch["rejected_response_mask"]
    )
    assert torch.equal(
        batch["attention_mask"], batch["chosen_attention_mask"] | batch["rejected_attention_mask"]
    )


def test_reference_logps_equal_a_separate_forward_and_stay_frozen(tok, policy_dir):
    """The worker's reference log-probs, summed per response, equal an unpadded forward of the starting model
    loaded on its own, before and after a training step (the step moves the policy only)."""
    worker = _worker(policy_dir)
    model = load_causal_lm(policy_dir).eval()
    batch = pair_batch(tok, PAIRS, "")
    expected = []
    for row in PAIRS:
        messages = chat_messages("", row.prompt)
        expected.append(
            [_sequence_logp(model, *encode_pair(tok, messages, t)) for t in (row.chosen, row.rejected)]
        )
    for _ in range(2):
        ref = worker._reference_logps(batch)
        got = torch.stack([ref["ref_chosen_logprobs"].sum(-1), ref["ref_rejected_logprobs"].sum(-1)], -1)
        torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-5, atol=1e-5)
        worker.dpo(batch)
    policy = worker.learner.engine.infer(batch, worker._forward(), 4)
    assert not torch.allclose(policy["chosen_logprobs"], ref["ref_chosen_logprobs"])


@pytest.mark.parametrize(("loss_type", "first"), [("sigmoid", math.log(2.0)), ("hinge", 1.0), ("ipo", 1.0)])
def test_first_step_is_at_the_reference_and_training_separates_the_pairs(tok, policy_dir, loss_type, first):
    """At the first step policy = reference: h = 0, so the loss is L(0) (log 2; 1; (1/(2 beta))^2 = 1 at beta
    0.5), rewards 0 and accuracy 0.5 (12 ties, each half). Repeated steps on the same pairs raise the chosen reward over the rejected."""
    worker = _worker(policy_dir, loss_type=loss_type, rpo_alpha=0.0)
    batch = pair_batch(tok, PAIRS * 4, "")
    out = worker.dpo(batch)
    assert out["pairs"] == 12.0 and out["correct"] == 6.0 and out["margin"] == 0.0
    assert out["loss"] / 12 == pytest.approx(first, rel=1e-6)
    assert out["train_loss"] == pytest.approx(first, rel=1e-6)  # the engine's loss: the same mean
    for _ in range(6):
        out = worker.dpo(batch)
    assert out["correct"] == 12.0 and out["margin"] > 0 and out["loss"] / 12 < first


def test_rpo_term_adds_alpha_times_the_chosen_nll(tok, policy_dir):
    worker = _worker(policy_dir, rpo_alpha=0.5)
    out = worker.dpo(pair_batch(tok, PAIRS, ""))
    assert out["train_loss"] == pytest.approx((out["loss"] + 0.5 * out["nll"]) / 3, rel=1e-6)


def test_bad_rows_name_file_line_and_field(tmp_path):
    path = tmp_path / "p.jsonl"
    good = {"prompt": "1 + 1 =", "chosen": "2", "rejected": "3"}
    cases = [
        ({"prompt": "1 + 1 =", "chosen": "2"}, "missing field 'rejected'"),
        ({**good, "chosen": " "}, "field 'chosen' is empty"),
        ({**good, "chosen": "3"}, "fields 'chosen' and 'rejected' are the same response"),
        (
            {**good, "prompt": [{"role": "assistant", "content": "x"}]},
            "field 'prompt': the last message must be",
        ),
        (
            {**good, "rejected": [{"role": "user", "content": "3"}]},
            "field 'rejected': expected one message with",
        ),
        ({**good, "chosen": 2}, "field 'chosen' must be a string or a list of messages"),
    ]
    for bad, message in cases:
        path.write_text(json.dumps(good) + "\n\n" + json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=rf"^{path}:3: {message}"):
            load_pref_rows(path)
    chat = {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2 ="}],
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": "5",
    }
    path.write_text(json.dumps(chat) + "\n")
    (row,) = load_pref_rows(path)
    assert (row.prompt, row.chosen, row.rejected, row.answer) == ("Be brief.\n2 + 2 =", "4", "5", "4")
    assert row.messages == chat["prompt"]


def test_a_bad_row_exits_2_through_the_command(tmp_path, capsys):
    from yatt_apps.cli.main import main

    path = tmp_path / "p.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"prompt": ["1 + 1 =", "2 + 2 ="], "chosen": ["2", "4"], "rejected": ["3", ""]}), path
    )
    run_dir = tmp_path / "run"
    assert main(["dpo", "--set", f"dpo.train={path}", "--run-dir", str(run_dir)]) == 2
    assert f"{path}: row 2: field 'rejected' is empty" in capsys.readouterr().err
    assert not run_dir.exists()


def test_embedded_pairs_share_the_task_rows():
    """The embedded pairs are `arithmetic_task`'s rows (so the tiny tokenizer corpus, and the warm-started
    policy, are the other tiny jobs'), chosen the answer, rejected never equal to it."""
    pairs, rows = arithmetic_pairs(200, seed=3), arithmetic_task(200, seed=3)
    assert [(p.prompt, p.chosen, p.answer) for p in pairs] == [(r.prompt, r.answer, r.answer) for r in rows]
    assert all(p.rejected != p.chosen and p.rejected.strip() for p in pairs)


@pytest.mark.slow
def test_tiny_dpo_learns_and_resumes_exactly(ray_session, tmp_path):
    """Three steps of `tiny_cpu_dpo` (two controllers, evaluated at steps 0 and 2): every metric present and
    finite, step 0 at the reference (accuracy 0.5: every pair a tie, counted half; margin 0, loss log 2, on
    training and validation pairs), validation preference accuracy above chance after two updates; a copy cut back to its
    step-1 checkpoint and resumed redoes the evaluated step 2 with the same metrics (training and validation)
    and the same final weights."""
    from safetensors.torch import load_file
    from yatt_apps.runtime.launch import run_job

    base = tiny_cpu_dpo()
    cfg = msgspec.structs.replace(
        base,
        run=msgspec.structs.replace(base.run, num_steps=3, eval_every=2, schedule_steps=3, progress=False),
        data=msgspec.structs.replace(base.data, num_val_rows=32),
        controller=msgspec.structs.replace(base.controller, checkpoint_every=1, keep_checkpoints=2),
    )
    straight = tmp_path / "straight"
    run_job(cfg, straight, JOB)
    rows = {r["step"]: r for r in map(json.loads, (straight / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == [0, 1, 2]
    keys = ["dpo/loss", "dpo/rewards_chosen", "dpo/rewards_rejected", "dpo/margin", "dpo/accuracy", "dpo/nll"]
    for step in (0, 2):  # the evaluated steps
        for key in [*keys, *(f"val/{k}" for k in keys), "val/accuracy", "train/loss"]:
            assert math.isfinite(rows[step][key]), (step, key)
    for prefix in ("", "val/"):  # step 0 trains, and evaluates, the reference itself
        assert rows[0][f"{prefix}dpo/accuracy"] == 0.5 and rows[0][f"{prefix}dpo/margin"] == 0.0
        assert rows[0][f"{prefix}dpo/loss"] == pytest.approx(math.log(2.0), rel=1e-6)
    assert rows[2]["val/dpo/accuracy"] > 0.5  # held-out pairs after two updates (the step's own: noisier)
    assert rows[2]["val/dpo/margin"] > 0.0

    cut = tmp_path / "cut"
    shutil.copytree(straight, cut, ignore=shutil.ignore_patterns("final"))
    ckpts = sorted(p for p in (cut / "checkpoints").iterdir() if p.is_dir())
    assert [p.name[-1] for p in ckpts] == ["1", "2"]  # the last two kept
    shutil.rmtree(ckpts[1])
    run_job(cfg, cut, JOB)
    resumed = {r["step"]: r for r in map(json.loads, (cut / "metrics.jsonl").read_text().splitlines())}
    assert sorted(resumed) == [0, 1, 2]
    a, b = (
        {k: v for k, v in r[2].items() if not k.startswith(("time/", "throughput/"))} for r in (resumed, rows)
    )
    assert "val/dpo/accuracy" in a and a == pytest.approx(b, rel=1e-5, abs=1e-6)
    mine, theirs = (
        load_file(cut / "final" / "model.safetensors"),
        load_file(straight / "final" / "model.safetensors"),
    )
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
