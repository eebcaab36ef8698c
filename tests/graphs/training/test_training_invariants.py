"""What graphed training steps refuse or check, with the fix in the message: non-capturable optimizers, a GradScaler
that would sync, gradients set to None, settings changed after capture; and the device-side grad scaler, whose
skipped steps equal torch's GradScaler's exactly. CPU, through the null backend."""

from __future__ import annotations

import pytest
import torch

import tendril
from tendril.config import Config
from tendril.graphs.backend import NullBackend
from tendril.graphs.syncs import find_host_syncs
from tendril.graphs.training import invariants
from tendril.graphs.training.scaler import DeviceGradScaler, check_scaler
from tests.graphs.training.loops import TokenMLP, assert_identical, batches, full_step, state_of, twins


def graphed(fn, model, optimizer, **options):
    return tendril.graphed_step(fn, model=model, optimizer=optimizer, backend=NullBackend(), config=Config(), **options)


def test_non_capturable_optimizers_are_refused_naming_the_fix():
    model = TokenMLP()
    with pytest.raises(ValueError, match=r"capturable=True"):
        graphed(lambda x: x, model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match=r"fused=True alone is not enough"):
        graphed(lambda x: x, model, torch.optim.AdamW(model.parameters(), fused=True))
    with pytest.raises(ValueError, match="not capturable"):
        graphed(lambda x: x, model, torch.optim.RMSprop(model.parameters()))
    with pytest.raises(TypeError, match="optimizer must be"):
        graphed(lambda x: x, model, object())
    for ok in (
        torch.optim.AdamW(model.parameters(), capturable=True),
        torch.optim.Adam(model.parameters(), fused=True, capturable=True),
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
    ):
        invariants.check_optimizer(ok)


def test_a_grad_scaler_that_syncs_is_refused_and_bad_options_name_the_argument():
    model = TokenMLP()
    capturable = torch.optim.AdamW(model.parameters(), capturable=True)
    with pytest.raises(ValueError, match=r"found_inf.item\(\).*DeviceGradScaler"):
        check_scaler(torch.amp.GradScaler("cpu"), capturable)
    check_scaler(DeviceGradScaler("cpu"), capturable)
    check_scaler(torch.amp.GradScaler("cpu"), torch.optim.AdamW(model.parameters(), fused=True, capturable=True))
    check_scaler(torch.amp.GradScaler("cpu", enabled=False), capturable)
    fused = torch.optim.AdamW(model.parameters(), fused=True, capturable=True)
    with pytest.raises(ValueError, match="accumulate"):
        graphed(lambda x: x, model, fused, accumulate=0)
    for bad in (2.5, True):
        with pytest.raises(ValueError, match="max_graphs must be an integer"):
            graphed(lambda x: x, model, fused, max_graphs=bad)
    with pytest.raises(ValueError, match="accumulate= needs optimizer"):
        graphed(lambda x: x, model, None, accumulate=2)
    with pytest.raises(TypeError, match="model must be"):
        graphed(lambda x: x, object(), fused)
    with pytest.raises(ValueError, match="memory="):
        tendril.graphed_step(lambda x: x, model=model, optimizer=fused, backend=NullBackend(), memory="1GiB")


def test_gradients_are_allocated_up_front_and_setting_them_to_none_is_refused():
    model = TokenMLP()
    optimizer = torch.optim.AdamW(model.parameters(), fused=True, capturable=True)
    assert all(p.grad is None for p in model.parameters())

    def clears_to_none(x, y):
        optimizer.zero_grad()  # set_to_none=True by default
        loss = (model(x) - y).square().sum()
        loss.backward()
        optimizer.step()
        return loss

    step = graphed(clears_to_none, model, optimizer)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    with pytest.raises(RuntimeError, match=r"set_to_none=False"):
        step(*batches([4])[0])


def test_changing_a_float_setting_after_capture_raises():
    model = TokenMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True, capturable=True)
    step = graphed(full_step(model, optimizer), model, optimizer)
    data = batches([4] * 4)
    for batch in data[:3]:
        step(*batch)
    assert step.keys()
    optimizer.param_groups[0]["lr"] = 5e-3
    with pytest.raises(RuntimeError, match=r"lr.*tensor"):
        step(*data[3])


def overflowing(data, at):
    """`data` with an infinite input in batch `at` (its gradients overflow: the step must be skipped)."""
    x, y = data[at]
    x = x.clone()
    x[0, 0, 0] = float("inf")
    return [*data[:at], (x, y), *data[at + 1 :]]


def test_the_device_grad_scaler_skips_overflowing_steps_as_grad_scaler_does():
    model, reference = twins(TokenMLP)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)  # noqa: E731
    optimizer, reference_optimizer = sgd(model), sgd(reference)
    scaler, reference_scaler = DeviceGradScaler("cpu", init_scale=256.0), torch.amp.GradScaler("cpu", init_scale=256.0)
    data = overflowing(overflowing(batches([4] * 10), 0), 6)  # the first step (no state yet) and a later one
    reference_step = full_step(reference, reference_optimizer, reference_scaler)
    device_step = full_step(model, optimizer, scaler)
    for batch in data:
        reference_step(*batch)
        device_step(*batch)
    assert_identical(state_of(model, optimizer), state_of(reference, reference_optimizer))
    assert scaler.get_scale() == reference_scaler.get_scale() < 256.0


def test_the_device_grad_scaler_step_reads_nothing_on_the_host_once_the_optimizer_has_state():
    model = TokenMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = DeviceGradScaler("cpu", init_scale=256.0)
    step = full_step(model, optimizer, scaler)
    first, second = batches([4, 4])
    assert find_host_syncs(step, *first)  # no state to restore yet: GradScaler's host check
    assert not find_host_syncs(step, *second)
    assert find_host_syncs(full_step(model, optimizer, torch.amp.GradScaler("cpu")), *second)


def test_a_graphed_amp_step_with_overflows_equals_the_eager_loop():
    model, reference = twins(TokenMLP)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)  # noqa: E731
    optimizer, reference_optimizer = sgd(model), sgd(reference)
    scaler, reference_scaler = DeviceGradScaler("cpu", init_scale=256.0), DeviceGradScaler("cpu", init_scale=256.0)
    data = overflowing(batches([4, 6] * 10), 13)
    reference_step = full_step(reference, reference_optimizer, reference_scaler)
    for batch in data:
        reference_step(*batch)
    step = graphed(full_step(model, optimizer, scaler), model, optimizer, scaler=scaler)
    for batch in data:
        step(*batch)
    assert len(step.keys()) == 2 and step.stats.eager_calls == 0
    assert_identical(state_of(model, optimizer), state_of(reference, reference_optimizer))
    assert scaler.get_scale() == reference_scaler.get_scale()


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (dict(init_scale=0.0), "init_scale"),
        (dict(init_scale=-8.0), "init_scale"),
        (dict(init_scale=float("nan")), "init_scale"),
        (dict(growth_interval=0), "growth_interval"),
        (dict(growth_interval=1.5), "growth_interval"),
    ],
)
def test_a_device_grad_scaler_refuses_a_scale_or_interval_that_would_silently_stop_training(options, named):
    with pytest.raises(ValueError, match=named):
        DeviceGradScaler("cpu", **options)
