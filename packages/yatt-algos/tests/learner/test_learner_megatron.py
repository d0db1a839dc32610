"""The Megatron-Core backend: HF <-> Megatron conversion (exact, with tensor and pipeline splits), and forward
and update parity with HF on converted weights.

On CPU the Megatron model runs only inside `megatron_cpu_shim` (conftest: a test-only shim, see its
docstring); the `gpu`-marked test runs the same parity on CUDA with no shim and skips without a GPU.
"""

import importlib.util

import pytest
import torch
from yatt_algos.learner.megatron_convert import arch_from_hf, hf_to_megatron, megatron_to_hf
from yatt_algos.types import AlgoConfig, OptimConfig

# found, not imported: collecting this file in every worker would import megatron (1.5-1.8 s)
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron.core") is None, reason="needs the megatron extra"
)
pytest.importorskip("transformers", reason="the tiny test models are HF models")

# eps 1e-6: see test_learner_torch.OPTIM
OPTIM = OptimConfig(lr=1e-3, eps=1e-6, micro_batch_size=3, clip_grad_norm=1.0)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_hf_megatron_hf_round_trip_is_exact(tiny, kind, tp, pp):
    hf = tiny.lm(0, kind=kind).state_dict()
    arch = arch_from_hf(tiny.config(kind))
    shards = [
        [hf_to_megatron(hf, arch, tp_rank=t, tp=tp, pp_rank=p, pp=pp) for t in range(tp)] for p in range(pp)
    ]
    back = megatron_to_hf(shards, arch)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    # the fused qkv of layer 0, group 0, on tensor rank 0: 2 query heads, then the key head, then the value head
    qkv = shards[0][0]["decoder.layers.0.self_attention.linear_qkv.weight"]
    attn = "model.layers.0.self_attn."
    assert qkv.shape == ((4 + 2 * 2) * 16 // tp, 64)
    assert torch.equal(qkv[:32], hf[attn + "q_proj.weight"][:32])
    assert torch.equal(qkv[32:48], hf[attn + "k_proj.weight"][:16])
    assert torch.equal(qkv[48:64], hf[attn + "v_proj.weight"][:16])
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in shards[0][0]) == (kind == "qwen2")


def test_bad_parallel_sizes_are_named(tiny):
    arch = arch_from_hf(tiny.config())
    with pytest.raises(
        ValueError, match=r"config\.num_key_value_heads=2 is not divisible by the parallel size 4"
    ):
        hf_to_megatron(tiny.lm(0).state_dict(), arch, tp=4)
    with pytest.raises(ValueError, match=r"config\.model_type 'gpt2' is not supported"):
        from transformers import GPT2Config

        arch_from_hf(GPT2Config())


# The CPU shim replaces torch.cuda.current_device: on a CUDA machine the gpu test file covers the same ground.
cpu_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU-shim test; CUDA machines run the gpu test"
)


