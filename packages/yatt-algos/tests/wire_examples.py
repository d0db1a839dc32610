"""One example of every Struct in yatt_algos.types, with non-default values, for the wire contract test
(tests/test_wire_contract.py at the workspace root) and its golden fixtures in golden/."""

import struct

from yatt_algos.types import (
    AlgoConfig,
    EncodedTensor,
    Experience,
    LearnerConfig,
    OptimConfig,
    TrainStats,
)


def _f32(*values: float, shape: list[int]) -> EncodedTensor:
    return EncodedTensor(
        dtype="float32", shape=shape, data=memoryview(struct.pack(f"<{len(values)}f", *values))
    )


_IDS = EncodedTensor(dtype="int64", shape=[1, 3], data=memoryview(struct.pack("<3q", 1, 5, 2)))
_MASK = EncodedTensor(dtype="bool", shape=[1, 3], data=memoryview(bytes([1, 1, 1])))

EXAMPLES = [
    _f32(0.5, -1.0, shape=[2]),
    AlgoConfig(
        adv_estimator="rloo", loss_agg_mode="seq-mean-token-sum-norm", clip_ratio_high=0.28, kl_loss_coef=1e-2
    ),
    OptimConfig(lr=5e-7, num_warmup_steps=20, num_training_steps=500, micro_batch_size=2, betas=(0.9, 0.95)),
    Experience(
        input_ids=_IDS,
        attention_mask=_MASK,
        response_mask=EncodedTensor(dtype="bool", shape=[1, 3], data=memoryview(bytes([0, 1, 1]))),
        old_logprobs=_f32(0.0, -0.5, -0.25, shape=[1, 3]),
        advantages=_f32(0.0, 1.0, 1.0, shape=[1, 3]),
        group_ids=EncodedTensor(dtype="int64", shape=[1], data=memoryview(struct.pack("<q", 4))),
        policy_version=2,
    ),
    TrainStats(step=3, loss=0.125, grad_norm=0.5, lr=5e-7, num_tokens=96, metrics={"clip_frac": 0.25}),
    LearnerConfig(max_tokens_per_micro_batch=2048, lora_rank=8, lora_target_modules=("q_proj", "v_proj")),
]
