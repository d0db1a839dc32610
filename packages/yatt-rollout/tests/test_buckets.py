"""Weight buckets: packing by dtype and size, zero-copy views, and the frame encoding across a process."""

import hashlib
import socket
import subprocess
import sys

import msgspec
import pytest

torch = pytest.importorskip("torch")

from yatt_rollout.buckets import (  # noqa: E402
    bucket_tensors,
    check_bucket,
    decode_all,
    decode_frames,
    encode_frames,
    make_buckets,
)
from yatt_rollout.types import WeightBucket  # noqa: E402


def _named():
    torch.manual_seed(0)
    return [
        ("a", torch.randn(3, 5)),  # 60 bytes -> slot of 64
        ("b", torch.randn(10).to(torch.bfloat16)),  # 20 bytes -> 64
        ("c", torch.randn(40)),  # 160 bytes -> 192
        ("d", torch.arange(6, dtype=torch.int64).reshape(2, 3)),  # 48 bytes -> 64
        ("e", torch.randn(2)),  # 8 bytes -> 64
    ]


def test_buckets_group_by_dtype_and_respect_max_bytes():
    buckets = make_buckets(_named(), max_bytes=256, version=4)
    # float32: a (64) + c (192) = 256 fits; e would make 320 > 256, so it opens a second float32 bucket
    assert [(b.dtype, b.names, b.offsets, len(b.data)) for b in buckets] == [
        ("float32", ["a", "c"], [0, 64], 256),
        ("float32", ["e"], [0], 64),
        ("bfloat16", ["b"], [0], 64),
        ("int64", ["d"], [0], 64),
    ]
    assert all(b.version == 4 for b in buckets)


def test_oversized_tensor_gets_its_own_bucket():
    buckets = make_buckets([("x", torch.zeros(100)), ("y", torch.zeros(1))], max_bytes=64)
    assert [b.names for b in buckets] == [["x"], ["y"]]


def test_bucket_tensors_round_trip_exactly_and_view_the_buffer():
    named = _named()
    buckets = make_buckets(named, max_bytes=1 << 20)
    got = dict(pair for b in buckets for pair in bucket_tensors(b))
    for name, tensor in named:
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor)
    # a view, not a copy: writing the bucket's buffer changes the tensor
    bucket = buckets[0]
    view = dict(bucket_tensors(bucket))["a"]
    bucket.data[0:4] = memoryview(torch.tensor([7.5]).numpy().view("uint8")).cast("B")
    assert view[0, 0].item() == 7.5


def test_frames_decode_without_copy_and_concatenate():
    buckets = make_buckets(_named(), max_bytes=256)
    frames = [encode_frames(b) for b in buckets]
    assert all(
        f[1].obj is b.data.obj for f, b in zip(frames, buckets, strict=True)
    )  # data frame = the buffer
    wire = b"".join(bytes(part) for f in frames for part in f)
    decoded = decode_all(wire)
    assert [d.names for d in decoded] == [b.names for b in buckets]
    assert all(d.data.obj is wire for d in decoded)  # views into the received bytes
    assert all(bytes(d.data) == bytes(b.data) for d, b in zip(decoded, buckets, strict=True))
    one = decode_frames(b"".join(bytes(p) for p in frames[0]))
    assert one.offsets == [0, 64] and one.version == 0


_CHILD = """
import hashlib, socket, sys
from yatt_rollout.buckets import decode_all
sock = socket.socket(fileno=int(sys.argv[1]))
size = int(sys.argv[2])
buf = bytearray(size)
view, got = memoryview(buf), 0
while got < size:
    got += sock.recv_into(view[got:], size - got)
buckets = decode_all(buf)
assert all(b.data.obj is buf for b in buckets)  # views into the received buffer: no copy
assert "torch" not in sys.modules  # decoding needs msgspec only
names = [n for b in buckets for n in b.names]
print(",".join(names), hashlib.sha256(b"".join(bytes(b.data) for b in buckets)).hexdigest())
"""


def test_frames_cross_a_process_boundary():
    buckets = make_buckets(_named(), max_bytes=256)
    frames = [part for b in buckets for part in encode_frames(b)]
    size = sum(len(f) for f in frames)
    parent, child = socket.socketpair()
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(child.fileno()), str(size)],
        pass_fds=[child.fileno()],
        stdout=subprocess.PIPE,
        text=True,
    )
    child.close()
    parent.sendmsg(frames)  # scatter-gather: the data frames are sent from the buckets' own buffers
    out, _ = proc.communicate(timeout=120)
    parent.close()
    assert proc.returncode == 0
    expected = hashlib.sha256(b"".join(bytes(b.data) for b in buckets)).hexdigest()
    assert out.split() == ["a,c,e,b,d", expected]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dtype": "complex64"}, "WeightBucket.dtype 'complex64' is not one of"),
        ({"offsets": []}, "must have one entry per tensor, got 1, 1 and 0"),
        ({"shapes": [[20]]}, r"'w' at byte 0 \(80 bytes\) does not fit"),
        ({"offsets": [2]}, r"'w' at byte 2 \(16 bytes\) does not fit"),
    ],
)
def test_bad_bucket_layout_is_named(fields, message):
    base = {
        "names": ["w"],
        "shapes": [[4]],
        "offsets": [0],
        "dtype": "float32",
        "data": memoryview(bytes(64)),
    }
    with pytest.raises(ValueError, match=message):
        check_bucket(WeightBucket(**{**base, **fields}))


def test_decode_rejects_a_truncated_frame():
    head, data = encode_frames(make_buckets([("x", torch.ones(16))], max_bytes=1024)[0])
    # 16-byte prefix + 51-byte header = 67, padded to 128; then 64 bytes of data
    with pytest.raises(
        ValueError, match=r"frame needs 192 bytes \(51 header, 64 data\) but the buffer has 138"
    ):
        decode_frames(bytes(head) + bytes(data)[:10])
    with pytest.raises(ValueError, match="does not start with a YWB1"):
        decode_frames(b"nope" + bytes(60))


def test_msgpack_bucket_still_decodes_zero_copy():
    bucket = make_buckets([("x", torch.ones(4))], max_bytes=1024)[0]
    wire = msgspec.msgpack.encode(bucket)
    back = msgspec.msgpack.decode(wire, type=WeightBucket)
    assert back.data.obj is wire and torch.equal(dict(bucket_tensors(back))["x"], torch.ones(4))
