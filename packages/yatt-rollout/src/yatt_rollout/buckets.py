"""Weight buckets: named tensors packed by dtype into flat buffers of at most N bytes, and their zero-copy
encoding for crossing processes.

`make_buckets` is the one copy on the sending side (tensors -> flat CPU buffers, like verl's and slime's
bucketed weight sync); `bucket_tensors` views a bucket's buffer as named tensors without copying.
`encode_frames` turns a bucket into two frames, a small msgpack header and the data buffer itself, so a
sender can `socket.sendmsg` / `writev` them or lay them in shared memory without joining them into one
message; `decode_frames` views a received buffer as a `WeightBucket` without copying the data.

Frame layout: `b"YWB1"`, header length (u32), data length (u64), both little-endian, the msgpack
`WeightBucket` with empty `data`, zero padding to a multiple of `ALIGN`, then the data. Frames of several
buckets may be concatenated (`decode_all`). torch is imported only by the tensor functions.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

import msgspec

from yatt_rollout.types import WeightBucket

ALIGN = 64  # every tensor starts at a multiple of 64 bytes: cache-line and SIMD friendly, any dtype aligned
MAGIC = b"YWB1"
DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
_PREFIX = struct.Struct("<4sIQ")  # magic, header bytes, data bytes


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _numel(shape: list[int]) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel


def check_bucket(bucket: WeightBucket) -> None:
    """Raise ValueError, naming the field, if the bucket's layout does not describe its buffer."""
    if bucket.dtype not in DTYPE_BYTES:
        raise ValueError(f"WeightBucket.dtype {bucket.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    if not len(bucket.names) == len(bucket.shapes) == len(bucket.offsets):
        raise ValueError(
            f"WeightBucket.names, shapes and offsets must have one entry per tensor, got "
            f"{len(bucket.names)}, {len(bucket.shapes)} and {len(bucket.offsets)}"
        )
    size = DTYPE_BYTES[bucket.dtype]
    for name, shape, offset in zip(bucket.names, bucket.shapes, bucket.offsets, strict=True):
        if any(d < 0 for d in shape):
            raise ValueError(f"WeightBucket.shapes has a negative dimension for {name!r}: {shape}")
        end = offset + _numel(shape) * size
        if offset < 0 or offset % size or end > len(bucket.data):
            raise ValueError(
                f"WeightBucket.offsets: {name!r} at byte {offset} ({_numel(shape) * size} bytes) does not fit "
                f"an aligned slot of the {len(bucket.data)}-byte data"
            )


def make_buckets(
    named_tensors: Iterable[tuple[str, Any]], *, max_bytes: int, version: int = 0
) -> list[WeightBucket]:
    """Pack (name, tensor) pairs into buckets of one dtype and at most `max_bytes` each (a tensor larger than
    `max_bytes` gets a bucket of its own). Tensors may live on any device; buffers are on the CPU.
    Order is kept within a dtype; buckets of different dtypes are emitted in order of first appearance."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    groups: dict[str, list[list[tuple[str, Any]]]] = {}
    fill: dict[str, int] = {}
    for name, tensor in named_tensors:
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"make_buckets: tensor {name!r} has unsupported dtype {tensor.dtype}")
        nbytes = _aligned(tensor.numel() * DTYPE_BYTES[dtype])
        chunks = groups.setdefault(dtype, [[]])
        if chunks[-1] and fill[dtype] + nbytes > max_bytes:
            chunks.append([])
            fill[dtype] = 0
        chunks[-1].append((name, tensor))
        fill[dtype] = fill.get(dtype, 0) + nbytes
    return [_pack(chunk, dtype, version) for dtype, chunks in groups.items() for chunk in chunks]


def _pack(chunk: list[tuple[str, Any]], dtype: str, version: int) -> WeightBucket:
    import torch

    offsets, total = [], 0
    for _, tensor in chunk:
        offsets.append(total)
        total += _aligned(tensor.numel() * DTYPE_BYTES[dtype])
    buffer = torch.zeros(total, dtype=torch.uint8)
    for (_, tensor), offset in zip(chunk, offsets, strict=True):
        nbytes = tensor.numel() * DTYPE_BYTES[dtype]
        buffer[offset : offset + nbytes].view(tensor.dtype).copy_(tensor.detach().reshape(-1))
    return WeightBucket(
        names=[name for name, _ in chunk],
        shapes=[list(tensor.shape) for _, tensor in chunk],
        offsets=offsets,
        dtype=dtype,
        data=buffer.numpy().data,
        version=version,
    )


def bucket_tensors(bucket: WeightBucket) -> list[tuple[str, Any]]:
    """View the bucket's buffer as (name, tensor) pairs without copying. Tensors over a read-only buffer
    (a decoded message) must not be written to; engines only read them."""
    import warnings

    import torch

    check_bucket(bucket)
    dtype = getattr(torch, bucket.dtype)
    if len(bucket.data) == 0:
        return [
            (name, torch.empty(shape, dtype=dtype))
            for name, shape in zip(bucket.names, bucket.shapes, strict=True)
        ]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        flat = torch.frombuffer(bucket.data, dtype=torch.uint8)
    size = DTYPE_BYTES[bucket.dtype]
    out = []
    for name, shape, offset in zip(bucket.names, bucket.shapes, bucket.offsets, strict=True):
        nbytes = _numel(shape) * size
        out.append((name, flat[offset : offset + nbytes].view(dtype).view(shape)))
    return out


def encode_frames(bucket: WeightBucket) -> list[memoryview]:
    """[header, data]: the header is a few hundred bytes of msgpack; `data` is the bucket's own buffer (no
    copy). Their concatenation is what `decode_frames` reads."""
    check_bucket(bucket)
    header = msgspec.msgpack.encode(msgspec.structs.replace(bucket, data=memoryview(b"")))
    start = _aligned(_PREFIX.size + len(header))
    head = bytearray(start)
    _PREFIX.pack_into(head, 0, MAGIC, len(header), len(bucket.data))
    head[_PREFIX.size : _PREFIX.size + len(header)] = header
    return [memoryview(head), memoryview(bucket.data).cast("B")]


def decode_frames(buffer: Any) -> WeightBucket:
    """View a buffer holding one `encode_frames` output as a `WeightBucket` whose `data` points into it."""
    bucket, _ = _decode_one(memoryview(buffer).cast("B"))
    return bucket


def decode_all(buffer: Any) -> list[WeightBucket]:
    """View a buffer of back-to-back `encode_frames` outputs as buckets, without copying their data."""
    view, out = memoryview(buffer).cast("B"), []
    while len(view):
        bucket, end = _decode_one(view)
        out.append(bucket)
        view = view[end:]
    return out


def _decode_one(view: memoryview) -> tuple[WeightBucket, int]:
    if len(view) < _PREFIX.size or bytes(view[:4]) != MAGIC:
        raise ValueError("decode_frames: buffer does not start with a YWB1 weight-bucket frame")
    _, header_len, data_len = _PREFIX.unpack_from(view, 0)
    start = _aligned(_PREFIX.size + header_len)
    if start + data_len > len(view):
        raise ValueError(
            f"decode_frames: frame needs {start + data_len} bytes ({header_len} header, {data_len} data) "
            f"but the buffer has {len(view)}"
        )
    head = msgspec.msgpack.decode(view[_PREFIX.size : _PREFIX.size + header_len], type=WeightBucket)
    bucket = msgspec.structs.replace(head, data=view[start : start + data_len])
    check_bucket(bucket)
    return bucket, start + data_len
