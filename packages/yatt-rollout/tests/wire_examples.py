"""One example of every Struct in yatt_rollout.types, with non-default values, for the wire contract test
(tests/test_wire_contract.py at the workspace root) and its golden fixtures in golden/."""

import struct

from yatt_rollout.types import (
    Completion,
    GenerateRequest,
    MediaRef,
    Prompt,
    ReplicaLoad,
    RoutedExperts,
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
    Completion(  # a partial rollout: 2 tokens by policy 3, then 1 by policy 4 after a weight update
        request_id="c0-s3-p13",
        index=0,
        token_ids=[40, 42, 2],
        logprobs=[-0.5, -0.75, -0.125],
        finish_reason="stop",
        policy_version=3,
        version_runs=[(3, 2), (4, 1)],
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

# multi-turn environments and tools (appended in 0.3.0)
from yatt_rollout.types import (  # noqa: E402
    Action,
    Message,
    Observation,
    SandboxResult,
    StepResult,
    ToolCall,
    ToolResult,
    ToolSpec,
    Trajectory,
)

_TOOL_MSG = Message(role="tool", content="7")
EXAMPLES += [
    _TOOL_MSG,
    ToolSpec(
        name="calculator",
        description="Evaluate an integer arithmetic expression.",
        parameters={"type": "object", "properties": {"expression": {"type": "string"}}},
    ),
    ToolCall(name="calculator", arguments={"expression": "3 + 4"}),
    ToolResult(status="timeout", output="error: timeout: the code ran past its 2.0 s wall-time limit"),
    SandboxResult(
        status="ok", stdout="42\n", stderr="", exit_code=0, wall_s=0.05, network_isolation="namespace"
    ),
    Observation(messages=[_TOOL_MSG]),
    Action(
        text='<tool_call>{"name": "calculator", "arguments": {"expression": "3 + 4"}}</tool_call>',
        tool_calls=[ToolCall(name="calculator", arguments={"expression": "3 + 4"})],
        malformed=["not JSON"],
    ),
    StepResult(
        observation=Observation(messages=[_TOOL_MSG]),
        reward=1.0,
        done=True,
        tool_calls=1,
        tool_errors=["malformed"],
    ),
    Trajectory(
        request_id="s0-c0-p3",
        index=1,
        token_ids=[40, 41, 3, 7, 8, 42],
        logprobs=[-0.5, -1.25, 0.0, 0.0, 0.0, -0.125],
        response_mask=[1, 1, 0, 0, 0, 1],
        finish_reason="stop",
        policy_version=2,
        stop_reason="max_turns",
        num_turns=2,
        reward=1.0,
        tool_calls=1,
        tool_errors={"malformed": 1},
    ),
]
# 2 positions x 2 layers x top-2, one byte per expert id
EXAMPLES += [RoutedExperts(num_layers=2, top_k=2, dtype="uint8", data=bytes([0, 3, 2, 1, 1, 2, 3, 0]))]
