"""Input checks shared by the math modules: shapes and masks, each failing with a `ValueError` naming the
argument, so that a bad batch is reported where it enters rather than as a broadcasting error deep inside."""

from __future__ import annotations

import torch


def check_2d(name: str, tensor: torch.Tensor) -> None:
    """`tensor` must be [B, T]."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != 2:
        raise ValueError(f"{name} must be [B, T], got shape {tuple(tensor.shape)}")


def check_same_shape(reference: str, tensors: dict[str, torch.Tensor | None]) -> None:
    """Every non-None tensor has the shape of `tensors[reference]`, which must be [B, T]."""
    ref = tensors[reference]
    if ref is None:
        raise ValueError(f"{reference} is required")
    check_2d(reference, ref)
    shape = tuple(ref.shape)
    for name, tensor in tensors.items():
        if tensor is None or name == reference:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape} like {reference}")


def check_rows(name: str, tensor: torch.Tensor, num_rows: int) -> None:
    """`tensor` must be [B] with B = num_rows."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != (num_rows,):
        raise ValueError(f"{name} must have shape ({num_rows},), got {tuple(tensor.shape)}")


def as_bool_mask(name: str, mask: torch.Tensor) -> torch.Tensor:
    """A bool view of a 0/1 (bool, int or float) mask; other values are an error."""
    if mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"{name} must hold only 0 and 1")
    return mask != 0


def check_no_empty_rows(name: str, mask: torch.Tensor) -> None:
    """Every row of the bool mask [B, T] has a token; an all-masked row has no response to credit."""
    empty = (~mask.any(dim=-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"{name} rows {empty} are all masked (no response tokens)")
