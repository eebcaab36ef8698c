"""Calls of one graphed callable from several threads (`tendril.graphs.turns`): an overlapping call raises, or with
`clone_outputs=True` waits its turn; calls that run eagerly before any graph is involved never wait. CPU, through the
null backend."""

import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

from tendril.config import Config
from tendril.graphs.backend import NullBackend
from tendril.graphs.callable import graphed
from tendril.graphs.turns import Turns


def _blocking(fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Callable[[torch.Tensor], torch.Tensor],
                                                                     threading.Event, threading.Event]:
    """`fn`, which signals `entered` and waits for `release` when called on a tensor of 3 rows."""
    entered, release = threading.Event(), threading.Event()

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 3:
            entered.set()
            assert release.wait(10)
        return fn(x)

    return run, entered, release


def _in_thread(call: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=call)
    thread.start()
    return thread


def test_a_call_overlapping_another_raises():
    fn, entered, release = _blocking(lambda x: x * 2)
    fast = graphed(fn, backend=NullBackend(), config=Config())
    first = _in_thread(lambda: fast(torch.ones(3, 4)))
    assert entered.wait(10)
    with pytest.raises(RuntimeError, match=r"second thread.*clone_outputs=True"):
        fast(torch.ones(2, 4))
    release.set()
    first.join()
    torch.testing.assert_close(fast(torch.ones(2, 4)), torch.full((2, 4), 2.0))


def test_with_cloned_outputs_threads_take_turns_and_get_their_own_results():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).eval()
    fast = graphed(model, backend=NullBackend(), config=Config(), clone_outputs=True)
    inputs = [torch.randn(8, 64) for _ in range(4)]
    wrong: list[int] = []

    def work(index: int) -> None:
        with torch.inference_mode():
            expected = model(inputs[index])
            for _ in range(100):
                if not torch.equal(fast(inputs[index]), expected):
                    wrong.append(index)
                    return

    threads = [_in_thread(lambda i=i: work(i)) for i in range(4)]
    for thread in threads:
        thread.join()
    assert wrong == [] and fast.stats.replays >= 390


def test_callables_that_run_eagerly_never_wait():
    fn, entered, release = _blocking(lambda x: x + 1)
    fast = graphed(fn, backend=NullBackend(), config=Config(disable_graphs=True))
    with pytest.warns(UserWarning):
        first = _in_thread(lambda: fast(torch.ones(3, 4)))
        assert entered.wait(10)
        torch.testing.assert_close(fast(torch.ones(2, 4)), torch.full((2, 4), 2.0))
    release.set()
    first.join()


def test_eager_calls_in_grad_mode_may_overlap():
    fn, entered, release = _blocking(lambda x: x * 3)
    fast = graphed(fn, backend=NullBackend(), config=Config())
    with pytest.warns(UserWarning, match="requires grad"):
        first = _in_thread(lambda: fast(torch.ones(3, 4, requires_grad=True)))
        assert entered.wait(10)
        assert fast(torch.ones(2, 4, requires_grad=True)).grad_fn is not None
    release.set()
    first.join()


def test_a_call_on_the_thread_that_holds_the_turn_passes():
    turns = Turns("f", wait=False, active=True)
    with turns, turns:
        other = []
        thread = _in_thread(lambda: other.append(_enter(turns)))
        thread.join()
    assert other == ["RuntimeError"]
    assert _enter(turns) == "entered"


def _enter(turns: Turns) -> str:
    try:
        with turns:
            return "entered"
    except RuntimeError:
        return "RuntimeError"
