"""Bad inputs to graphed callables: each gives a clear Python exception or the eager result, and the callable
keeps working.

A `BadCase` names a scenario and a check run on one device (CPU through `NullBackend`, or CUDA). The rule of
the graphed scenarios is differential: the graphed call must raise where eager raises and must equal eager where
eager returns; afterwards a good call must still equal eager. `run_bad_case` sorts what happened into ok,
silent_wrong (a result where eager raises, or a result unequal to eager's, or an invalid value accepted) and
crash (an unexpected exception, or a callable that no longer works).
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import tendril
from tendril.config import Config
from tendril.graphs.backend import NullBackend
from tendril.graphs.callable import GraphedCallable
from tests.fuzz.cases import tensors


class SilentWrong(AssertionError):
    """A wrong answer without an exception: a value unequal to eager's, or a bad input accepted."""


class Broken(AssertionError):
    """The process or the callable stopped working after a bad input, or a good input raised."""


@dataclass(frozen=True)
class BadCase:
    name: str
    check: Callable[[str], None]
    """Run on a device ("cpu" or "cuda"); raise `SilentWrong` or `Broken`, or return when all is well."""
    devices: tuple[str, ...] = ("cpu", "cuda")


@dataclass
class BadOutcome:
    case: BadCase
    device: str
    status: str = "ok"
    """ok, silent_wrong or crash."""
    detail: str = ""

    def message(self) -> str:
        return (f"bad input {self.case.name} on {self.device}: {self.status}: {self.detail}\n  reproduce: "
                f'PYTHONPATH=src python -m pytest tests/fuzz/test_bad_inputs.py -k "{self.device}-{self.case.name}"')


def run_bad_case(case: BadCase, device: str) -> BadOutcome:
    outcome = BadOutcome(case, device)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            case.check(device)
    except SilentWrong as wrong:
        outcome.status, outcome.detail = "silent_wrong", str(wrong)
    except Exception as error:
        outcome.status = "crash"
        outcome.detail = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=-6)}"
    return outcome


def same(got: Any, expected: Any, what: str) -> None:
    """Raise `SilentWrong` unless the tensors of `got` equal those of `expected` (NaN equal to NaN)."""
    got_tensors, expected_tensors = tensors(got), tensors(expected)
    if len(got_tensors) != len(expected_tensors):
        raise SilentWrong(f"{what}: {len(got_tensors)} tensors, eager returns {len(expected_tensors)}")
    for g, e in zip(got_tensors, expected_tensors, strict=True):
        if g.shape != e.shape or g.dtype != e.dtype:
            raise SilentWrong(f"{what}: {g.dtype}{list(g.shape)}, eager {e.dtype}{list(e.shape)}")
        g = g.detach().as_subclass(torch.Tensor)
        if g.is_floating_point() and g.numel():
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4, equal_nan=True, msg=lambda m: f"{what}: {m}")
        elif not torch.equal(g.cpu(), e.cpu()):
            raise SilentWrong(f"{what}: values differ from eager")


def differential(fn: Callable[..., Any], fast: Callable[..., Any], args: tuple[Any, ...], what: str) -> None:
    """The graphed call raises where eager raises and returns eager's result where eager returns."""
    try:
        expected = tensors(fn(*args))
        expected = [t.clone() for t in expected]
    except Exception as eager_error:
        try:
            got = fast(*args)
        except Exception:
            return
        raise SilentWrong(f"{what}: eager raises {type(eager_error).__name__}: {eager_error}; graphed returns "
                          f"{[tuple(t.shape) for t in tensors(got)]}") from None
    try:
        got = fast(*args)
    except Exception as error:
        raise Broken(f"{what}: eager returns, graphed raises {type(error).__name__}: {error}") from error
    try:
        same(got, expected, what)
    except AssertionError as mismatch:
        raise SilentWrong(str(mismatch)) from None


# -- graphed targets ---------------------------------------------------------------------------------------


@dataclass
class Target:
    """A function to graph and a maker of good arguments for it (`good(generator, size)`)."""

    fn: Callable[..., Any]
    good: Callable[[torch.Generator, int], tuple[Any, ...]]
    options: dict[str, Any]
    float_input: bool = True


