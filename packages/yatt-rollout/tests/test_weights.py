"""WeightSlots: parameters laid out like `make_buckets`' buffers, so a bucket of the same model loads with one
byte copy per bucket; other orders and dtype casts fall back to a copy per tensor with the same result; a
moved model is laid out again; discard and refill keep per-slot tracking."""

import pytest
import torch
from yatt_rollout.buckets import ALIGN, bucket_tensors, decode_all, encode_frames, make_buckets
from yatt_rollout.tiny import tiny_causal_lm
from yatt_rollout.weights import WeightSlots

pytest.importorskip("transformers")


def _model(seed: int):
    return tiny_causal_lm(96, seed=seed, max_position_embeddings=64)


def _received(model, max_bytes: int, order=None):
    """(name, tensor) views over one received buffer of the model's buckets, as an engine gets them."""
    named = list(model.state_dict().items())
    if order is not None:
        named = [named[i] for i in order]
    buckets = make_buckets(named, max_bytes=max_bytes)
    wire = bytearray(b"".join(bytes(part) for b in buckets for part in encode_frames(b)))
    return [pair for b in decode_all(wire) for pair in bucket_tensors(b)], len(buckets)


def _equal(model, source) -> bool:
    want = source.state_dict()
    return all(torch.equal(p, want[name]) for name, p in model.named_parameters())


@pytest.mark.parametrize("max_bytes", [1 << 30, 1 << 14], ids=["one-bucket", "many-buckets"])
def test_same_layout_loads_with_one_copy_per_bucket(max_bytes):
    target, source = _model(0), _model(1)
    slots = WeightSlots(target)
    # every parameter starts on an ALIGN boundary of its dtype's one flat buffer, in order
    (flat,) = slots._flat.values()
    starts = [p.data_ptr() - flat.data_ptr() for p in target.parameters()]
    assert all(s % ALIGN == 0 for s in starts) and starts == sorted(starts)
    pairs, num_buckets = _received(source, max_bytes)
    assert (num_buckets == 1) == (max_bytes == 1 << 30)
    runs = slots._runs(pairs)
    assert len(runs) == num_buckets and all(run.src is not None for run in runs)
    slots.load(pairs)
    assert _equal(target, source)


def test_other_orders_and_casts_fall_back_with_the_same_result():
    target, source = _model(0), _model(2)
    slots = WeightSlots(target)
    count = len(source.state_dict())
    pairs, _ = _received(source, 1 << 30, order=list(reversed(range(count))))
    assert len(slots._runs(pairs)) == count  # nothing adjacent in the same direction: one copy per tensor
    slots.load(pairs)
    assert _equal(target, source)
    doubled = [(name, t.double()) for name, t in _received(_model(3), 1 << 30)[0]]
    assert all(run.src is None for run in slots._runs(doubled))  # a cast: param.copy_ per tensor
    slots.load(doubled)
    assert _equal(target, _model(3))


def test_a_moved_model_is_laid_out_again():
    target, source = _model(0), _model(4)
    slots = WeightSlots(target)
    for p in target.parameters():  # what model.to(other device) does: new storage per parameter
        p.data = p.data.clone()
    assert not slots._in_place()
    pairs, num_buckets = _received(source, 1 << 30)
    slots.load(pairs)
    assert slots._in_place() and _equal(target, source) and len(slots._runs(pairs)) == num_buckets


def test_discard_and_refill_track_each_slot():
    target, source = _model(0), _model(5)
    slots = WeightSlots(target)
    total = slots.nbytes
    slots.discard()
    assert slots._flat == {} and all(p.numel() == 0 for p in target.parameters()) and slots.nbytes == total
    pairs, _ = _received(source, 1 << 30)
    slots.load(pairs[:3])
    assert len(slots.missing) == len(pairs) - 3 and slots.discarded  # storage back, the rest still missing
    slots.load(pairs[3:])
    assert not slots.missing and not slots.discarded and slots._in_place() and _equal(target, source)
