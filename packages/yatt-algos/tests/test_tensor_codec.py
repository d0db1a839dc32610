"""EncodedTensor round-trips numpy arrays and torch tensors, and decoding views the message without copying."""

import msgspec
import numpy as np
import pytest
import torch
from yatt_algos import tensor_codec
from yatt_algos.types import EncodedTensor


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int8,
        torch.uint8,
        torch.bool,
    ],
)
def test_torch_roundtrip_through_msgpack_is_zero_copy(dtype):
    src = (torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) - 7).to(dtype)
    buf = msgspec.msgpack.encode(tensor_codec.encode(src))
    enc = msgspec.msgpack.decode(buf, type=EncodedTensor)
    out = tensor_codec.decode_torch(enc)
    assert out.dtype == dtype and out.shape == (2, 3, 4)
    assert torch.equal(out, src)
    # zero copy: the tensor's storage lies inside the received message
    base = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    assert base <= out.data_ptr() < base + len(buf)


def test_numpy_roundtrip_is_zero_copy():
    src = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    buf = msgspec.msgpack.encode(tensor_codec.encode(src))
    enc = msgspec.msgpack.decode(buf, type=EncodedTensor)
    out = tensor_codec.decode_numpy(enc)
    np.testing.assert_array_equal(out, src)
    assert out.dtype == np.float32 and not out.flags.owndata
    assert np.shares_memory(out, np.frombuffer(buf, dtype=np.uint8))


def test_encode_views_the_source_memory():
    src = torch.ones(4, 5)
    enc = tensor_codec.encode(src)
    src[0, 0] = 9.0  # encode took a view, so the change shows through
    assert tensor_codec.decode_torch(enc)[0, 0].item() == 9.0


def test_non_contiguous_and_empty():
    src = torch.arange(12.0).reshape(3, 4).t()
    assert torch.equal(tensor_codec.decode_torch(tensor_codec.encode(src)), src)
    empty = torch.empty(0, 3)
    assert tensor_codec.decode_torch(tensor_codec.encode(empty)).shape == (0, 3)


def test_bad_messages_fail_clearly():
    with pytest.raises(ValueError, match="needs 16"):
        tensor_codec.decode_torch(EncodedTensor(dtype="float32", shape=[2, 2], data=memoryview(b"\0" * 12)))
    with pytest.raises(ValueError, match="dtype 'complex64'"):
        tensor_codec.decode_torch(EncodedTensor(dtype="complex64", shape=[1], data=memoryview(b"\0" * 8)))
    with pytest.raises(ValueError, match="bfloat16 has no numpy dtype"):
        tensor_codec.decode_numpy(tensor_codec.encode(torch.zeros(2, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="unsupported numpy dtype"):
        tensor_codec.encode(np.zeros(2, dtype=np.complex64))