def _target(name: str, device: str) -> Target:
    torch.manual_seed(0)

    def randn(generator: torch.Generator, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device)

    if name == "mlp":
        mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).to(device).eval()
        return Target(mlp, lambda g, n: (randn(g, n, 16),), {})
    if name == "pair":
        return Target(lambda x, y: (x * y + 1, (x - y).sum(-1)), lambda g, n: (randn(g, n, 8), randn(g, n, 8)), {})
    if name == "conv":
        conv = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.ReLU()).to(device).eval()
        return Target(conv, lambda g, n: (randn(g, 1, 3, n, n),), {})
    from tests.generation.models import VOCAB, tiny_model

    model = tiny_model("gpt2", device)

    def ids(generator: torch.Generator, n: int) -> tuple[torch.Tensor]:
        return (torch.randint(4, VOCAB, (1, n), generator=generator).to(device),)

    options = {"buckets": tendril.sequence_buckets((8, 16, 32))} if name == "gpt2_buckets" else {}
    return Target(model, ids, options, float_input=False)


TARGETS = ("mlp", "pair", "conv", "gpt2", "gpt2_buckets")


def _graph(target: Target, device: str) -> GraphedCallable:
    backend = NullBackend() if device == "cpu" else None
    return tendril.graphed(target.fn, backend=backend, config=Config(), **target.options)


def still_works(target: Target, fast: Callable[..., Any], generator: torch.Generator, what: str) -> None:
    """A good call after the bad one equals eager (raises `Broken` otherwise)."""
    for size in (5, 6):
        args = target.good(generator, size)
        expected = [t.clone() for t in tensors(target.fn(*args))]
        try:
            same(fast(*args), expected, f"{what}: a good call afterwards")
        except Exception as error:
            raise Broken(f"{what}: the callable stopped working: {type(error).__name__}: {error}") from error


def _length_dim(x: torch.Tensor) -> int:
    """The dimension a target's length varies along: image width, token position, or rows."""
    if x.dim() == 4:
        return -1
    return 1 if not x.is_floating_point() and x.dim() == 2 else 0


def _other_device(device: str) -> str:
    return "meta" if device == "cpu" else "cpu"


Transform = Callable[[torch.Tensor, str, Any], torch.Tensor]
"""(the good primary argument, the device, the previous call's outputs) -> the bad primary argument."""

TRANSFORMS: dict[str, Transform] = {
    "dtype_float64": lambda x, d, prev: x.double(),
    "dtype_int32": lambda x, d, prev: x.int(),
    "dtype_float16": lambda x, d, prev: x.half(),
    "dtype_bool": lambda x, d, prev: x != 0,
    "wrong_device": lambda x, d, prev: x.to(_other_device(d)),
    "rank_0": lambda x, d, prev: x.flatten()[0],
    "rank_minus_1": lambda x, d, prev: x[0],
    "rank_plus_1": lambda x, d, prev: x.unsqueeze(0),
    "zero_length": lambda x, d, prev: x.narrow(_length_dim(x), 0, 0),
    "very_long": lambda x, d, prev: x.repeat_interleave(64 if x.dim() == 4 else 2000, dim=_length_dim(x)),
    "transposed": lambda x, d, prev: x.transpose(-1, -2).contiguous().transpose(-1, -2),
    "strided_slice": lambda x, d, prev: torch.cat([x, x], dim=-1)[..., ::2],
    "channels_last_or_flipped": lambda x, d, prev: x.contiguous(memory_format=torch.channels_last) if x.dim() == 4
    else x.flip(-1),
    "overlapping_expand": lambda x, d, prev: x.narrow(-1, 0, 1).expand_as(x),
    "overlapping_as_strided": lambda x, d, prev: x.flatten().as_strided(x.shape, [1] * x.dim()),
    "nan": lambda x, d, prev: x.masked_fill(torch.rand_like(x.float()) < 0.3, float("nan")),
    "inf": lambda x, d, prev: x.masked_fill(torch.rand_like(x.float()) < 0.3, float("inf")),
    "neg_inf": lambda x, d, prev: x.masked_fill(torch.rand_like(x.float()) < 0.3, float("-inf")),
    "previous_output": lambda x, d, prev: tensors(prev)[0],
    "view_of_previous_output": lambda x, d, prev: tensors(prev)[0].narrow(-2, 1, tensors(prev)[0].shape[-2] - 1),
}
FLOAT_ONLY = {"nan", "inf", "neg_inf", "previous_output", "view_of_previous_output"}
GPU_UNSAFE = {("gpt2", "very_long")}
"""Out-of-range positions or ids index embeddings: a device-side assert on CUDA (eager as much as graphed) ends
the CUDA context, so these run on the CPU only."""
CPU_UNSAFE = {("gpt2", "wrong_device")}
"""The CPU's other device is "meta": an eager embedding lookup of meta ids returns uninitialised CPU memory, so
eager itself has no result to compare with; these run on CUDA only (ids on the CPU)."""


