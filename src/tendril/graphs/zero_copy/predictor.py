"""The zero-copy predictor: learn which op produces each input of a callable, redirect it, verify at the call.

Grape's alias predictor, made safe. A host loop around a graphed callable (a decode step) produces the
next call's inputs with ordinary ops (`index_select` on beam indices, `cat`, `add`) and the call then
copies them into the graph's placeholders. Under `with fast.zero_copy():` every torch call between two
calls of the callable goes through `ZeroCopyPredictor.dispatch` (see `mode`), which:

1. **learns**: each op output is recorded with its `ProducerKey`, the function and how many times it ran
   since the callable's last call (robust to unrelated ops inserted elsewhere; code positions would break
   under helper functions and loops, op streams do not care). When a call copies a tensor into its
   placeholder at argument leaf `position`, the tensor's producer is linked to that position, with the
   producer's *signature* (`ops.signature`). A link is confirmed when two consecutive calls agree on it,
   and dropped when its producer runs but the next call does not meet its output (a setup `clone` that fed
   the first call once must not start writing into placeholders). A tensor passed as a whole view of an op
   output (HF's `tokens[:, None]`: same dtype, start and elements, both contiguous) stands for that output,
   whose producer is linked instead (`observe`);
2. **redirects**: when a confirmed producer runs again with the same signature, it runs in its `out=` form
   into the placeholder buffer of its position in the lane the last call did not read (`lanes`), as a
   zero-length tensor at the buffer's start that the op resizes to its output shape. Buffers are shared by
   all shapes, so one redirect serves whatever key the call turns out to have;
3. **verifies**: the call skips the copy only where the argument *is* its placeholder (same address and
   strides, checked at every call); anything else is copied as before and counted.

A redirect is refused (and counted in `stats.mispredictions`) when the target slot still holds a
redirected tensor (or a view of one) the program references; the op reads the buffer it would write (or
an argument has no storage to check, a sparse tensor), or an argument requires grad; the signature differs
from the learned one; the output does not fit the buffer (the zero-length target's storage cannot grow, so
the op raises before writing and runs normally instead; the buffer is then reallocated at twice the
output's size); a graph returns a view of that position's placeholder (the output would be clobbered), or
the position is loop-carried state (`carry`). A redirected tensor that the call then did not read, or that
landed in another buffer than the call's graph reads, is counted too, and the link is dropped until the
next copy relearns it. Results always equal eager: a wrong prediction costs one copy, never a wrong value.

The per-op path does per run only what can change between runs. A producer is found by two dict lookups
on (id of the function, occurrence), no frame or code position is inspected, and the link found is checked
to be that function's (`link.op is op`). An op that is no linked producer then only runs and leaves a
record of its output (a weak reference, in a tuple made without the `NamedTuple` constructor's Python
frame). A linked producer describes its arguments once (`ops.survey`: the signature and the data pointers
of plain tensor arguments); a confirmed one then checks the position is neither pinned nor carried, the
signature, autograd, that its slot is unreferenced (one storage use-count read against the count the slot
record holds itself) and that no argument starts in the slot's bytes. The slot record is cached on the
link per lane (`Link.aliases`) and reused while it is not retired and holds twice the output, which is
exactly when `Lanes.redirect_alias` would return it. Host costs are measured by
`benchmarks/tools/zero_copy_host_cost.py`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from tendril.graphs.stats import GraphStats, Misprediction
from tendril.graphs.zero_copy.lanes import PARTNER, REDIRECT_LANES, Lanes, SlotAlias, use_count
from tendril.graphs.zero_copy.mode import lift_mode, restore_mode
from tendril.graphs.zero_copy.ops import ProducerKey, op_name, out_call, reads_between, survey, tensor_arguments

if TYPE_CHECKING:
    from tendril.graphs.zero_copy.mode import ZeroCopyMode

_Tensor = torch.Tensor


@dataclass(slots=True)
class Link:
    """A learned prediction: this producer's output is the argument at leaf `position`."""

    op: Callable[..., Any]
    out_op: Callable[..., Any]
    """How a redirect runs the op with `out=` (`out_call(op)`)."""
    position: int
    signature: tuple[Any, ...] | None
    """Argument dtypes/devices/constants of the run whose output the last call met (None: not seen yet, so the
    link does not redirect)."""
    dtype: torch.dtype
    device: torch.device
    numel: int
    confirmations: int = 1
    """Calls that met this producer's output at `position`; redirects start at `CONFIRMATIONS`."""
    aliases: list[SlotAlias | None] = field(default_factory=lambda: [None] * (1 + max(REDIRECT_LANES)))
    """Per lane, the slot record the last redirect into it wrote (`Lanes.redirect_alias`): reused while it is
    not `retired` and holds `2 * numel` elements, which is exactly when `redirect_alias` would return it."""