@pytest.fixture(scope="module")
def megatron_world(tiny):
    """A one-process gloo group and Megatron parallel state (TP = PP = 1) inside the CPU shim."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    made = tiny.init_megatron(0, 1, tiny.free_port())
    with tiny.megatron_cpu_shim():
        yield
    ps.destroy_model_parallel()
    if made:  # a group an earlier test's vLLM engine left is not this fixture's to take down
        dist.destroy_process_group()


def _learners(tiny, algo, optim_config):
    from yatt_algos.learner.megatron_backend import MegatronPolicyLearner
    from yatt_algos.learner.torch_backend import TorchPolicyLearner

    hf = tiny.lm(0)
    megatron = MegatronPolicyLearner(tiny.config(), hf.state_dict(), algo=algo, optim_config=optim_config)
    return megatron, TorchPolicyLearner(hf, algo=algo, optim_config=optim_config)


@cpu_only
def test_megatron_forward_matches_hf(tiny, megatron_world):
    from yatt_algos.learner.interface import PolicyLearner

    megatron, hf = _learners(tiny, AlgoConfig(), None)
    assert isinstance(megatron, PolicyLearner)
    batch = tiny.dp_batch()
    ids = batch["input_ids"]
    with torch.no_grad():
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        mask = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), 1)[None, None]
        logits_m = megatron.model(ids, pos, mask)
        logits_h = hf.model(input_ids=ids).logits
    assert float((logits_m - logits_h).abs().max()) < 1e-5
    lp_m, ent_m = megatron.compute_logprobs_and_entropy(batch)
    lp_h, ent_h = hf.compute_logprobs_and_entropy(batch)
    assert torch.allclose(lp_m, lp_h, atol=1e-5, rtol=0) and torch.allclose(ent_m, ent_h, atol=1e-5, rtol=0)


@cpu_only
def test_megatron_update_matches_torch_backend(tiny, megatron_world):
    algo = AlgoConfig(kl_loss_coef=0.05, loss_agg_mode="seq-mean-token-sum")
    megatron, hf = _learners(tiny, algo, OPTIM)
    batch = tiny.dp_batch()
    stats_m, stats_h = megatron.update(batch), hf.update(batch)
    assert stats_m.loss == pytest.approx(stats_h.loss, abs=1e-6)
    assert stats_m.grad_norm == pytest.approx(stats_h.grad_norm, rel=1e-5)
    assert stats_m.metrics["clip_frac"] == pytest.approx(stats_h.metrics["clip_frac"], abs=1e-6)
    exported = {k: v for bucket in megatron.export_weights(1 << 16) for k, v in bucket}
    trained = hf.model.state_dict()
    assert exported.keys() == trained.keys()
    assert max(float((exported[k] - trained[k]).abs().max()) for k in trained) < 1e-5
    state = megatron.state_dict()
    assert state["num_steps"] == 1 and "decoder.layers.0.mlp.linear_fc1.weight" in state["model"]
    # resume from the state into a learner built from other weights: the next update agrees bit-exactly
    from yatt_algos.learner.megatron_backend import MegatronPolicyLearner

    resumed = MegatronPolicyLearner(tiny.config(), tiny.lm(7).state_dict(), algo=algo, optim_config=OPTIM)
    resumed.load_state_dict(state)
    megatron.update(batch)
    resumed.update(batch)
    a, b = megatron.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))


@pytest.fixture(scope="module")
def two_process_results(tiny, tmp_path_factory):
    """One pair of gloo processes (megatron_worker.py) runs the three layouts in turn (the imports of a
    process pair are the cost); returns the folder of their results, a subfolder per layout."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path_factory.mktemp("megatron")
    worker, port = Path(__file__).with_name("megatron_worker.py"), tiny.free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(rank), str(port), str(out), "2x1", "1x2", "1x1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-4000:]
    return out


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (1, 1)], ids=["tp2", "pp2", "dp2"])
def test_two_process_megatron_matches_hf(tiny, tp, pp, two_process_results):
    """Two gloo processes: TP = 2 (vocab-parallel logits gathered, sharded grad norm), PP = 2 (Megatron's 1F1B
    schedule over gloo p2p, logprobs and stats shared from the last stage, each stage's layers in every rank's
    export) or DP = 2 (gradients all-reduced), against the HF model trained by the torch backend on the whole
    batch."""
    from yatt_algos.learner.torch_backend import TorchPolicyLearner

    result = two_process_results / f"{tp}x{pp}"
    got = torch.load(result / "rank0.pt", weights_only=True)

    algo = AlgoConfig(kl_loss_coef=0.05, loss_agg_mode="seq-mean-token-mean")
    hf = TorchPolicyLearner(tiny.lm(0), algo=algo, optim_config=OPTIM)
    batch = tiny.dp_batch()
    assert torch.allclose(got["logprobs"], hf.compute_logprobs(batch), atol=1e-5, rtol=0)
    stats = hf.update(batch)
    assert got["loss"] == pytest.approx(stats.loss, abs=1e-6)
    assert got["grad_norm"] == pytest.approx(stats.grad_norm, rel=1e-5)
    trained = hf.model.state_dict()
    for rank in range(2):
        weights = torch.load(result / f"weights{rank}.pt", weights_only=True)
        assert weights.keys() == trained.keys(), f"rank {rank} exported {sorted(weights)}"
        assert max(float((weights[k] - trained[k]).abs().max()) for k in trained) < 1e-5


@cpu_only
@pytest.mark.slow
def test_megatron_sharded_checkpoints_round_trip_and_load_unsharded(tiny, tmp_path):
    """Two gloo processes (megatron_ckpt_worker.py), at TP = 2 and at PP = 2: each rank writes its own part
    through Megatron's distributed checkpointing; the same layout loads it back exactly, and TP = PP = 1 loads
    it as the unsharded model with its optimizer state (the next update agrees)."""
    import subprocess
    import sys
    from pathlib import Path

    worker, port = Path(__file__).with_name("megatron_ckpt_worker.py"), tiny.free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(rank), str(port), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-4000:]
    hf_names = tiny.lm(0).state_dict().keys()
    for layout in ("2x1", "1x2"):
        got = torch.load(tmp_path / f"result-{layout}.pt", weights_only=True)
        saved = got["saved"]
        assert saved.keys() == hf_names
        for key in ("round_trip", "loaded"):
            assert got[key].keys() == saved.keys()
            assert all(torch.equal(got[key][k], saved[k]) for k in saved), (layout, key)
        # the optimizer's moments and step count came along: the next update is the same
        assert got["resumed_loss"] == pytest.approx(got["loss"], abs=1e-6)
        assert max(float((got["resumed_after"][k] - got["after"][k]).abs().max()) for k in saved) < 1e-6
        assert got["steps"] == (2, 2)
        # each rank wrote its own slices (rank 0 also the metadata), about half of the data each
        rank0, rank1 = got["files"]
        assert {"metadata.json", "common.pt", ".metadata", "extra-0.pt"} <= set(rank0)
        assert sorted(rank1) == ["__1_0.distcp", "__1_1.distcp", "extra-1.pt"]
        data = [sum(n for name, n in files.items() if name.endswith(".distcp")) for files in (rank0, rank1)]
        assert all(0.35 < part / sum(data) < 0.65 for part in data), (layout, data)
