"""In-place weight loading for a vLLM model, at memory speed: record vLLM's own `load_weights` once, replay
plain copies after.

vLLM loads HF-named tensors through per-parameter weight loaders that fuse (q/k/v into `qkv_proj`, gate/up
into `gate_up_proj`), shard, transpose or pad; every one of them ends in `dst.copy_(view of the source)`.
The first update runs `model.load_weights` under a `torch` dispatch mode (`_CopyRecorder`) that sees each
`aten.copy_` whose destination lies in a parameter's storage and whose source lies in one of the update's
tensors, and keeps both as (offset, size, stride) relative to their base tensors. Later updates replay those
copies, `dst.copy_(src.as_strided(...))` per entry, with no loader, no Python per-element logic and no
intermediate tensors: the speed of a memory copy plus a few microseconds per tensor.

The plan is used only if the recording proves it complete (`WeightPlan.check`): every element of every
parameter is written by a recorded copy or a constant fill (vocabulary padding), no parameter changed its
storage, and no copy came from a tensor that was not one of the update's. Otherwise every update goes
through `load_weights` (correct, slower), and `WeightPlan.problem` says why.

CPU linears: vLLM's CPU backend packs linear (and lm_head) weights into oneDNN / sgl-kernel layouts after
loading and drops or bypasses the plain tensor, so a copy into the plain parameter would not reach the matmul.
`plain_linears` gives each such layer its plain weight back (the layer's own `create_weights`) and computes
with `F.linear` on it: the layout a GPU run uses. Its cost is the CPU decode speed lost to oneDNN's packing
(measured in bench_rollout). Engines that keep packing load through vLLM's `reload_weights` instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

Pairs = Sequence[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class _Copy:
    """One recorded copy: elements of source tensor `name` at (offset, size, stride) relative to that tensor
    -> `dst`, a view of a parameter (made once, at recording)."""

    name: str
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dst: torch.Tensor


@dataclass
class WeightPlan:
    """The copies each update tensor makes, by name; `problem` is "" when the plan covers every parameter."""

    copies: dict[str, list[_Copy]] = field(default_factory=dict)
    fills: list[tuple[torch.Tensor, float]] = field(default_factory=list)  # constant regions (vocab padding)
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    problem: str = "not recorded yet"

    @property
    def complete(self) -> bool:
        return not self.problem

    def covers(self, pairs: Pairs) -> bool:
        """Whether every tensor of `pairs` was seen at recording with the same shape and dtype."""
        return all(self.shapes.get(name) == (tuple(t.shape), t.dtype) for name, t in pairs)

    def replay(self, pairs: Pairs) -> int:
        """Copy each tensor where vLLM's loader put it; returns the number of bytes written.

        One `copy_` per recorded copy (measured: merging q/k/v into one byte copy gains nothing with HF's
        tensor order, where each weight is followed by its bias, so neighbours rarely meet)."""
        written = 0
        with torch.no_grad():
            for dst, value in self.fills:  # rewritten too, so an update leaves no byte of its own
                dst.fill_(value)
            for name, tensor in pairs:
                base = tensor.storage_offset()
                for c in self.copies[name]:
                    c.dst.copy_(tensor.as_strided(c.size, c.stride, base + c.offset))
                    written += c.dst.numel() * c.dst.element_size()
        return written


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) byte range of the storage a tensor's elements occupy."""
    start = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) if t.numel() else 0
    return int(start), int(start + extent * t.element_size())


