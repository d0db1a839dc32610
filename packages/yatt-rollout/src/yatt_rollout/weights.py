"""Named weight slots of an in-process torch model: load named tensors by HF name, discard and refill.

`load` checks every name and shape before copying anything, so a bad update leaves the model untouched,
then copies each tensor straight into its parameter's storage (`param.copy_` under `no_grad`: one pass,
no intermediate tensor; a dtype cast happens inside that copy when the sender's dtype differs).
Tied weights (e.g. `lm_head.weight` and `model.embed_tokens.weight`) are one slot under several names.
`discard` frees the parameters' storage (sleep level 2) and keeps each slot's shape and dtype; `load` gives
a discarded slot storage of that shape again as its tensor arrives, so memory returns with the weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class WeightSlots:
    """The parameters of `model`, addressable by any of their names."""

    def __init__(self, model: Any) -> None:
        self.params: dict[str, torch.nn.Parameter] = dict(model.named_parameters(remove_duplicate=False))
        self._canonical: dict[str, str] = {}  # any name -> the first name of its parameter
        first: dict[int, str] = {}
        for name, param in self.params.items():
            self._canonical[name] = first.setdefault(id(param), name)
        self._shapes = {name: (tuple(p.shape), p.dtype, p.device) for name, p in self.params.items()}
        self.missing: set[str] = set()  # canonical names whose storage was discarded and not yet loaded
        self.discarded = False

    @property
    def nbytes(self) -> int:
        """Bytes of the model's distinct parameters at their full shapes (whether or not held now)."""
        total = 0
        for name, (shape, dtype, _) in self._shapes.items():
            if self._canonical[name] == name:
                total += torch.Size(shape).numel() * dtype.itemsize
        return total

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
            for name, tensor in named:
                param = self.params[name]
                if self.missing:
                    self._refill(name, param)
                param.copy_(tensor)

    def _refill(self, name: str, param: torch.nn.Parameter) -> None:
        """Give a discarded parameter storage of its own shape again (uninitialized: `load` fills it)."""
        canonical = self._canonical[name]
        if canonical in self.missing:
            shape, dtype, device = self._shapes[canonical]
            param.data = torch.empty(shape, dtype=dtype, device=device)
            self.missing.discard(canonical)
            self.discarded = bool(self.missing)

    def discard(self) -> None:
        """Release every parameter's storage (the tensors become empty; shapes and dtypes are kept here)."""
        for name, param in self.params.items():
            self._shapes[name] = (*self._shapes[name][:2], param.device)
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self.missing = set(self._canonical.values())
        self.discarded = True
