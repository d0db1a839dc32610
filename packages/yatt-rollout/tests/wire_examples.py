"""One example of every Struct in yatt_rollout.types, with non-default values, for the wire contract test
(tests/test_wire_contract.py at the workspace root) and its golden fixtures in golden/."""

import struct

from yatt_rollout.types import (
    Completion,
    GenerateRequest,
    MediaRef,
    Prompt,
    ReplicaLoad,
    SamplingParams,
    WeightBucket,
)

_IMAGE = MediaRef(kind="image", uri="file:///data/img/0001.png", sha256="ab" * 32)

EXAMPLES = [
    SamplingParams(n=4, temperature=1.0, top_p=0.9, top_k=50, max_new_tokens=128, stop_token_ids=[2], seed=7),
    _IMAGE,
    Prompt(token_ids=[1, 15, 27, 9], media=[_IMAGE], text="What is 2+3?"),
    GenerateRequest(request_id="c0-s3-p12", prompt=Prompt(token_ids=[1, 2, 3]), sampling=SamplingParams(n=2)),
    Completion(
        request_id="c0-s3-p12",
        index=1,
        token_ids=[40, 41, 2],
        logprobs=[-0.5, -1.25, -0.125],
        finish_reason="stop",
        policy_version=3,
    ),
    WeightBucket(
        names=["model.embed_tokens.weight", "lm_head.weight"],
        shapes=[[2, 2], [1, 2]],
        offsets=[0, 16],
        dtype="float32",
        data=memoryview(struct.pack("<6f", 1, 2, 3, 4, 5, 6)),
        version=3,
    ),
    ReplicaLoad(
        replica=1,
        outstanding_requests=3,
        outstanding_tokens=384,
        completed_requests=40,
        generated_tokens=2560,
        failed_requests=1,
    ),
]
