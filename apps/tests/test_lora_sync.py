"""LoRA runs sync adapters only (issue 29), without Ray: a LoRA learner's first push holds its base weights
(unmerged, HF names) then its adapter factors in buckets of their own, every later push the factors alone;
an HF engine fed those pushes computes the peft model's logits; `yatt export --adapter` writes a folder that
`peft.PeftModel.from_pretrained` loads to the same logits; impossible vLLM combinations are config errors."""

from __future__ import annotations

import io

import pytest
import torch
from yatt_algos.learner.torch_backend import TorchPolicyLearner
from yatt_algos.types import AlgoConfig, LearnerConfig, OptimConfig
from yatt_apps.config import RolloutSpec, RunConfig
from yatt_apps.io.export import export_checkpoint
from yatt_apps.io.models import load_causal_lm
from yatt_apps.overlay import build_config, to_yaml
from yatt_apps.runtime.learner_weights import LearnerWeights
from yatt_controller import checkpoint
from yatt_rollout.adapters import load_push
from yatt_rollout.hf_engine import HFEngine

LORA = LearnerConfig(lora_rank=4, lora_alpha=8.0)
IDS = torch.tensor([[5, 17, 42, 9, 77, 3]])


def _learner(policy_dir) -> TorchPolicyLearner:
    return TorchPolicyLearner(
        load_causal_lm(policy_dir), algo=AlgoConfig(), optim_config=OptimConfig(), learner=LORA
    )


