"""Loop-carried state: output X of call t is input Y of call t+1, with nothing copied between the calls.

`fast.carry(output=..., input=...)` declares that the tensors at an output path (an index or key, or a
tuple of them, into what the function returns: a tensor or a container of tensors such as a KV cache)
are fed back as the argument `input` (a position or a keyword name) of the next call, leaf by leaf.

Each graph is captured so that the op producing a carried output writes it, through its `out=` form,
straight into the placeholder buffer that the *next* call reads, in the lane beside the one this
graph reads (`lanes.partner`): a graph reading lane 1 writes its carried outputs into lane 2, whose
graphs write back into lane 1 (double buffering). So replay t+1 never writes a buffer it reads, and
the outputs of call t stay intact until replay t+2, longer than the lifetime `outputs.py` promises.
The producers are found by running the function once before capture under a recording dispatch mode
(the op overload and its occurrence count within the function). A carried output whose producer has
no `out=` form (a view, an input returned as is) is copied into the buffer inside the graph instead:
no host launch, but its bytes are counted as copied (`Misprediction.CARRY_COPY`).

A call whose carried argument is not in a lane buffer (the first call, a fresh tensor) copies it as
usual. Carries are declared before the first capture, and the positions they feed are never targets
of automatic redirects (`lanes.Lanes.carried`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from tendril.graphs.key import GraphKey
from tendril.graphs.stats import GraphStats, Misprediction
from tendril.graphs.zero_copy.lanes import Lanes, empty_at, lane_of, memory_range, overlaps, partner
from tendril.graphs.zero_copy.ops import ProducerKey, out_form, signature

OutputPath = tuple[int | str, ...]


@dataclass(frozen=True)
class Carry:
    """One declaration: the tensors at `output` in call t's result are the argument `input` of call t+1."""

    output: OutputPath
    input: int | str


@dataclass(frozen=True)
class _Binding:
    """One carried tensor of one graph: output leaf -> input leaf `position`, written into `buffer`."""

    position: int
    buffer: torch.Tensor
    producer: ProducerKey | None
    """The op writing it through `out=`; None: copied inside the graph."""


@dataclass(frozen=True)
class _Redirect:
    """Where a producer writes during capture, and what the probe saw it make."""

    buffer: torch.Tensor
    shape: torch.Size
    signature: tuple[Any, ...]


class _Recorder(TorchDispatchMode):
    """Tags every op output with its `ProducerKey` and signature; with `redirects`, writes those producers
    into their buffers, checking that the op still has the probed signature and output shape (else it
    runs normally: the carried output is then copied at the end of the function)."""

    def __init__(self, redirects: dict[ProducerKey, _Redirect] | None = None) -> None:
        super().__init__()
        self.redirects = redirects or {}
        self.occurrences: Counter[torch._ops.OpOverload] = Counter()
        self.produced: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        producer = ProducerKey(func, self.occurrences[func])
        self.occurrences[func] += 1
        redirect = self.redirects.get(producer)
        out_op = out_form(func) if redirect is not None else None
        result = None
        if redirect is not None and out_op is not None and signature(args, kwargs) == redirect.signature:
            result = out_op(*args, **kwargs, out=empty_at(redirect.buffer))
            if result.shape != redirect.shape:
                result = None
        if result is None:
            result = func(*args, **kwargs)
        if isinstance(result, torch.Tensor) and not self.redirects:
            self.produced[result] = (producer, signature(args, kwargs))
        return result


