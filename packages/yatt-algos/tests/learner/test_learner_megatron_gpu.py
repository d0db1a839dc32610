"""The Megatron-Core backend on CUDA with NCCL and no shim (the product path): forward and update parity with
the HF model on converted weights. Marked `gpu`; skipped without CUDA (also when run outside the workspace)."""

import importlib.util

import pytest
import torch
from yatt_algos.types import AlgoConfig, OptimConfig

# found, not imported: collecting this file in every worker would import megatron (1.5-1.8 s)
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron.core") is None, reason="needs the megatron extra"
)
pytest.importorskip("transformers", reason="the tiny test models are HF models")

# eps 1e-6: see test_learner_torch.OPTIM
OPTIM = OptimConfig(lr=1e-3, eps=1e-6, micro_batch_size=3, clip_grad_norm=1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_megatron_forward_and_update_match_hf_on_gpu(tiny):
    """Forward logits within 1e-5 (fp32, TF32 off), the same loss and the same trained weights (1e-5)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from yatt_algos.learner.megatron_backend import MegatronPolicyLearner
    from yatt_algos.learner.torch_backend import TorchPolicyLearner

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{tiny.free_port()}", rank=0, world_size=1)
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        ps.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        hf = tiny.lm(0).cuda()
        megatron = MegatronPolicyLearner(
            tiny.config(), hf.state_dict(), algo=AlgoConfig(), optim_config=OPTIM
        )
        batch = tiny.dp_batch()
        ids = batch["input_ids"].cuda()
        with torch.no_grad():
            pos = torch.arange(ids.shape[1], device="cuda").expand_as(ids)
            mask = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device="cuda"), 1)[
                None, None
            ]
            diff = (megatron.model(ids, pos, mask) - hf(input_ids=ids).logits).abs().max()
        assert float(diff) < 1e-5
        lp_m = megatron.compute_logprobs(batch)
        torch_learner = TorchPolicyLearner(hf, algo=AlgoConfig(), optim_config=OPTIM)
        cuda_batch = {k: v.cuda() for k, v in batch.items()}
        assert torch.allclose(lp_m, torch_learner.compute_logprobs(cuda_batch).cpu(), atol=1e-5, rtol=0)
        stats_m, stats_h = megatron.update(batch), torch_learner.update(cuda_batch)
        assert stats_m.loss == pytest.approx(stats_h.loss, abs=1e-6)
        exported = {k: v for bucket in megatron.export_weights(1 << 16) for k, v in bucket}
        trained = hf.state_dict()
        assert max(float((exported[k] - trained[k]).abs().max()) for k in trained) < 1e-5
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
