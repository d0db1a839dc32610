"""`yatt sft`: response-only masking against a hand-built example, the data errors, the SFT learner rank (its
loss, and the HF folder it writes reproducing its greedy output), and the job end to end (slow)."""

from __future__ import annotations

import json

import pytest
import torch
from yatt_apps.config import PRESETS
from yatt_apps.io.data import arithmetic_task
from yatt_apps.io.models import load_causal_lm, prepare_model, tokenizer_corpus
from yatt_apps.io.sft_data import (
    chat_messages,
    encode_pair,
    load_sft_rows,
    masked_nll,
    pad_examples,
    token_nll,
)
from yatt_apps.jobs.sft import SFTWorker, sft_batch
from yatt_controller.types import WorkerInfo


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    rows = arithmetic_task(64, seed=0)
    return str(
        prepare_model(
            PRESETS["tiny_cpu_sft"]().model, tmp_path_factory.mktemp("sft") / "policy", tokenizer_corpus(rows)
        )
    )


@pytest.fixture(scope="module")
def tok(policy_dir):
    from yatt_apps.io.models import load_tokenizer

    return load_tokenizer(policy_dir)


def test_response_mask_of_a_hand_built_example(tok):
    """ChatML: the prompt is the template with its generation prompt; the response is '12' then <|im_end|>,
    and the '\\n' the template writes after <|im_end|> is no target."""
    prompt, response = encode_pair(tok, chat_messages("Be brief.", "3 + 9 ="), "12")
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n3 + 9 =<|im_end|>\n<|im_start|>assistant\n"
    assert prompt == tok(text, add_special_tokens=False)["input_ids"]
    assert response == tok("12", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert tok.decode(response) == "12<|im_end|>"
    batch = pad_examples([(prompt, response), ([5, 6], [7])], pad_id=tok.pad_token_id)
    n = len(prompt) + len(response)
    assert batch["input_ids"].shape == (2, n)
    assert batch["response_mask"][0].tolist() == [False] * len(prompt) + [True] * len(response)
    assert batch["response_mask"][1].tolist() == [False, False, True] + [False] * (n - 3)
    assert batch["attention_mask"][1].tolist() == [True] * 3 + [False] * (n - 3)


def test_masked_nll_is_the_mean_over_response_tokens_only(tok, policy_dir):
    model = load_causal_lm(policy_dir)
    examples = [
        encode_pair(tok, chat_messages("", "3 + 9 ="), "12"),
        encode_pair(tok, chat_messages("", "1 - 4 ="), "-3"),
    ]
    batch = pad_examples(examples, tok.pad_token_id)
    with torch.no_grad():
        loss = float(masked_nll(model, batch))
        by_hand = []
        for prompt, response in examples:  # each unpadded, scored token by token
            ids = torch.tensor([prompt + response])
            logp = torch.log_softmax(model(input_ids=ids).logits[0], -1)
            by_hand += [-float(logp[len(prompt) + j - 1, t]) for j, t in enumerate(response)]
        assert len(by_hand) == int(batch["response_mask"].sum())  # 3 + 3 tokens: digits and <|im_end|>
        assert loss == pytest.approx(sum(by_hand) / len(by_hand), rel=1e-5)
        assert float(token_nll(model, batch)[0, 0]) == 0.0


def test_bad_rows_name_file_line_and_field(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"q": "1 + 1 =", "a": "2"}\n{"q": "2 + 2 ="}\n')
    with pytest.raises(ValueError, match=rf"^{path}:2: missing field 'a'$"):
        load_sft_rows(path, prompt_key="q", response_key="a")
    path.write_text('{"q": "1 + 1 =", "a": 2}\n')
    with pytest.raises(ValueError, match=rf"^{path}:1: field 'a' must be a string, got int$"):
        load_sft_rows(path, prompt_key="q", response_key="a")
    path.write_text('{"q": " ", "a": "2"}\n')
    with pytest.raises(ValueError, match=rf"^{path}:1: field 'q' is empty$"):
        load_sft_rows(path, prompt_key="q", response_key="a")


def test_chat_rows_with_tool_calls_train_on_the_assistant_turns_only(tok, tmp_path):
    """TRL's conversational format: `messages` with `tool_calls` and `tool` messages (and `tools`), mixed
    with prompt/response rows in one file; the loss mask covers the assistant turns through their eos."""
    import random

    from yatt_apps.io.sft_data import ChatRow
    from yatt_rollout.env import tool_schemas
    from yatt_rollout.tool_tasks import MultiplyEnv

    demo = MultiplyEnv().demonstration({"prompt": "12 * 34 =", "answer": "408"}, "tool", random.Random(0))
    path = tmp_path / "chat.jsonl"
    chat = {"messages": demo, "tools": tool_schemas(MultiplyEnv().tools)}
    path.write_text(json.dumps(chat) + "\n" + json.dumps({"prompt": "1 + 1 =", "response": "2"}) + "\n")
    rows = load_sft_rows(path)
    assert isinstance(rows[0], ChatRow) and (rows[0].prompt, rows[0].answer) == ("12 * 34 =", "408")
    batch = sft_batch(tok, [rows[0], arithmetic_task(1, seed=0)[0]], "")
    own = tok.decode(batch["input_ids"][0][batch["response_mask"][0]])
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call>'
    assert own == f"{call}<|im_end|>408<|im_end|>"
    row = arithmetic_task(1, seed=0)[0]  # a prompt/response row: encode_pair's layout as before
    prompt, response = encode_pair(tok, chat_messages("", row.prompt), row.answer)
    n = len(prompt) + len(response)
    assert batch["input_ids"][1, :n].tolist() == prompt + response
    assert batch["response_mask"][1].tolist() == [False] * len(prompt) + [True] * len(response) + [False] * (
        batch["input_ids"].shape[1] - n
    )
    bad = {"messages": [demo[0], {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}]}
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=rf"^{path}:1: messages\[1\].tool_calls\[0\] needs \"function\""):
        load_sft_rows(path)
    path.write_text(json.dumps({"messages": [demo[0]]}) + "\n")
    with pytest.raises(ValueError, match=rf"^{path}:1: field 'messages' has no assistant message"):
        load_sft_rows(path)
    path.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match=r"messages\[0\].role must be one of \['system', 'user'"):
        load_sft_rows(path)


