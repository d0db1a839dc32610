"""Weight sync, the torch side (extra `torch`): bucketing by dtype, a broadcast group, in-process copy.

Disaggregated (WeChat-YATT §weight sync; G-Core): the trainer's rank 0 and every engine worker form one
torch.distributed group (gloo on CPU, NCCL on GPU) apart from the trainer's own; the sender packs its tensors
into flat per-dtype buckets and broadcasts each. The group is built straight from a `TCPStore` and a backend
class, so it neither needs nor disturbs a process's default group. Colocated: the trainer and the engine share
a host process, and the engine loads the trainer's tensors directly (the paper uses CUDA IPC handles between
processes; one process makes that a plain hand-over). Departure: buckets default to 64 MB, not 512 MB.

Hosted classes take part through two methods: the sender's `named_weights() -> Iterable[(name, tensor)]`
and the receiver's `load_weights(named: list[(name, tensor)], version: int)`.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterable
from typing import Any

import ray
import torch
import torch.distributed as dist

from yatt_controller.types import BucketLayout

DEFAULT_TIMEOUT = datetime.timedelta(seconds=120)


def plan_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[BucketLayout]:
    """Group tensors by dtype (first-seen order), then fill buckets of at most `bucket_bytes` in order; a
    tensor larger than a bucket gets one of its own."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named:
        by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
    buckets: list[BucketLayout] = []
    for dtype, items in by_dtype.items():
        current: BucketLayout | None = None
        for name, tensor in items:
            size = tensor.numel() * tensor.element_size()
            if current is None or current.nbytes + size > bucket_bytes:
                current = BucketLayout(dtype=str(dtype).removeprefix("torch."), names=[], shapes=[], nbytes=0)
                buckets.append(current)
            current.names.append(name)
            current.shapes.append(list(tensor.shape))
            current.nbytes += size
    return buckets


def pack(tensors: dict[str, torch.Tensor], bucket: BucketLayout) -> torch.Tensor:
    """One flat uint8 buffer [nbytes] holding the bucket's tensors back to back."""
    parts = [tensors[name].detach().contiguous().reshape(-1).view(torch.uint8) for name in bucket.names]
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    assert flat.numel() == bucket.nbytes, "bucket layout does not match the tensors it was planned from"
    return flat


def unpack(flat: torch.Tensor, bucket: BucketLayout) -> list[tuple[str, torch.Tensor]]:
    """Views of `flat` [nbytes] as the bucket's named tensors (no copy)."""
    typed = flat.view(getattr(torch, bucket.dtype))
    out, start = [], 0
    for name, shape in zip(bucket.names, bucket.shapes, strict=True):
        numel = 1
        for dim in shape:
            numel *= dim
        out.append((name, typed[start : start + numel].view(shape)))
        start += numel
    return out


def store_host() -> str:
    """Where a weight-sync store listens: localhost while the Ray cluster is one node (no other machine can
    reach it), else this node's IP (never every interface)."""
    alive = [node for node in ray.nodes() if node.get("Alive")]
    return "127.0.0.1" if len(alive) <= 1 else ray.util.get_node_ip_address()


def listen_store(host: str, world_size: int | None = None, timeout: Any = DEFAULT_TIMEOUT) -> Any:
    """A master TCPStore listening on `host` only, on a port the OS picks. torch's own master binds every
    interface whatever host it is given, so the socket is bound here and handed over; no port is chosen by one
    process and bound by another. Also the learners' rendezvous store (yatt_apps.runtime.workers)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )


def open_store(groups: dict[str, Any], group: str) -> tuple[str, int]:
    """Start the rendezvous store of `group` in this process (the sender's); returns its address."""
    host = store_host()
    store = listen_store(host)
    groups[f"{group}/store"] = store
    return host, store.port


def join_group(
    groups: dict[str, Any], group: str, addr: str, port: int, rank: int, world: int, backend: str
) -> None:
    """Join `group` as `rank` of `world`; every member must call this concurrently (it blocks until all do).
    `backend="auto"`: NCCL where this process has CUDA, gloo otherwise (the driver that builds the sync cannot
    see the workers' devices)."""
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    store = groups.get(f"{group}/store") or dist.TCPStore(
        addr, port, is_master=False, timeout=DEFAULT_TIMEOUT
    )
    prefixed = dist.PrefixStore(group, store)
    if backend == "gloo":
        groups[group] = dist.ProcessGroupGloo(prefixed, rank, world, DEFAULT_TIMEOUT)
    else:
        # `options` left out: the binding defaults it (ProcessGroupNCCL::Options::create())
        groups[group] = dist.ProcessGroupNCCL(prefixed, rank, world)


def _device(pg: Any) -> torch.device:
    nccl = getattr(dist, "ProcessGroupNCCL", None)  # absent from CPU builds of torch
    return (
        torch.device("cuda", torch.cuda.current_device())
        if nccl and isinstance(pg, nccl)
        else torch.device("cpu")
    )


def send(pg: Any, named: Iterable[tuple[str, torch.Tensor]], buckets: list[BucketLayout]) -> int:
    """Broadcast every bucket from rank 0; returns the bytes sent."""
    tensors = dict(named)
    for bucket in buckets:
        flat = pack(tensors, bucket).to(_device(pg))
        pg.broadcast(flat, 0).wait()
    return sum(b.nbytes for b in buckets)


def receive(pg: Any, buckets: list[BucketLayout]) -> list[tuple[str, torch.Tensor]]:
    """Receive every bucket broadcast by rank 0, as named tensors."""
    named: list[tuple[str, torch.Tensor]] = []
    for bucket in buckets:
        flat = torch.empty(bucket.nbytes, dtype=torch.uint8, device=_device(pg))
        pg.broadcast(flat, 0).wait()
        named.extend(unpack(flat, bucket))
    return named


def copy_local(source: Any, target: Any, version: int) -> int:
    """Colocated sync: the target loads the source's tensors in the same process; returns the bytes."""
    named = [(name, tensor.detach()) for name, tensor in source.named_weights()]
    target.load_weights(named, version)
    return sum(t.numel() * t.element_size() for _, t in named)