def _train(model, seed: int) -> None:
    """Stand-in for an update: new adapter factors (peft starts B at 0, the identity)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=g))


def _push(weights: LearnerWeights) -> list[list[tuple[str, torch.Tensor]]]:
    """One streamed push as `phases.push_version` drives it: every bucket's tensors, in order."""
    buckets = []
    while weights.next_bucket(64 << 20) > 0:
        buckets.append(list(weights.named_weights()))
    return buckets


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _factor(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def test_the_base_travels_once_then_adapters_only_and_the_engine_matches_peft(policy_dir):
    learner = _learner(policy_dir)
    peft_model = learner.engine.model
    weights = LearnerWeights(learner, "ddp")
    engine = HFEngine(load_causal_lm(policy_dir), max_batch_size=1)
    try:
        full_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        _train(peft_model, 1)
        first = _push(weights)
        kinds = [{_factor(n) for n, _ in bucket} for bucket in first]
        assert kinds == [{False}, {True}]  # base bucket(s), then the adapter's own
        base_names = [n for n, _ in first[0]]
        assert base_names == [n for n, _ in engine.model.named_parameters()]  # HF names, nothing merged
        for bucket in first:
            load_push(engine, bucket, version=1)
        torch.testing.assert_close(_logits(engine.model), _logits(peft_model), atol=1e-5, rtol=0)
        for version, seed in ((2, 2), (3, 3)):  # later pushes: factors only, each replacing the last
            _train(peft_model, seed)
            (push,) = _push(weights)
            assert all(_factor(n) for n, _ in push)
            received = load_push(engine, push, version=version)
            rank, layers = 4, 2 * len(LORA.lora_target_modules)  # tiny: 2 layers x q/k/v/o
            assert received == sum(4 * t.numel() for _, t in push) and len(push) == 2 * layers
            assert full_bytes / received >= 10 and push[0][1].shape[0] == rank
            torch.testing.assert_close(_logits(engine.model), _logits(peft_model), atol=1e-5, rtol=0)
            assert engine.policy_version == version
        # a replaced replica's push (nothing held): the factors alone, B scaled by alpha / r
        named = dict(weights.named_weights())
        live = dict(peft_model.named_parameters())
        b = "model.layers.0.self_attn.q_proj.lora_B.weight"
        torch.testing.assert_close(named[b], 2.0 * live[f"base_model.model.{b[:-7]}.default.weight"])
    finally:
        engine.close()


def _lora_run(policy_dir, tmp_path, lora_rank: int = 4):
    """A run directory whose checkpoint holds a LoRA learner's state (adapters trained): (run dir, model)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sets = [f"model.path={policy_dir}", f"learner.lora_rank={lora_rank}", "learner.lora_alpha=8.0"]
    (run_dir / "config.yaml").write_text(to_yaml(build_config(RunConfig, RunConfig(), None, sets)))
    model = _learner(policy_dir).engine.model
    _train(model, 5)
    state = {"model": model.state_dict(), "optimizer": {}, "scheduler": {}, "num_steps": 1}
    blob = io.BytesIO()
    torch.save({**state, "num_skipped_total": 0, "rng": {}}, blob)
    checkpoint.write_checkpoint(run_dir / "checkpoints", 2, {"learner-0.0.bin": blob.getvalue()})
    return run_dir, model.eval()


def test_export_adapter_writes_what_peft_loads(policy_dir, tmp_path):
    from peft import PeftModel

    run_dir, model = _lora_run(policy_dir, tmp_path)
    record = export_checkpoint(run_dir, None, tmp_path / "adapter", adapter=True)
    assert record["step"] == 2 and record["adapter"] is True
    files = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert files == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    loaded = PeftModel.from_pretrained(load_causal_lm(policy_dir), tmp_path / "adapter").eval()
    torch.testing.assert_close(_logits(loaded), _logits(model), atol=1e-6, rtol=0)
    assert not torch.allclose(_logits(loaded), _logits(load_causal_lm(policy_dir)), atol=1e-3)


def test_export_adapter_of_a_full_run_is_refused(policy_dir, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = build_config(RunConfig, RunConfig(), None, [f"model.path={policy_dir}"])
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    with pytest.raises(ValueError, match=r"--adapter: .*run is not a LoRA run \(learner.lora_rank = 0\)"):
        export_checkpoint(run_dir, None, tmp_path / "out", adapter=True)


@pytest.mark.parametrize(
    ("rollout", "rank", "message"),
    [
        (
            RolloutSpec(engine="vllm", partial=True),
            8,
            "a running vLLM request keeps the LoRA adapter it started",
        ),
        (RolloutSpec(engine="vllm"), 600, "learner.lora_rank=600: vLLM serves LoRA ranks up to 512"),
    ],
)
def test_impossible_vllm_lora_runs_are_config_errors(rollout, rank, message):
    import msgspec

    with pytest.raises(ValueError, match=message):
        msgspec.structs.replace(RunConfig(), rollout=rollout, learner=LearnerConfig(lora_rank=rank))
    hf = msgspec.structs.replace(rollout, engine="hf")  # the HF engine applies any adapter, partial or not
    assert msgspec.structs.replace(RunConfig(), rollout=hf, learner=LearnerConfig(lora_rank=rank))


class _Ctx:
    """A rank-0 StepContext as `phases.push_version` uses it: each push lands `bytes_per_push` bytes."""

    def __init__(self, buckets: list[int], bytes_per_push: int) -> None:
        from types import SimpleNamespace

        self.rank, self.policy_version, self.state = 0, 0, {}
        push = lambda version: bytes_per_push  # noqa: E731
        self.weight_sync = SimpleNamespace(bucket_bytes=4096, push=push, pending=False)
        self.learner = SimpleNamespace(broadcast=lambda method, *args: [next(sizes)])
        sizes = iter(buckets)

    def get(self, refs):
        return refs

    def barrier(self) -> None:
        pass

    def before_push(self) -> None:
        pass


def test_sync_bytes_is_what_the_steps_pushes_landed():
    from yatt_apps.runtime.phases import SyncBytes, initial_push, sync_weights

    ctx = _Ctx([300, 0, 300, 200, 0], bytes_per_push=1000)
    initial_push(ctx, 0)  # type: ignore[arg-type]  # the attempt's first push: no step's bytes
    step = SyncBytes(lambda ctx, batch: {"loss": 1.0} if sync_weights(ctx) is None else {})
    assert step(ctx, []) == {"loss": 1.0, "sync/bytes": 2000.0}  # two streamed buckets, one push each
    assert ctx.policy_version == 1 and ctx.state == {}  # nothing left for the checkpoint
