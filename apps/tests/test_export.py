"""`save_hf` and `export_checkpoint` without Ray: a LoRA policy is written with its adapters merged (the live
model untouched), a checkpoint's learner blob becomes a loadable HF folder with the run's tokenizer and chat
template, and folders are replaced only when complete. The export of a real run is in test_run_lifecycle."""

from __future__ import annotations

import io

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from yatt_algos.learner.torch_engine import apply_lora
from yatt_algos.types import LearnerConfig
from yatt_apps.config import RunConfig
from yatt_apps.io.export import export_checkpoint, save_hf
from yatt_apps.io.models import load_causal_lm
from yatt_apps.overlay import build_config, to_yaml
from yatt_controller import checkpoint

LORA = LearnerConfig(lora_rank=4, lora_alpha=8.0)
IDS = torch.tensor([[5, 17, 42, 9, 77, 3]])


def _lora_model(policy_dir):
    """The tiny policy with LoRA adapters whose B is non-zero (a fresh adapter is the identity)."""
    torch.manual_seed(3)
    model = apply_lora(load_causal_lm(policy_dir), LORA)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    return model.eval()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_save_hf_merges_lora_and_leaves_the_live_model(policy_dir, tmp_path):
    model = _lora_model(policy_dir)
    base = load_causal_lm(policy_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    want = _logits(model)
    assert not torch.allclose(want, _logits(base), atol=1e-3)  # the adapters change the output
    out = save_hf(model, policy_dir, tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(loaded), want, atol=1e-5, rtol=1e-5)
    assert not any("lora" in k for k in loaded.state_dict())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # merged out of place
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and tok.chat_template == AutoTokenizer.from_pretrained(policy_dir).chat_template
    assert not (tmp_path / "merged.tmp").exists()


def test_save_hf_replaces_a_folder_only_when_complete(policy_dir, tmp_path):
    out = save_hf(load_causal_lm(policy_dir), policy_dir, tmp_path / "final")
    first = (out / "model.safetensors").read_bytes()
    with pytest.raises(
        ValueError, match=r"no tokenizer at .*no-tokenizer-here"
    ):  # a failed save keeps the old folder
        save_hf(load_causal_lm(policy_dir), tmp_path / "no-tokenizer-here", out)
    assert (out / "model.safetensors").read_bytes() == first and not (tmp_path / "final.tmp").exists()
    save_hf(_lora_model(policy_dir), policy_dir, out)
    assert (out / "model.safetensors").read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_export_checkpoint_of_a_lora_learner(policy_dir, tmp_path):
    """A run directory whose learner trained LoRA adapters: the checkpoint's blob (the learner state layout:
    model, optimizer, scheduler, counters, RNG) exports as a plain model equal to the adapted one."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = build_config(
        RunConfig,
        RunConfig(),
        None,
        [f"model.path={policy_dir}", "learner.lora_rank=4", "learner.lora_alpha=8.0"],
    )
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    model = _lora_model(policy_dir)
    state = {
        "model": model.state_dict(),
        "optimizer": {},
        "scheduler": {},
        "num_steps": 3,
        "num_skipped_total": 0,
        "rng": {},
    }
    blob = io.BytesIO()
    torch.save(state, blob)
    checkpoint.write_checkpoint(run_dir / "checkpoints", 7, {"learner-0.0.bin": blob.getvalue()})
    record = export_checkpoint(run_dir, None, tmp_path / "out")
    assert record["step"] == 7 and record["lora_merged"] is True
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(loaded), _logits(model), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "preset", ["tiny_cpu", "tiny_cpu_dapo", "tiny_cpu_ppo", "tiny_cpu_capo", "tiny_cpu_sft"]
)
def test_a_runs_config_reads_back_as_its_jobs_config(tmp_path, preset):
    """export (and the final model of every run) reads config.yaml as the job's own config class: a PPO run's
    `critic_optim` is its key, not an unknown one."""
    from yatt_apps.config import PRESETS
    from yatt_apps.io.export import run_config
    from yatt_apps.overlay import to_yaml

    cfg = PRESETS[preset]()
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    assert run_config(tmp_path) == cfg


def test_export_of_a_sharded_checkpoint_streams_into_the_policy(policy_dir, tmp_path):
    """A LoRA learner's sharded (DCP) checkpoint, as the runtime writes it (`learner/` in the checkpoint),
    exports bucket by bucket as a plain model equal to the live learner's."""
    from yatt_algos.learner.torch_backend import TorchPolicyLearner
    from yatt_algos.types import AlgoConfig, OptimConfig

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    overrides = [f"model.path={policy_dir}", "learner.lora_rank=4", "learner.lora_alpha=8.0"]
    (run_dir / "config.yaml").write_text(to_yaml(build_config(RunConfig, RunConfig(), None, overrides)))
    learner = TorchPolicyLearner(
        load_causal_lm(policy_dir), algo=AlgoConfig(), optim_config=OptimConfig(), learner=LORA
    )
    with torch.no_grad():
        for name, param in learner.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    staging = checkpoint.begin(run_dir / "checkpoints", 4)
    learner.save_shards(str(staging / "learner"), background=True)
    files = {f"learner/{name}": entry for name, entry in learner.wait_shards().items()}
    checkpoint.commit(run_dir / "checkpoints", 4, files)
    assert sorted(files) == ["learner/.metadata", "learner/__0_0.distcp", "learner/extra-0.pt"]
    record = export_checkpoint(run_dir, None, tmp_path / "out")
    assert record["step"] == 4 and record["lora_merged"] is True
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(loaded), _logits(learner.model.eval()), atol=1e-5, rtol=1e-5)