CONFIRMATIONS = 2
"""A link redirects once two calls agree on it, so an op that fed an argument once (a setup `clone`)
does not start writing into a placeholder the program then keeps elsewhere."""

_Slot = tuple[int, int]
"""A producer in the per-op path: (id of the op overload, occurrence); the link stores the op itself, and
a lookup checks it (`link.op is op`), so a reused id can never select another op's link."""


class _Produced(NamedTuple):
    """What the mode recorded about one op output (keyed by the tensor's id, checked through `ref`)."""

    ref: weakref.ref[torch.Tensor]
    slot: _Slot
    op: Callable[..., Any]
    signature: tuple[Any, ...] | None
    """Only computed for linked producers (the only ones a call can confirm or a redirect can check)."""
    viewed: _Produced | _Redirected | None = None
    """The record of the op output this output is a whole view of (`tokens[:, None]`; `ZeroCopyPredictor.observe`)."""


class _Redirected(NamedTuple):
    ref: weakref.ref[torch.Tensor]
    slot: _Slot
    op: Callable[..., Any]
    position: int


_new_record = tuple.__new__
"""`_new_record(_Produced, (...))` makes a record without the Python-level `NamedTuple.__new__` (half the cost,
on the path every op takes); the fields are all given, in order."""


class ZeroCopyPredictor:
    """Learns producers of one callable's inputs and redirects them; driven by `ZeroCopyMode`.

    The per-op path (`dispatch`) is what every op inside a `zero_copy()` block pays for, so it does the
    least it can: an op that is no linked producer costs a counter update, a dict lookup and a record of
    its output (a weak reference); only linked producers describe their arguments (`survey`), and only
    confirmed ones try a redirect, which checks what can change between runs and caches the rest on the
    link (see the module docstring).
    """

    def __init__(self, lanes: Lanes, stats: GraphStats) -> None:
        self.lanes = lanes
        self.stats = stats
        self.links: dict[_Slot, Link] = {}
        self.occurrences: dict[int, int] = {}
        """Runs of each op overload (by id) since the callable's last call."""
        self.produced: dict[int, _Produced] = {}
        """id of an op output -> its record; entries whose tensor died are pruned as the table grows."""
        self._prune_at = _PRUNE_MIN
        self.redirected: dict[int, _Redirected] = {}
        """Tensors written by redirects since the last call."""
        self.ran: set[_Slot] = set()
        """Linked producers that ran since the last call; those whose output the call did not meet are unlinked."""
        self.met: set[_Slot] = set()
        self.suspended = 0
        self.active = 0
        """Open `zero_copy()` blocks."""

    # -- between calls -------------------------------------------------------------------------------

    def dispatch(self, op: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        if self.suspended:
            return op(*args, **kwargs)
        op_id = id(op)
        occurrences = self.occurrences
        occurrence = occurrences.get(op_id, 0)
        occurrences[op_id] = occurrence + 1
        slot = (op_id, occurrence)
        link = self.links.get(slot)
        if link is None or link.op is not op:
            result = op(*args, **kwargs)
            if isinstance(result, _Tensor):
                self._record(result, slot, op, None, args)
            return result
        self.ran.add(slot)
        learned, pointers = survey(args, kwargs)
        if link.confirmations >= CONFIRMATIONS and link.signature is not None:
            result = self._redirect(slot, link, learned, pointers, args, kwargs)
            if result is not _REFUSED:
                return result  # a redirected tensor, met by `observe` in `redirected`; or recorded eagerly
        result = op(*args, **kwargs)
        if isinstance(result, _Tensor):
            self._record(result, slot, op, learned, args)
        return result

    def _record(
        self, result: torch.Tensor, slot: _Slot, op: Callable[..., Any], learned: Any, args: Sequence[Any]
    ) -> None:
        produced = self.produced
        first = args[0] if args else None
        viewed = None
        if type(first) is _Tensor and first is not result and out_call(op) is None:  # a view, maybe
            viewed = self._viewed(first, result)
        produced[id(result)] = _new_record(_Produced, (weakref.ref(result), slot, op, learned, viewed))
        if len(produced) >= self._prune_at:
            for key in [key for key, record in produced.items() if record.ref() is None]:
                del produced[key]
            self._prune_at = max(_PRUNE_MIN, 2 * len(produced))

    def _viewed(self, first: torch.Tensor, result: torch.Tensor) -> _Produced | _Redirected | None:
        """The record of the op output `result` is a whole view of (see `observe`), when it views all of `first`,
        the op's first argument; a view of a view resolves to the first op output that has an out= form."""
        if first.data_ptr() != result.data_ptr() or first.numel() != result.numel():
            return None
        if first.dtype != result.dtype:
            return None  # `view(dtype)` reinterprets: the producer's out= form would convert instead
        if not (first.is_contiguous() and result.is_contiguous()):
            return None
        record: _Produced | _Redirected | None = self.redirected.get(id(first)) or self.produced.get(id(first))
        if record is None or record.ref() is not first:
            return None
        if isinstance(record, _Produced) and record.viewed is not None and out_call(record.op) is None:
            return record.viewed
        return record

    def _redirect(
        self,
        slot: _Slot,
        link: Link,
        learned: tuple[Any, ...],
        pointers: list[int] | None,
        args: Sequence[Any],
        kwargs: dict[str, Any],
    ) -> Any:
        """Run a confirmed producer into its placeholder slot, or return `_REFUSED` (the caller runs it eagerly).

        Checks what can change from one run to the next: the position's standing (pinned, carried), the
        signature, autograd, the slot's buffer (cached in `link.aliases` while current and large enough),
        whether the program still references the slot, whether the op reads it; the op itself checks the
        output fits."""
        position = link.position
        lanes = self.lanes
        if position in lanes.pinned or position in lanes.carried:
            return _REFUSED
        if learned != link.signature:
            self._miss(Misprediction.SIGNATURE, f"{_name(link, slot)} ran with other argument dtypes or constants")
            return _REFUSED
        if torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensor_arguments(args, kwargs)):
            return _REFUSED  # out= ops do not record autograd history
        lane = PARTNER[lanes.last_lane]
        alias = link.aliases[lane]
        if alias is None or alias.retired or alias.capacity < 2 * max(link.numel, 1):
            alias = lanes.redirect_alias(lane, position, link.dtype, link.device, 2 * max(link.numel, 1))
            link.aliases[lane] = alias
        if use_count(alias.cdata) > alias.own:  # `alias.referenced()`
            detail = f"{_name(link, slot)}: lane {lane} slot {position} is still referenced"
            self._miss(Misprediction.REFERENCED, detail)
            return _REFUSED
        if reads_between(pointers, args, kwargs, alias.start, alias.end):
            self._miss(
                Misprediction.READS_PLACEHOLDER, f"{_name(link, slot)} reads (or may read) the buffer it would write"
            )
            return _REFUSED
        template = alias.templates.get(torch.is_inference_mode_enabled())  # `alias.target()`, inline
        target = alias.target() if template is None else template.detach()
        try:
            result = link.out_op(*args, **kwargs, out=target)
        except (RuntimeError, TypeError) as error:  # raised before writing: the output does not fit, or out= refused
            first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
            if "not resizable" not in first_line:
                self.links.pop(slot, None)
                self._miss(Misprediction.NO_OUT_FORM, f"{_name(link, slot)}: its out= form raised {first_line}")
                return _REFUSED
            self._miss(Misprediction.TOO_LARGE, f"{_name(link, slot)}: {first_line}")
            result = self._outgrown(lane, link, link.op(*args, **kwargs))
            if isinstance(result, _Tensor):
                self._record(result, slot, link.op, learned, args)
            return result
        self.redirected[id(result)] = _new_record(_Redirected, (weakref.ref(result), slot, link.op, position))
        self.stats.redirects += 1
        return result

    def _outgrown(self, lane: int, link: Link, result: Any) -> Any:
        """The eager `result` of a producer too large for its lane buffer; the buffer is sized for it now.

        Sized as the next redirect will ask (twice the output), so this lane's buffer is reallocated once,
        here, before any graph reads it at the new size; the other lane grows at its next redirect. Every
        call after the reallocation goes to graphs captured against the new buffers (`Lanes.generations`).
        """
        if isinstance(result, torch.Tensor):
            link.numel = result.numel()
            self.lanes.buffer(lane, link.position, link.dtype, link.device, 2 * max(link.numel, 1))
        return result

    def _miss(self, reason: Misprediction, detail: str) -> None:
        self.stats.record_misprediction(reason, detail)

    # -- at a call -----------------------------------------------------------------------------------

    def observe(self, position: int, source: torch.Tensor, in_place: bool) -> None:
        """A call met `source` at argument leaf `position`; `in_place`: it already was the placeholder.

        A source that is a whole view of an op output (`tokens[:, None]`: same start and elements, both laid
        out contiguously; `_Produced.viewed`) stands for that output, which may be dead by now (inference-mode
        views keep only the storage): its producer is the one linked and redirected, and the view the program
        makes of the redirected output is then in place (checked at every call, as always)."""
        redirected: _Redirected | None = self.redirected.pop(id(source), None)
        if redirected is not None and redirected.ref() is not source:
            redirected = None
        produced = None
        if redirected is None:
            produced = self.produced.get(id(source))
            if produced is not None and produced.ref() is not source:
                produced = None
            if produced is not None and produced.viewed is not None and out_call(produced.op) is None:
                if isinstance(produced.viewed, _Redirected):
                    redirected = produced.viewed
                    self._forget_redirect(redirected)
                else:
                    produced = produced.viewed
        if redirected is not None:
            self.met.add(redirected.slot)
            if in_place:
                return
            name = ProducerKey(redirected.op, redirected.slot[1])
            if redirected.position != position:
                detail = f"{name} was predicted for leaf {redirected.position}, passed at {position}"
                self._miss(Misprediction.NOT_PASSED, detail)
            else:
                self._miss(Misprediction.MOVED, f"{name}: the call's graph reads another buffer or layout")
            self.links.pop(redirected.slot, None)
            return
        if in_place or produced is None:
            return
        self.met.add(produced.slot)
        if position in self.lanes.carried or position in self.lanes.pinned:
            return
        out_op = out_call(produced.op)
        if out_op is None:
            detail = f"leaf {position} comes from {op_name(produced.op)}, which has no out= form"
            self._miss(Misprediction.NO_OUT_FORM, detail)
            return
        known = self.links.get(produced.slot)
        agrees = (
            known is not None
            and known.op is produced.op
            and known.position == position
            and (known.signature is None or known.signature == produced.signature)
        )
        confirmations = known.confirmations + 1 if known is not None and agrees else 1
        self.links[produced.slot] = Link(
            produced.op,
            out_op,
            position,
            produced.signature,
            source.dtype,
            source.device,
            source.numel(),
            confirmations,
        )

    def _forget_redirect(self, record: _Redirected) -> None:
        """Drop `record` from this interval's redirects (met through a view, so under another tensor's id)."""
        for key, value in self.redirected.items():
            if value is record:
                del self.redirected[key]
                return

    def end_interval(self, *, count: bool = True) -> None:
        """The call has read its arguments: redirected tensors it did not read were wasted predictions.

        `count=False` at the end of a `zero_copy()` block: the last producers' outputs had no call to go to.
        """
        if count:
            for record in self.redirected.values():
                if record.ref() is None:
                    continue  # dropped by the program before the call: nothing was wasted but the write
                name = ProducerKey(record.op, record.slot[1])
                self._miss(Misprediction.NOT_PASSED, f"{name} was predicted for leaf {record.position}, not passed")
                self.links.pop(record.slot, None)
            for slot in self.ran - self.met:
                self.links.pop(slot, None)
        self.redirected.clear()
        self.ran.clear()
        self.met.clear()
        self.occurrences.clear()

    def enter_call(self) -> ZeroCopyMode | None:
        """A call of the callable starts: its own ops are not producers. Returns the mode it lifted off
        torch's mode stack for the call (`lift_mode`), to give back to `exit_call`."""
        self.suspended += 1
        return lift_mode(self)

    def exit_call(self, lifted: ZeroCopyMode | None) -> None:
        """The call is over: the next interval starts."""
        restore_mode(lifted)
        self.suspended -= 1
        self.end_interval()


_REFUSED: Any = object()
"""What `ZeroCopyPredictor._redirect` returns when it did not run the op."""

_PRUNE_MIN = 256
"""`ZeroCopyPredictor.produced` is pruned of dead tensors when it reaches this size or twice its size after
the last pruning (amortised O(1) per op, even when the program keeps many op outputs alive)."""


def _name(link: Link, slot: _Slot) -> ProducerKey:
    return ProducerKey(link.op, slot[1])