class _CopyRecorder(TorchDispatchMode):
    """Records `aten.copy_` into parameters from the update's tensors; notes any other write to a parameter."""

    def __init__(self, params: dict[str, torch.Tensor], sources: Pairs) -> None:
        super().__init__()
        self.params = params
        self.sources = [(name, t, _span(t)) for name, t in sources]
        # (source name, source view, parameter name, destination view)
        self.copies: list[tuple[str, torch.Tensor, str, torch.Tensor]] = []
        self.fills: list[tuple[str, torch.Tensor, float]] = []
        self.unknown: list[str] = []

    def _param_of(self, t: Any) -> str | None:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return None
        ptr = t.untyped_storage().data_ptr()
        for name, p in self.params.items():
            if p.untyped_storage().data_ptr() == ptr:
                return name
        return None

    def _source_of(self, t: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        lo, hi = _span(t)
        for name, src, (slo, shi) in self.sources:
            if slo <= lo and hi <= shi and src.dtype == t.dtype:
                return name, src
        return None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        if schema.arguments and schema.arguments[0].is_write and args:
            param = self._param_of(args[0])
            if param is not None:
                if func is torch.ops.aten.copy_.default and (src := self._source_of(args[1])):
                    self.copies.append((src[0], args[1], param, args[0]))
                elif func is torch.ops.aten.fill_.Scalar:
                    self.fills.append((param, args[0], float(args[1])))
                elif func is torch.ops.aten.zero_.default:
                    self.fills.append((param, args[0], 0.0))
                else:
                    self.unknown.append(f"{param} written by {func}")
        return func(*args, **kwargs)


def record(model: Any, pairs: Pairs) -> WeightPlan:
    """Run vLLM's `model.load_weights(pairs)` (the update happens) and return the plan of its copies."""
    params = {name: p.data for name, p in model.named_parameters()}
    before = {name: p.data_ptr() for name, p in params.items()}
    recorder = _CopyRecorder(params, pairs)
    with torch.no_grad(), recorder:
        model.load_weights(iter(pairs))
    plan = WeightPlan(shapes={name: (tuple(t.shape), t.dtype) for name, t in pairs})
    plan.copies = {name: [] for name, _ in pairs}
    by_name = dict(pairs)
    for name, view, _, dst in recorder.copies:
        src = by_name[name]
        rel = int(view.storage_offset() - src.storage_offset())
        plan.copies[name].append(_Copy(name, rel, tuple(view.shape), tuple(view.stride()), dst))
    plan.fills = [(dst, value) for _, dst, value in recorder.fills]
    plan.problem = _check(model, params, before, recorder)
    return plan


def _check(model: Any, params: dict[str, torch.Tensor], before: dict[str, int], rec: _CopyRecorder) -> str:
    """Why the recorded copies would not reproduce `load_weights` ("" if they would)."""
    if rec.unknown:
        return "a loader wrote a parameter other than by a copy of the update: " + "; ".join(rec.unknown[:3])
    now = dict(model.named_parameters())
    moved = [name for name, ptr in before.items() if now[name].data_ptr() != ptr]
    if moved:
        return f"load_weights replaced the storage of {moved[:3]}"
    for name, p in params.items():
        if not p.is_contiguous():
            return f"parameter {name!r} is not contiguous"
        mask = torch.zeros(p.shape, dtype=torch.bool)
        base = p.storage_offset()
        for _, _, param, dst in rec.copies:
            if param == name:
                mask.as_strided(dst.shape, dst.stride(), dst.storage_offset() - base).fill_(True)
        for param, dst, _ in rec.fills:
            if param == name:
                mask.as_strided(dst.shape, dst.stride(), dst.storage_offset() - base).fill_(True)
        if not bool(mask.all()):
            missing = int((~mask).sum())
            return f"parameter {name!r}: {missing} of {p.numel()} elements not written by the update"
    return ""


def plain_linears(model: Any) -> int:
    """Give every CPU linear / lm_head whose weight vLLM packed its plain weight back, computed by `F.linear`;
    returns how many layers changed. Their values are undefined until the next full `load_weights`."""
    import torch.nn.functional as F
    from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED, LinearBase

    changed = 0
    for module in model.modules():
        if not hasattr(module, "cpu_linear") or module.cpu_linear is F.linear:
            continue
        weight = getattr(module, "weight", None)
        if isinstance(module, LinearBase) and (weight is None or weight.numel() == 0):
            method = module.quant_method
            if type(method).__name__ != "UnquantizedLinearMethod":
                raise ValueError(
                    f"in-place weight updates need unquantized linears; {type(module).__name__} uses "
                    f"{type(method).__name__}"
                )
            v2 = type(method).__name__ in WEIGHT_LOADER_V2_SUPPORTED and hasattr(module, "weight_loader_v2")
            method.create_weights(
                module,
                # a ReplicatedLinear (an MoE router's GateLinear) keeps no partition size: it is the whole input
                getattr(module, "input_size_per_partition", module.input_size),
                module.output_partition_sizes,
                module.input_size,
                module.output_size,
                module.params_dtype,
                weight_loader=module.weight_loader_v2 if v2 else module.weight_loader,
            )
        bias = getattr(module, "bias", None)
        dtype = getattr(module, "params_dtype", None)
        if isinstance(bias, torch.Tensor) and dtype is not None and bias.dtype != dtype:
            bias.data = bias.data.to(dtype)  # sgl-kernel's packing keeps the bias in float32
        module.cpu_linear = F.linear  # called as cpu_linear(x, weight, bias): reads the live parameter
        changed += 1
    return changed


def tensors_of(headers: Iterable[dict], buffer: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into `buffer` (a shared-memory segment) from msgpack headers, each one
    `{"dtype", "start", "names", "shapes", "offsets"}`: a bucket laid at byte `start` of the segment."""
    import warnings

    flat_all: torch.Tensor
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        flat_all = torch.frombuffer(buffer, dtype=torch.uint8)
    out = []
    for h in headers:
        dtype = getattr(torch, h["dtype"])
        for name, shape, offset in zip(h["names"], h["shapes"], h["offsets"], strict=True):
            numel = 1
            for d in shape:
                numel *= d
            start = h["start"] + offset
            view = flat_all[start : start + numel * dtype.itemsize].view(dtype).view(shape)
            out.append((name, view))
    return out
