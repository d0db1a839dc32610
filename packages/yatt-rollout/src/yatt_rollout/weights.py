"""Named weight slots of an in-process torch model: load named tensors by HF name, discard and reallocate.

`load` checks every name and shape before copying anything, so a bad update leaves the model untouched.
Tied weights (e.g. `lm_head.weight` and `model.embed_tokens.weight`) are one slot under several names.
`discard` frees the parameters' storage (sleep level 2); `reallocate` gives them uninitialized storage again
and marks every slot missing until `load` refills it.
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
        self._shapes = {name: (tuple(p.shape), p.dtype) for name, p in self.params.items()}
        self.missing: set[str] = set()
        self.discarded = False

    def load(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Copy each (name, tensor) into its parameter (casting dtype). ValueError, before any copy, for an
        unknown name or a wrong shape."""
        for name, tensor in named:
            if name not in self.params:
                raise ValueError(
                    f"update_weights: unknown tensor name {name!r} (not a parameter of the model)"
                )
            shape = self._shapes[name][0]
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"update_weights: tensor {name!r} has shape {list(tensor.shape)}, the model's is {list(shape)}"
                )
        with torch.no_grad():
            for name, tensor in named:
                self.params[name].data.copy_(tensor)
                self.missing.discard(self._canonical[name])

    def discard(self) -> None:
        """Release every parameter's storage (the tensors become empty)."""
        for param in self.params.values():
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self.discarded = True

    def reallocate(self, device: torch.device) -> None:
        """Give every parameter uninitialized storage of its shape; all slots are missing until loaded."""
        for name, param in self.params.items():
            if self._canonical[name] == name:
                shape, dtype = self._shapes[name]
                param.data = torch.empty(shape, dtype=dtype, device=device)
        self.missing = set(self._canonical.values())
        self.discarded = False
