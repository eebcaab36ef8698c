"""Buckets: pad a call up to a captured size, run that size's graph, cut the outputs back.

Padding is only correct where the model ignores the padded positions, so the user declares it: which
arguments to pad, along which dimension, and with which value. `sequence_buckets` is the ready-made case of
token sequences with an attention mask: pad `input_ids` with a pad token and the mask with zeros (creating an
all-ones mask for the real tokens when the call has none). Right padding with a zero mask leaves the real
positions' outputs unchanged in HF models with padding-aware attention; for causal decoders even without a mask.

Which outputs to cut back is traced, never guessed from sizes: when a bucket's graph is captured, the call is
also run eagerly at a second length (`probe_length`, half the bucket), and an output dimension follows the padded
length where it has the bucket's size in the captured call and the probe's size in the probe (`follow_length`).
Calls served by that graph narrow exactly those dimensions to their own length (`cut_back`), so a dimension that
merely equals the bucket's size (a hidden size of 128 under a 128 bucket) is left whole. Outputs whose structure,
or any dimension, changes with the length other than one to one (a strided convolution's frames) cannot be cut
back: such a bucket runs eagerly (`Fallback.PADDED_OUTPUTS`) instead of returning padded results.

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

from tendril.utils.checks import is_integer


@dataclass(frozen=True)
class Pad:
    """How to pad one argument."""

    dim: int
    """The dimension that varies (the sequence dimension); padded at its end."""
    value: float = 0
    """The fill value of the padded positions (a pad token id, 0 for a mask)."""
    rank: int | None = None
    """The argument's number of dimensions when it is to be padded (None: any); a call whose argument has another
    rank is not padded (it runs under its exact key), since `dim` would name another dimension there."""

    def __post_init__(self) -> None:
        if not is_integer(self.dim):
            raise ValueError(f"Pad.dim must be an integer (a dimension), got {self.dim!r}")
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)):
            raise ValueError(f"Pad.value must be a number (the fill value), got {self.value!r}")
        if self.rank is not None and (not is_integer(self.rank) or not -self.rank <= self.dim < self.rank):
            raise ValueError(f"Pad.rank must be None or an integer that has dimension {self.dim!r}, got {self.rank!r}")


@dataclass(frozen=True)
class PaddedCall:
    """A call padded up to a bucket: the padded arguments, the call's own length and the bucket's."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    length: int
    bucket: int