@dataclass
class CarryPlan:
    """The carries of one callable, and what each graph does to honour them."""

    lanes: Lanes
    stats: GraphStats
    carries: list[Carry] = field(default_factory=list)
    bindings: dict[GraphKey, list[_Binding]] = field(default_factory=dict)
    in_graph_bytes: dict[GraphKey, int] = field(default_factory=dict)
    """Bytes each graph copies inside itself because a carried output could not be redirected."""

    def declare(self, output: int | str | OutputPath, input: int | str) -> None:
        path: OutputPath = output if isinstance(output, tuple) else (output,)
        self.carries.append(Carry(path, input))

    def prepare(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        key: GraphKey,
        positions: Sequence[int],
        placeholders: Sequence[torch.Tensor],
    ) -> Callable[..., Any]:
        """Find the carried outputs' producers (one eager run) and return `fn` writing them into the next lane.

        Raises `ValueError` when a declaration does not fit the call (a missing argument, an output
        path that does not exist, other counts or dtypes of tensors on the two sides).
        """
        position_of = {id(placeholder): position for position, placeholder in zip(positions, placeholders, strict=True)}
        recorder = _Recorder()
        with recorder:
            outputs = fn(*args, **kwargs)
        target_lane = partner(lane_of(key))
        bindings: list[_Binding] = []
        redirects: dict[ProducerKey, _Redirect] = {}
        for carry in self.carries:
            inputs = [position_of[id(leaf)] for leaf in _tensor_leaves(_argument(args, kwargs, carry.input))]
            carried = _tensor_leaves(_select(outputs, carry.output))
            if len(inputs) != len(carried):
                raise ValueError(
                    f"carry(output={carry.output}, input={carry.input!r}): the output holds {len(carried)} tensors, "
                    f"the input {len(inputs)}; they must correspond one to one (pytree order)"
                )
            for position, leaf in zip(inputs, carried, strict=True):
                placeholder = placeholders[list(positions).index(position)]
                if (leaf.dtype, leaf.device) != (placeholder.dtype, placeholder.device):
                    raise ValueError(
                        f"carry(output={carry.output}, input={carry.input!r}): output {leaf.dtype} on {leaf.device} "
                        f"feeds an input of {placeholder.dtype} on {placeholder.device}; they must match"
                    )
                buffer = self.lanes.buffer(target_lane, position, leaf.dtype, leaf.device, 2 * max(leaf.numel(), 1))
                producer, probed = recorder.produced.get(leaf, (None, ()))
                reads_buffer = any(overlaps(memory_range(buffer), memory_range(p)) for p in placeholders)
                if producer is None or out_form(producer.op) is None or not leaf.is_contiguous() or reads_buffer:
                    producer = None
                else:
                    redirects[producer] = _Redirect(buffer, leaf.shape, probed)
                bindings.append(_Binding(position, buffer, producer))
                self.lanes.carried.add(position)
        del outputs
        self.bindings[key] = bindings
        copied_bytes: list[int] = [0]

        def run(*call_args: Any, **call_kwargs: Any) -> Any:
            with _Recorder(redirects):
                result = fn(*call_args, **call_kwargs)
            copied_bytes[0] = 0
            for binding, leaf in zip(bindings, self._carried_leaves(result), strict=True):
                if leaf.data_ptr() == binding.buffer.data_ptr() and leaf.is_contiguous():
                    continue
                binding.buffer[: leaf.numel()].view(leaf.shape).copy_(leaf)
                copied_bytes[0] += leaf.numel() * leaf.element_size()
            self.in_graph_bytes[key] = copied_bytes[0]
            return result

        return run

    def rebind(self, key: GraphKey, outputs: Any) -> Any:
        """`outputs` with each carried tensor replaced by the view of the lane buffer the graph writes it to."""
        bindings = self.bindings.get(key)
        if not bindings:
            return outputs
        carried = self._carried_leaves(outputs)
        views = {
            id(leaf): binding.buffer[: leaf.numel()].view(leaf.shape)
            for binding, leaf in zip(bindings, carried, strict=True)
        }
        copied = self.in_graph_bytes.get(key, 0)
        if copied:
            self.stats.record_misprediction(
                Misprediction.CARRY_COPY, f"{key}: {copied} bytes of carried outputs copied inside the graph"
            )
        return pytree.tree_map_only(torch.Tensor, lambda leaf: views.get(id(leaf), leaf), outputs)

    def _carried_leaves(self, outputs: Any) -> list[torch.Tensor]:
        return [leaf for carry in self.carries for leaf in _tensor_leaves(_select(outputs, carry.output))]


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], selector: int | str) -> Any:
    try:
        return args[selector] if isinstance(selector, int) else kwargs[selector]
    except (IndexError, KeyError):
        raise ValueError(
            f"carry(input={selector!r}): the call has no such argument (positional count {len(args)}, keywords "
            f"{sorted(kwargs)}); name a positional index or a keyword the function is called with"
        ) from None


def _select(outputs: Any, path: OutputPath) -> Any:
    value = outputs
    for step in path:
        try:
            value = value[step]
        except (IndexError, KeyError, TypeError):
            raise ValueError(
                f"carry(output={path}): the function's result has no element {step!r} at that level "
                f"({type(value).__name__})"
            ) from None
    return value


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]