def graphed_check(target_name: str, transform: str) -> Callable[[str], None]:
    def check(device: str) -> None:
        target = _target(target_name, device)
        generator = torch.Generator().manual_seed(1)
        fast = _graph(target, device)
        what = f"{target_name} with {transform}"
        with torch.inference_mode():
            args = target.good(generator, 6)
            expected = [t.clone() for t in tensors(target.fn(*args))]
            previous = fast(*args)
            same(previous, expected, f"{what}: the good first call")
            bad = (TRANSFORMS[transform](args[0], device, previous), *args[1:])
            differential(target.fn, fast, bad, what)
            still_works(target, fast, generator, what)

    return check


def _graphed_cases() -> Iterator[BadCase]:
    for target_name in TARGETS:
        for transform in TRANSFORMS:
            float_input = target_name not in ("gpt2", "gpt2_buckets")
            if transform in FLOAT_ONLY and not float_input:
                continue
            pair = (target_name.removesuffix("_buckets"), transform)
            devices = tuple(d for d in ("cpu", "cuda") if pair not in (GPU_UNSAFE if d == "cuda" else CPU_UNSAFE))
            yield BadCase(f"{target_name}-{transform}", graphed_check(target_name, transform), devices)


def _aliased_arguments(device: str) -> None:
    """The same tensor passed as both arguments, then a view of one as the other."""
    target = _target("pair", device)
    generator = torch.Generator().manual_seed(2)
    fast = _graph(target, device)
    with torch.inference_mode():
        x, _ = target.good(generator, 6)
        differential(target.fn, fast, (x, x), "pair(x, x)")
        differential(target.fn, fast, (x, x[:]), "pair(x, x[:])")
        still_works(target, fast, generator, "aliased arguments")


def _unkeyable_and_grad(device: str) -> None:
    """An unhashable argument and an input requiring grad run eagerly, with eager's result."""
    target = _target("mlp", device)
    generator = torch.Generator().manual_seed(3)
    fast = _graph(target, device)
    x = target.good(generator, 4)[0]
    with torch.no_grad():
        differential(lambda v, extra: target.fn(v), tendril.graphed(lambda v, extra: target.fn(v), config=Config(),
                     backend=NullBackend() if device == "cpu" else None), (x, {1, 2}), "a set argument")
    differential(target.fn, fast, (x.clone().requires_grad_(),), "an input requiring grad")
    with torch.inference_mode():
        still_works(target, fast, generator, "unkeyable and grad inputs")


def _interrupted_capture(raise_on: int) -> Callable[[str], None]:
    """KeyboardInterrupt raised by the function on its `raise_on`-th run of a new shape (1: warm-up, 2: the run
    that is captured): it reaches the caller, and the same shape captures and replays correctly afterwards."""

    def check(device: str) -> None:
        target = _target("mlp", device)
        runs = {"count": 0, "armed": False}

        def fn(x: torch.Tensor) -> torch.Tensor:
            if runs["armed"]:
                runs["count"] += 1
                if runs["count"] == raise_on:
                    runs["armed"] = False
                    raise KeyboardInterrupt
            return target.fn(x)

        fast = tendril.graphed(fn, backend=NullBackend() if device == "cpu" else None, config=Config())
        generator = torch.Generator().manual_seed(4)
        with torch.inference_mode():
            fast(*target.good(generator, 3))
            runs["armed"] = True
            try:
                fast(*target.good(generator, 7))
            except KeyboardInterrupt:
                pass
            else:
                raise SilentWrong("KeyboardInterrupt during capture was swallowed")
            still_works(Target(fn, target.good, {}), fast, generator, "after KeyboardInterrupt")
            x = target.good(generator, 7)[0]
            same(fast(x), target.fn(x), "the interrupted shape afterwards")

    return check


def _bad_options(device: str) -> None:
    """Invalid options of `graphed` and `Buckets` raise ValueError where they are written."""
    fn = _target("mlp", device).fn
    for options in ({"max_graphs": -1}, {"warmup": -1}):
        try:
            tendril.graphed(fn, **options)
        except ValueError:
            continue
        raise SilentWrong(f"graphed(..., **{options}) accepted")
    for sizes in ((16, 8), (0, 4), (), (8, 8)):
        try:
            tendril.sequence_buckets(sizes)
        except ValueError:
            continue
        raise SilentWrong(f"sequence_buckets({sizes}) accepted")