def test_parquet_rows_are_read_with_1_based_row_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["1 + 1 =", "2 + 2 ="], "response": ["2", ""]}), path)
    with pytest.raises(ValueError, match=rf"^{path}: row 2: field 'response' is empty$"):
        load_sft_rows(path)
    pq.write_table(pa.table({"prompt": ["1 + 1 ="], "response": ["2"]}), path)
    assert [(r.prompt, r.response) for r in load_sft_rows(path)] == [("1 + 1 =", "2")]


def test_sft_worker_learns_and_its_hf_folder_reproduces_it(tok, policy_dir, tmp_path):
    """The learner rank's loss falls on repeated batches; `save_hf` writes a folder that from_pretrained loads
    and whose greedy output equals the rank's own model's on a fixed prompt."""
    from transformers import AutoModelForCausalLM

    cfg = PRESETS["tiny_cpu_sft"]()
    worker = SFTWorker(cfg, policy_dir, "unused", worker_info=WorkerInfo(role="actor", dp_rank=0, dp_size=1))
    rows = arithmetic_task(32, seed=3)
    batch = sft_batch(tok, rows, "")
    losses = [worker.sft(batch)["loss"] for _ in range(12)]
    assert losses[-1] < 0.6 * losses[0], losses
    out = worker.save_hf(str(tmp_path / "final"))
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32)
    prompt = torch.tensor([encode_pair(tok, chat_messages("", rows[0].prompt), rows[0].answer)[0]])
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": tok.pad_token_id}
    mine = worker.learner.model.eval().generate(prompt, **kwargs)
    assert loaded.generate(prompt, **kwargs).tolist() == mine.tolist()
    for name, value in worker.learner.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    written = {p.name for p in (tmp_path / "final").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= written
    assert not (tmp_path / "final.tmp").exists()


@pytest.mark.slow
def test_yatt_sft_on_a_jsonl_writes_a_loadable_folder(yatt_cli, tmp_path):
    """`yatt sft` as a user runs it (the command in this process, on the module's Ray): two controllers (gloo DDP learner ranks), the loss falls, RUN_DIR/final
    loads with AutoModelForCausalLM.from_pretrained."""
    from transformers import AutoModelForCausalLM

    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": r.prompt, "solution": r.answer}) + "\n"
            for r in arithmetic_task(64, seed=5)
        )
    )
    run_dir = tmp_path / "run"
    argv = [
        "sft",
        "--run-dir",
        str(run_dir),
        "--set",
        f"sft.train={data}",
        "--set",
        "sft.prompt_key=question",
        "--set",
        "sft.response_key=solution",
        "--set",
        "run.num_steps=8",
        "--set",
        "optim.lr=5e-3",
        "--set",
        "run.eval_every=0",
        "--set",
        "data.num_val_rows=0",
    ]
    yatt_cli(*argv)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [row["train/loss"] for row in rows]
    assert len(losses) == 8 and losses[-1] < 0.7 * losses[0], losses
    assert all(row["sft/tokens"] > 0 and row["train/lr"] > 0 for row in rows)
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final", local_files_only=True)
    assert model.config.num_hidden_layers == 2
