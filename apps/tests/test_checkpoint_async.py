"""A background (async) checkpoint save killed with SIGKILL while its files are written: the checkpoint it was
writing never gets a manifest, so `resumable` picks the previous one, which loads into a learner exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from yatt_controller import checkpoint

# The writer: a tiny learner commits step 1 (sharded, synchronous), trains one more step, then saves step 2 in
# the background; its file writer says WRITING and blocks, standing in for a long write, until it is killed.
WRITER = textwrap.dedent(
    """
    import sys, time
    import torch, torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM, Qwen2Config
    from yatt_algos.learner.torch_backend import TorchPolicyLearner
    from yatt_algos.types import AlgoConfig, OptimConfig
    from yatt_controller import checkpoint

    root = sys.argv[1]
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    learner = TorchPolicyLearner(AutoModelForCausalLM.from_config(config), algo=AlgoConfig(),
                                 optim_config=OptimConfig(lr=1e-2))
    batch = {"input_ids": torch.randint(1, 64, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.bool)}
    batch |= {"response_mask": batch["attention_mask"].clone(), "advantages": torch.ones(2, 8),
              "old_logprobs": torch.full((2, 8), -4.0)}
    learner.update(batch)
    staging = checkpoint.begin(root, 1)
    learner.save_shards(str(staging / "learner"))
    files = {f"learner/{n}": e for n, e in learner.wait_shards().items()}
    checkpoint.commit(root, 1, files)
    torch.save(dict(learner.model.named_parameters()), f"{root}/../step1.pt")
    learner.update(batch)
    def stuck(self, plan, planner):
        sys.stdout.write("WRITING\\n")  # one write: print's text and newline could interleave with STAGED's
        sys.stdout.flush()
        time.sleep(600)
    dcp.FileSystemWriter.write_data = stuck
    staging = checkpoint.begin(root, 2)
    learner.save_shards(str(staging / "learner"), background=True)
    sys.stdout.write("STAGED\\n")
    sys.stdout.flush()
    learner.wait_shards()
    """
)


@pytest.mark.slow
def test_a_killed_background_save_leaves_the_previous_checkpoint_newest(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen2Config
    from yatt_algos.learner.torch_backend import TorchPolicyLearner
    from yatt_algos.types import AlgoConfig, OptimConfig

    root = tmp_path / "checkpoints"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(root)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:  # the two threads' lines may come in either order
        lines.append(line)
        if all(word in "".join(lines) for word in ("WRITING", "STAGED")):  # staged, and the write under way
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(lines)[-3000:]
    assert (root / ".staging-step-00000002" / "learner").is_dir()  # begun, never committed
    reports: list[str] = []
    found = checkpoint.resumable(root, report=reports.append)
    assert found is not None and found[1].step == 1 and reports == []
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(5)
    learner = TorchPolicyLearner(
        AutoModelForCausalLM.from_config(config), algo=AlgoConfig(), optim_config=OptimConfig(lr=1e-2)
    )
    learner.load_shards(str(found[0] / "learner"))
    want = torch.load(tmp_path / "step1.pt", weights_only=True)
    got = dict(learner.model.named_parameters())
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k].detach()) for k in want)
