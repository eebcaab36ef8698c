"""Buckets: pad a call up to a captured size, run that size's graph, slice the outputs back.

Padding is only correct where the model ignores the padded positions, so the user declares it:
which arguments to pad, along which dimension, with which value, and along which dimension
outputs are cut back. `sequence_buckets` is the ready-made case of token sequences with an
attention mask: pad `input_ids` with a pad token and the mask with zeros (creating an all-ones mask
for the real tokens when the call has none), then cut outputs back along the sequence dimension.
Right padding with a zero mask leaves the real positions' outputs unchanged in HF models with
padding-aware attention; for causal decoders even without a mask.

A call longer than the largest bucket is not padded: it runs under its exact key (a graph of its
own while under the callable's limit, else eagerly).
"""

from __future__ import annotations

import bisect
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree


@dataclass(frozen=True)
class Pad:
    """How to pad one argument."""

    dim: int
    """The dimension that varies (the sequence dimension); padded at its end."""
    value: float = 0
    """The fill value of the padded positions (a pad token id, 0 for a mask)."""


@dataclass(frozen=True)
class PaddedCall:
    """A call padded up to a bucket, and how to cut its outputs back."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    length: int
    bucket: int
    output_dim: int | None

    def restore(self, outputs: Any) -> Any:
        """Slice every output tensor whose `output_dim` has the bucket's size back to the call's length."""
        if self.output_dim is None or self.length == self.bucket:
            return outputs
        dim = self.output_dim

        def cut(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.dim() > dim and tensor.shape[dim] == self.bucket:
                return tensor.narrow(dim, 0, self.length)
            return tensor

        return pytree.tree_map_only(torch.Tensor, cut, outputs)


@dataclass(frozen=True)
class Buckets:
    """Pad calls up to the smallest of `sizes` that holds them."""

    sizes: tuple[int, ...]
    """Captured lengths, ascending."""
    pads: tuple[tuple[str | int, Pad], ...]
    """`(argument, how)`: the argument by keyword name or position; names also match positional arguments
    of a callable whose signature names them."""
    output_dim: int | None = 1
    """Outputs are sliced back along this dimension (None: returned padded)."""
    make_mask: str | None = None
    """Keyword of an attention mask to create (ones over the real length) when the call passes none."""

    def __post_init__(self) -> None:
        sizes = tuple(self.sizes)
        if not sizes or any(size < 1 for size in sizes) or list(sizes) != sorted(set(sizes)):
            raise ValueError(f"bucket sizes must be distinct positive integers in ascending order, got {sizes}")
        if not self.pads:
            raise ValueError("Buckets needs at least one padded argument, e.g. pads=(('input_ids', Pad(dim=1)),)")
        object.__setattr__(self, "sizes", sizes)

    def bucket_for(self, length: int) -> int | None:
        """The smallest bucket >= `length`, or None if the call is longer than the largest."""
        index = bisect.bisect_left(self.sizes, length)
        return self.sizes[index] if index < len(self.sizes) else None

    def pad(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], positions: Mapping[str, int] | None = None
    ) -> PaddedCall | None:
        """The call padded to its bucket, or None when nothing is to be padded (no padded argument given,
        or longer than every bucket)."""
        positions = positions or {}
        found: list[tuple[str | int, Pad, torch.Tensor]] = []
        for name, how in self.pads:
            value = _lookup(name, args, kwargs, positions)
            if isinstance(value, torch.Tensor):
                found.append((name, how, value))
        if not found:
            return None
        lengths = {name: tensor.shape[how.dim] for name, how, tensor in found}
        length = next(iter(lengths.values()))
        if any(other != length for other in lengths.values()):
            raise ValueError(f"padded arguments disagree on the length to pad: {lengths}")
        bucket = self.bucket_for(length)
        if bucket is None:
            return None
        new_args = list(args)
        new_kwargs = dict(kwargs)
        if self.make_mask is not None and _lookup(self.make_mask, args, kwargs, positions) is None:
            _, how, reference = found[0]
            mask = torch.ones(reference.shape[: how.dim + 1], dtype=torch.long, device=reference.device)
            _store(self.make_mask, mask, new_args, new_kwargs, positions)
            found.append((self.make_mask, Pad(how.dim, 0), mask))
        for name, how, tensor in found:
            _store(name, _pad_to(tensor, how, bucket), new_args, new_kwargs, positions)
        return PaddedCall(tuple(new_args), new_kwargs, length, bucket, self.output_dim)


def _lookup(name: str | int, args: tuple[Any, ...], kwargs: Mapping[str, Any], positions: Mapping[str, int]) -> Any:
    if isinstance(name, int):
        return args[name] if name < len(args) else None
    if name in kwargs:
        return kwargs[name]
    index = positions.get(name)
    return args[index] if index is not None and index < len(args) else None


def _store(
    name: str | int, value: Any, args: list[Any], kwargs: dict[str, Any], positions: Mapping[str, int]
) -> None:
    if isinstance(name, int):
        args[name] = value
        return
    index = positions.get(name)
    if name not in kwargs and index is not None and index < len(args):
        args[index] = value
    else:
        kwargs[name] = value


def _pad_to(tensor: torch.Tensor, how: Pad, size: int) -> torch.Tensor:
    extra = size - tensor.shape[how.dim]
    if extra == 0:
        return tensor
    dim = how.dim % tensor.dim()
    widths = [0, 0] * (tensor.dim() - dim - 1) + [0, extra]
    return F.pad(tensor, widths, value=how.value)


def parameter_positions(fn: Callable[..., Any]) -> dict[str, int]:
    """Positions of the parameters of `fn` (an `nn.Module`'s forward) that can be passed positionally."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return {}
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return {p.name: i for i, p in enumerate(p for p in parameters if p.kind in positional)}


def sequence_buckets(
    sizes: tuple[int, ...] | list[int],
    *,
    pad_token_id: int = 0,
    input_name: str = "input_ids",
    mask_name: str = "attention_mask",
    seq_dim: int = 1,
    output_dim: int | None = 1,
) -> Buckets:
    """Buckets for token sequences with an attention mask (HF style): pad ids with `pad_token_id`, the mask
    with 0 (created as ones when the call has none), and cut outputs back along `output_dim`."""
    pads = ((input_name, Pad(seq_dim, pad_token_id)), (mask_name, Pad(seq_dim, 0)))
    return Buckets(tuple(sizes), pads, output_dim=output_dim, make_mask=mask_name)


def pow2_sizes(maximum: int, minimum: int = 1) -> tuple[int, ...]:
    """Powers of two from `minimum` up to the first >= `maximum`, e.g. (8, 16, 32, 64) for (64, 8)."""
    if minimum < 1 or maximum < minimum:
        raise ValueError(f"need 1 <= minimum <= maximum, got minimum={minimum}, maximum={maximum}")
    sizes = [minimum]
    while sizes[-1] < maximum:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)