def _mask_disagrees_with_ids(device: str) -> None:
    """A bucketed call whose mask is shorter than its ids: eager's exception, or ValueError from padding."""
    target = _target("gpt2_buckets", device)
    generator = torch.Generator().manual_seed(5)
    fast = _graph(target, device)
    with torch.inference_mode():
        (ids,) = target.good(generator, 6)
        mask = torch.ones(1, 4, dtype=torch.long, device=device)
        try:
            fast(ids, attention_mask=mask)
        except (ValueError, RuntimeError, IndexError):
            pass
        else:
            raise SilentWrong("a mask shorter than the ids was accepted")
        still_works(target, fast, generator, "after a mismatched mask")


def _oom_during_capture(target_name: str) -> Callable[[str], None]:
    """The device filled before a new shape's capture: a clear out-of-memory error (or eager's result), and once
    the memory is free again the callable works."""

    def check(device: str) -> None:
        target = _target(target_name, device)
        generator = torch.Generator().manual_seed(6)
        fast = _graph(target, device)
        filler: list[torch.Tensor] = []
        with torch.inference_mode():
            fast(*target.good(generator, 6))
            args = target.good(generator, 11)
            expected = [t.clone() for t in tensors(target.fn(*args))]
            chunk = 1 << 30
            while chunk >= 1 << 16:
                try:
                    filler.append(torch.empty(chunk, dtype=torch.uint8, device=device))
                except torch.OutOfMemoryError:
                    chunk //= 2
            try:
                got = [t.clone() for t in tensors(fast(*args))]
            except torch.OutOfMemoryError:
                got = None
            finally:
                filler.clear()
                torch.cuda.empty_cache()
            if got is not None:
                same(got, expected, f"{target_name} on a full device")
            still_works(target, fast, generator, "after out of memory during capture")
            same(fast(*args), expected, f"{target_name}: the shape whose capture ran out of memory")

    return check


def _replace_weights(model: nn.Module, device: str) -> None:
    """`load_state_dict(..., assign=True)` with other values: every parameter and buffer a new tensor."""
    generator = torch.Generator().manual_seed(7)
    state = {name: torch.randn(t.shape, generator=generator).to(device, t.dtype) if t.is_floating_point() else t.clone()
             for name, t in model.state_dict().items()}
    model.load_state_dict(state, assign=True)


def _move_weights(model: nn.Module, device: str) -> None:
    """The weights' memory moves to the CPU and comes back."""
    model.cpu().to(device)


def _swap_data(model: nn.Module, device: str) -> None:
    """`param.data = ...` with new values for every parameter."""
    for parameter in model.parameters():
        parameter.data = torch.randn_like(parameter)


MODULE_CHANGES = {
    "weights_replaced": _replace_weights,
    "weights_moved": _move_weights,
    "weights_data_swapped": _swap_data,
}
"""Changes to a graphed module after capture that its graphs, reading tensors where they were, must not miss. CUDA
only: the null backend's replays run the function again, so they cannot read old weights (`tests/graphs/
test_module_state.py` tests the checks on the CPU)."""


def _module_change(target_name: str, change: str) -> Callable[[str], None]:
    """A graphed module's weights changed after its graph was captured (the old memory filled with NaN where it
    was freed): the next calls give eager's result with the new weights."""

    def check(device: str) -> None:
        target = _target(target_name, device)
        generator = torch.Generator().manual_seed(8)
        fast = _graph(target, device)
        with torch.inference_mode():
            args = target.good(generator, 6)
            fast(*args)
            MODULE_CHANGES[change](target.fn, device)
            filler = fill_freed_memory(device)
            differential(target.fn, fast, args, f"{target_name} after {change}")
            still_works(target, fast, generator, f"{target_name} after {change}")
            del filler

    return check


def fill_freed_memory(device: str) -> torch.Tensor:
    """NaN in the CUDA caching allocator's free blocks, so reads of freed weights show."""
    free = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    return torch.full((max(free // 4 - (1 << 16), 1),), float("nan"), device=device)


def _other_cases() -> Iterator[BadCase]:
    yield BadCase("aliased_arguments", _aliased_arguments)
    yield BadCase("unkeyable_and_grad", _unkeyable_and_grad)
    yield BadCase("interrupt_in_warmup", _interrupted_capture(1))
    yield BadCase("interrupt_in_capture", _interrupted_capture(2))
    yield BadCase("bad_options", _bad_options)
    yield BadCase("mask_disagrees_with_ids", _mask_disagrees_with_ids)
    for target_name in ("mlp", "conv", "gpt2"):
        yield BadCase(f"oom_during_capture_{target_name}", _oom_during_capture(target_name), ("cuda",))
        for change in MODULE_CHANGES:
            yield BadCase(f"{target_name}-{change}", _module_change(target_name, change), ("cuda",))


def graphed_cases() -> list[BadCase]:
    """Every bad-input case of graphed callables."""
    return [*_graphed_cases(), *_other_cases()]
