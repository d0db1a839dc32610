"""Validation of yatt_rollout's types: sampling bounds, defaults, and the zero-copy weight bucket buffer."""

import msgspec
import pytest
from yatt_rollout.types import GenerateRequest, Prompt, SamplingParams, WeightBucket


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("n", 0, "n must be >= 1"),
        ("max_new_tokens", 0, "max_new_tokens must be >= 1"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
        ("temperature", -1.0, "temperature must be >= 0"),
        ("top_k", -1, "top_k must be >= 0"),
        ("choices", [], r"choices must not be empty \(leave it unset"),
        ("choices", ["yes", ""], r"choices\[1\] is an empty string"),
        ("allowed_token_ids", [], "allowed_token_ids must not be empty"),
        ("allowed_token_ids", [3, -1], "allowed_token_ids has a negative id -1"),
    ],
)
def test_sampling_bounds(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_request_defaults_are_not_sent():
    req = GenerateRequest(request_id="r", prompt=Prompt(token_ids=[1]))
    assert msgspec.json.encode(req) == b'{"request_id":"r","prompt":{"token_ids":[1]}}'
    assert msgspec.json.decode(msgspec.json.encode(req), type=GenerateRequest).sampling == SamplingParams()


def test_weight_bucket_decodes_without_copy():
    payload = bytes(range(64))
    wire = msgspec.msgpack.encode(
        WeightBucket(names=["w"], shapes=[[16]], offsets=[0], dtype="float32", data=memoryview(payload))
    )
    bucket = msgspec.msgpack.decode(wire, type=WeightBucket)
    assert bucket.data.obj is wire and bytes(bucket.data) == payload


def test_constraints_are_sent_only_when_set():
    assert msgspec.json.encode(SamplingParams()).endswith(b'"logprobs":true}')  # old readers decode it
    both = {"choices": ["yes"], "allowed_token_ids": [1]}
    with pytest.raises(ValueError, match="choices and allowed_token_ids cannot both be set"):
        SamplingParams(**both)
    with pytest.raises(msgspec.ValidationError, match="cannot both be set"):
        msgspec.json.decode(msgspec.json.encode(both), type=SamplingParams)
    params = SamplingParams(choices=["yes", "no"])
    assert msgspec.json.decode(msgspec.json.encode(params), type=SamplingParams).choices == ["yes", "no"]


def test_version_runs_are_appended_and_default_to_one_run():
    from yatt_rollout.types import Completion

    old = Completion(
        request_id="r", index=0, token_ids=[5, 6, 7], logprobs=[], finish_reason="stop", policy_version=2
    )
    assert b"version_runs" not in msgspec.json.encode(old)  # old bytes unchanged while empty
    assert old.runs() == [(2, 3)] and old.token_versions() == [2, 2, 2]
    spanned = msgspec.structs.replace(old, version_runs=[(2, 1), (3, 2)])
    wire = msgspec.json.decode(msgspec.json.encode(spanned), type=Completion)
    assert wire.version_runs == [(2, 1), (3, 2)] and wire.token_versions() == [2, 3, 3]
    error = Completion(
        request_id="r", index=0, token_ids=[], logprobs=[], finish_reason="error", policy_version=4
    )
    assert error.runs() == [] and error.token_versions() == []