@dataclass(frozen=True)
class Buckets:
    """Pad calls up to the smallest of `sizes` that holds them."""

    sizes: tuple[int, ...]
    """Captured lengths, ascending."""
    pads: tuple[tuple[str | int, Pad], ...]
    """`(argument, how)`: the argument by keyword name or position; names also match positional arguments
    of a callable whose signature names them."""
    cut_outputs: bool = True
    """Cut outputs back to the call's length along the dimensions traced to follow it (False: return them padded)."""
    make_mask: str | None = None
    """Keyword of an attention mask to create (ones over the real length) when the call passes none."""

    def __post_init__(self) -> None:
        sizes = tuple(self.sizes)
        if not sizes or not all(map(is_integer, sizes)) or any(size < 1 for size in sizes) or (
            list(sizes) != sorted(set(sizes))
        ):
            raise ValueError(f"bucket sizes must be distinct positive integers in ascending order, got {sizes}")
        pads = tuple(self.pads)
        if not pads:
            raise ValueError("Buckets needs at least one padded argument, e.g. pads=(('input_ids', Pad(dim=1)),)")
        for entry in pads:
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], (str, int))
                    and isinstance(entry[1], Pad)):
                raise ValueError(f"each pad is (argument name or position, Pad(...)), got {entry!r}")
        object.__setattr__(self, "sizes", tuple(map(int, sizes)))
        object.__setattr__(self, "pads", pads)

    def bucket_for(self, length: int) -> int | None:
        """The smallest bucket >= `length`, or None if the call is longer than the largest."""
        index = bisect.bisect_left(self.sizes, length)
        return self.sizes[index] if index < len(self.sizes) else None

    def pad(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], positions: Mapping[str, int] | None = None
    ) -> PaddedCall | None:
        """The call padded to its bucket, or None when nothing is to be padded: no padded argument given, one
        of another rank than declared, an empty call, or one longer than every bucket."""
        positions = positions or {}
        found: list[tuple[str | int, Pad, torch.Tensor]] = []
        for name, how in self.pads:
            value = _lookup(name, args, kwargs, positions)
            if isinstance(value, torch.Tensor):
                found.append((name, how, value))
        if not found or any(how.rank is not None and tensor.dim() != how.rank for _, how, tensor in found):
            return None
        lengths = {name: tensor.shape[how.dim] for name, how, tensor in found}
        length = next(iter(lengths.values()))
        if any(other != length for other in lengths.values()):
            raise ValueError(f"padded arguments disagree on the length to pad: {lengths}")
        bucket = self.bucket_for(length)
        if bucket is None or length == 0:
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
        return PaddedCall(tuple(new_args), new_kwargs, length, bucket)

    def resize(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], positions: Mapping[str, int], length: int
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A padded call with each padded argument (and the created mask) cut or padded to `length`: the same
        call at another length, whose outputs tell which output dimensions follow the padded one."""
        new_args, new_kwargs = list(args), dict(kwargs)
        resized = list(self.pads)
        if self.make_mask is not None:
            resized.append((self.make_mask, Pad(self.pads[0][1].dim, 0)))
        for name, how in resized:
            value = _lookup(name, args, kwargs, positions)
            if isinstance(value, torch.Tensor):
                _store(name, _resize(value, how, length), new_args, new_kwargs, positions)
        return tuple(new_args), new_kwargs


@dataclass
class Probe:
    """A padded call run again at a second length (`probe_call`)."""

    length: int
    outputs: Any


def probe_call(fn: Callable[..., Any], buckets: Buckets | None, positions: Mapping[str, int],
               padded: PaddedCall | None) -> Probe | str | None:
    """`fn` run eagerly (without grad) at the second length of a padded call's bucket, to trace which outputs follow
    the padded length (`follow_length`); None where outputs are not cut back; a string saying why it failed."""
    if padded is None or buckets is None or not buckets.cut_outputs:
        return None
    length = probe_length(padded.bucket)
    args, kwargs = buckets.resize(padded.args, padded.kwargs, positions, length)
    try:
        with torch.no_grad():
            outputs = fn(*args, **kwargs)
    except Exception as error:
        return f"bucket {padded.bucket}: the call at length {length}, run to trace its outputs, raised {error!r}"
    return Probe(length, outputs)


def probe_length(bucket: int) -> int:
    """The second length a bucket's call runs at to trace which outputs follow the padded length: half the
    bucket, far from it, so that a dimension divided by a stride changes too and is seen not to follow one to one."""
    return bucket // 2 if bucket > 1 else 2


def follow_length(outputs: Any, probe: Any, bucket: int, probe_at: int) -> tuple[tuple[int, ...], ...] | str:
    """For each tensor leaf of `outputs` (the call at `bucket`), the dimensions that follow the padded length:
    sized `bucket` there and `probe_at` in the same leaf of `probe` (the call at `probe_at`). A string says why
    the outputs cannot be cut back: their structure or rank changes with the length, or a dimension changes but
    not one to one."""
    leaves, spec = pytree.tree_flatten(outputs)
    probe_leaves, probe_spec = pytree.tree_flatten(probe)
    if spec != probe_spec:
        return f"the outputs' structure changes with the length ({spec} at {bucket}, {probe_spec} at {probe_at})"
    axes: list[tuple[int, ...]] = []
    for index, (leaf, other) in enumerate(zip(leaves, probe_leaves, strict=True)):
        if not isinstance(leaf, torch.Tensor):
            continue
        if not isinstance(other, torch.Tensor) or leaf.dim() != other.dim():
            return f"output {index} changes rank with the length"
        follows = []
        for dim, (size, probed) in enumerate(zip(leaf.shape, other.shape, strict=True)):
            if size == probed:
                continue
            if (size, probed) != (bucket, probe_at):
                return (
                    f"output {index} dimension {dim} is {size} at length {bucket} and {probed} at {probe_at}: "
                    "it does not follow the padded length one to one, so it cannot be cut back"
                )
            follows.append(dim)
        axes.append(tuple(follows))
    return tuple(axes)


def cut_back(outputs: Any, axes: tuple[tuple[int, ...], ...], length: int) -> Any:
    """`outputs` with every dimension that follows the padded length (`follow_length`) narrowed to `length`."""
    leaves, spec = pytree.tree_flatten(outputs)
    cuts = iter(axes)
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            for dim in next(cuts):
                leaf = leaf.narrow(dim, 0, length)
            leaves[index] = leaf
    return pytree.tree_unflatten(leaves, spec)


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


def _resize(tensor: torch.Tensor, how: Pad, size: int) -> torch.Tensor:
    if size <= tensor.shape[how.dim]:
        return tensor.narrow(how.dim, 0, size)
    return _pad_to(tensor, how, size)


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
    cut_outputs: bool = True,
) -> Buckets:
    """Buckets for token sequences with an attention mask (HF style, `[batch, length]`): pad ids with
    `pad_token_id`, the mask with 0 (created as ones when the call has none), and cut outputs back to the call's
    length."""
    pads = ((input_name, Pad(seq_dim, pad_token_id, rank=2)), (mask_name, Pad(seq_dim, 0, rank=2)))
    return Buckets(tuple(sizes), pads, cut_outputs=cut_outputs, make_mask=mask_name)


def pow2_sizes(maximum: int, minimum: int = 1) -> tuple[int, ...]:
    """Powers of two from `minimum` up to the first >= `maximum`, e.g. (8, 16, 32, 64) for (64, 8)."""
    if not (is_integer(minimum) and is_integer(maximum)) or minimum < 1 or maximum < minimum:
        raise ValueError(f"need integers 1 <= minimum <= maximum, got minimum={minimum!r}, maximum={maximum!r}")
    sizes = [minimum]
    while sizes[-1] < maximum:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)
