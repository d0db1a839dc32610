"""Zero-copy conversion between `EncodedTensor` and numpy arrays or torch tensors.

Encoding views the tensor's memory (the tensor must stay alive while the message is written); decoding views
the message's buffer. numpy and torch are imported only when called, so `yatt_algos.types` stays light.
bfloat16 has no numpy dtype: it is carried as its raw bytes and decoded straight to torch.
"""

from __future__ import annotations

from typing import Any

from yatt_algos.types import EncodedTensor

# dtype name -> (numpy dtype string or None, bytes per element)
_DTYPES: dict[str, tuple[str | None, int]] = {
    "float64": ("<f8", 8),
    "float32": ("<f4", 4),
    "float16": ("<f2", 2),
    "bfloat16": (None, 2),
    "int64": ("<i8", 8),
    "int32": ("<i4", 4),
    "int16": ("<i2", 2),
    "int8": ("i1", 1),
    "uint8": ("u1", 1),
    "bool": ("?", 1),
}


def _check(enc: EncodedTensor) -> int:
    if enc.dtype not in _DTYPES:
        raise ValueError(f"EncodedTensor.dtype {enc.dtype!r} is not one of {sorted(_DTYPES)}")
    numel = 1
    for dim in enc.shape:
        if dim < 0:
            raise ValueError(f"EncodedTensor.shape has a negative dimension: {enc.shape}")
        numel *= dim
    nbytes = numel * _DTYPES[enc.dtype][1]
    if len(enc.data) != nbytes:
        raise ValueError(
            f"EncodedTensor.data has {len(enc.data)} bytes; dtype {enc.dtype} shape {enc.shape} needs {nbytes}"
        )
    return numel


def encode(tensor: Any) -> EncodedTensor:
    """Encode a numpy array or a CPU torch tensor (made contiguous if needed) without copying its bytes."""
    if hasattr(tensor, "detach"):  # a torch.Tensor; torch is already imported by whoever made it
        import torch

        t = tensor.detach()
        if t.device.type != "cpu":
            raise ValueError(f"encode needs a CPU tensor, got device {t.device}")
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported torch dtype {t.dtype}")
        raw = t.contiguous().reshape(-1).view(torch.uint8)  # bytes of the tensor, no copy if contiguous
        return EncodedTensor(dtype=dtype, shape=list(t.shape), data=memoryview(raw.numpy()))
    import numpy as np

    arr = np.ascontiguousarray(tensor)
    for name, (np_dtype, _) in _DTYPES.items():
        if np_dtype is not None and arr.dtype == np.dtype(np_dtype):
            return EncodedTensor(dtype=name, shape=list(arr.shape), data=arr.reshape(-1).view(np.uint8).data)
    raise ValueError(f"unsupported numpy dtype {arr.dtype}")


def decode_numpy(enc: EncodedTensor) -> Any:
    """View `enc.data` as a numpy array (read-only if the buffer is). bfloat16 cannot be a numpy array."""
    import numpy as np

    _check(enc)
    np_dtype = _DTYPES[enc.dtype][0]
    if np_dtype is None:
        raise ValueError("bfloat16 has no numpy dtype; use decode_torch")
    return np.frombuffer(enc.data, dtype=np_dtype).reshape(enc.shape)


def decode_torch(enc: EncodedTensor) -> Any:
    """View `enc.data` as a torch tensor without copying. A read-only buffer gives a tensor torch warns
    about writing to; clone it before writing."""
    import warnings

    import torch

    numel = _check(enc)
    dtype = getattr(torch, enc.dtype)
    if numel == 0:
        return torch.empty(enc.shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        flat = torch.frombuffer(enc.data, dtype=torch.uint8)
    return flat.view(dtype).view(enc.shape)
