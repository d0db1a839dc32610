"""Named weight slots of an in-process torch model: load named tensors by HF name, discard and refill.

Layout: the parameters are moved into one flat byte buffer per (dtype, device), in `named_parameters` order,
each starting at a multiple of `buckets.ALIGN`: the layout `make_buckets` gives a sender's buffers. So the
tensors of a received bucket that are consecutive in it are consecutive here too, with the same padding, and
`load` copies each such run with one byte copy (a bucket of the same model in the same order: one copy per
bucket, the speed of a raw memory copy) instead of one `copy_` per tensor. Anything else (another order, a
dtype cast, non-contiguous tensors) falls back to a `param.copy_` per tensor; the result is the same.

`load` checks every name and shape before copying anything, so a bad update leaves the model untouched.
Tied weights (e.g. `lm_head.weight` and `model.embed_tokens.weight`) are one slot under several names.
`discard` frees the parameters' storage (sleep level 2) and keeps each slot's shape, dtype and place in the
layout; `load` gives the buffer back (uninitialized) at the first tensor of its dtype that arrives, and a slot
counts as missing until its own tensor has been loaded. A model moved after construction (`model.to`, as an
engine offloading its weights while asleep does) is laid out again, with one copy, at the next `load`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from yatt_rollout.buckets import ALIGN


class _Place(NamedTuple):
    group: tuple[torch.dtype, torch.device]  # which flat buffer
    start: int  # byte offset in it (a multiple of ALIGN)
    nbytes: int


class WeightSlots:
    """The parameters of `model`, addressable by any of their names, held in flat per-dtype buffers."""

    def __init__(self, model: Any) -> None:
        self.params: dict[str, torch.nn.Parameter] = dict(model.named_parameters(remove_duplicate=False))
        self._canonical: dict[str, str] = {}  # any name -> the first name of its parameter
        first: dict[int, str] = {}
        for name, param in self.params.items():
            self._canonical[name] = first.setdefault(id(param), name)
        self._shapes = {name: (tuple(p.shape), p.dtype, p.device) for name, p in self.params.items()}
        self.missing: set[str] = set()  # canonical names whose storage was discarded and not yet loaded
        self.discarded = False
        self._places, self._sizes = self._plan()
        self._flat: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._flatten(copy=True)

    @property
    def nbytes(self) -> int:
        """Bytes of the model's distinct parameters at their full shapes (whether or not held now)."""
        return sum(place.nbytes for place in self._places.values())

    def _plan(self) -> tuple[dict[str, _Place], dict[tuple, int]]:
        """Each distinct parameter's place in its (dtype, device) buffer, and each buffer's size in bytes."""
        places: dict[str, _Place] = {}
        sizes: dict[tuple, int] = {}
        for name, canonical in self._canonical.items():
            if name != canonical:
                continue
            shape, dtype, device = self._shapes[name]
            group, nbytes = (dtype, device), torch.Size(shape).numel() * dtype.itemsize
            start = sizes.get(group, 0)
            places[name] = _Place(group, start, nbytes)
            sizes[group] = start + -(-nbytes // ALIGN) * ALIGN
        return places, sizes

    def _flatten(self, *, copy: bool, only: tuple | None = None) -> None:
        """Allocate the flat buffers (of group `only`, or all) and point the parameters at views into them,
        copying the current values when `copy` (at construction; after a discard there are none)."""
        for group, size in self._sizes.items():
            if only is not None and group != only:
                continue
            flat = torch.zeros(size, dtype=torch.uint8, device=group[1])
            for name, place in self._places.items():
                if place.group != group:
                    continue
                param, shape = self.params[name], self._shapes[name][0]
                view = flat[place.start : place.start + place.nbytes].view(group[0]).view(shape)
                if copy:
                    view.copy_(param.detach())
                param.data = view
            self._flat[group] = flat

    def load(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Copy each (name, tensor) into its parameter (casting dtype). ValueError, before any copy, for an
        unknown name or a wrong shape."""
        for name, tensor in named:
            known = self._shapes.get(name)
            if known is None:
                raise ValueError(
                    f"update_weights: unknown tensor name {name!r} (not a parameter of the model)"
                )
            if tuple(tensor.shape) != known[0]:
                raise ValueError(
                    f"update_weights: tensor {name!r} has shape {list(tensor.shape)}, the model's is {list(known[0])}"
                )
        with torch.no_grad():
            if self.missing:
                for name, _ in named:
                    self._refill(name)
            elif not self._in_place():
                self._relayout()
            for run in self._runs(named):
                run.copy()

    def _runs(self, named: Sequence[tuple[str, torch.Tensor]]) -> list[_Run]:
        """The copies `load` makes: runs of tensors consecutive (up to alignment padding) both in their
        source buffer and in the flat buffer, one byte copy each; a tensor that cannot join a run (dtype cast,
        not contiguous) is a run of its own copied by `param.copy_`."""
        runs: list[_Run] = []
        for name, tensor in named:
            place = self._places[self._canonical[name]]
            if tensor.dtype != place.group[0] or not tensor.is_contiguous():
                runs.append(_Run(self.params[name], tensor))
                continue
            src = (tensor.untyped_storage(), tensor.storage_offset() * tensor.element_size())
            if runs and runs[-1].extend(src, place):
                continue
            runs.append(_Run(self.params[name], tensor, src, place, self._flat[place.group]))
        return runs

    def _in_place(self) -> bool:
        """Whether every parameter is still its view of the flat buffers (a `model.to(...)`, as an engine
        does to offload weights while asleep, gives parameters new storage)."""
        for name, place in self._places.items():
            param, flat = self.params[name], self._flat.get(place.group)
            if flat is None or param.device != place.group[1]:
                return False
            if place.nbytes and param.data_ptr() != flat.data_ptr() + place.start:
                return False
        return True

    def _relayout(self) -> None:
        """Lay the parameters, wherever they are now, out in fresh flat buffers (one copy of every weight)."""
        self._shapes = {name: (tuple(p.shape), p.dtype, p.device) for name, p in self.params.items()}
        self._places, self._sizes = self._plan()
        self._flat.clear()
        self._flatten(copy=True)

    def _refill(self, name: str) -> None:
        """Give a discarded parameter storage again: its dtype's whole flat buffer (uninitialized: `load`
        fills it) on the first tensor of that dtype; the slot stops being missing once its own tensor comes."""
        canonical = self._canonical[name]
        if canonical in self.missing:
            group = self._places[canonical].group
            if group not in self._flat:
                self._flatten(copy=False, only=group)
            self.missing.discard(canonical)
            self.discarded = bool(self.missing)

    def discard(self) -> None:
        """Release every parameter's storage (the tensors become empty; shapes, dtypes and places are kept)."""
        for param in self.params.values():
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self._flat.clear()
        self.missing = set(self._canonical.values())
        self.discarded = True


class _Run:
    """One copy of `load`: a byte range of a source buffer into the same-length range of a flat buffer, or a
    single tensor copied by `param.copy_` (`src` None)."""

    def __init__(self, param, tensor, src=None, place: _Place | None = None, flat=None) -> None:
        self.param, self.tensor, self.flat = param, tensor, flat
        self.src = src  # (source storage, byte offset of the run's start)
        if src is not None:
            assert place is not None  # a byte run always has its place in the flat buffer
            self.dst_start, self.dst_end, self.src_end = (
                place.start,
                place.start + place.nbytes,
                src[1] + place.nbytes,
            )
            self.group = place.group

    def extend(self, src: tuple, place: _Place) -> bool:
        """Take the next tensor (source bytes at `src`, flat bytes at `place`) if it follows this run with the
        same gap (alignment padding, < ALIGN bytes) on both sides."""
        if self.src is None or place.group != self.group or src[0].data_ptr() != self.src[0].data_ptr():
            return False
        gap = place.start - self.dst_end
        if not 0 <= gap < ALIGN or src[1] - self.src_end != gap:
            return False
        self.dst_end, self.src_end = place.start + place.nbytes, src[1] + place.nbytes
        return True

    def copy(self) -> None:
        if self.src is None:
            self.param.copy_(self.tensor)
            return
        storage, start = self.src
        source = torch.empty(0, dtype=torch.uint8, device=self.tensor.device)
        source.set_(storage, start, (self.src_end - start,), (1,))
        self.flat[self.dst_start : self.dst_end].copy_(source)
