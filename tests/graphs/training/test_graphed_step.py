"""Graphed training steps on the CPU through the null backend (whose capture, wrapped by `simulated.Recording`,
records without running, as CUDA's does): after 20 steps, parameters and optimizer state equal a plain eager
loop's bit for bit, with buckets and several shapes, gradient accumulation, and fallbacks recorded in stats."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import tendril
from benchmarks.hf_training_steps import wav2vec2_buckets
from tendril.config import Config
from tendril.graphs.admission import GraphFallbackWarning
from tendril.graphs.backend import CaptureFailed, NullBackend
from tendril.graphs.stats import Fallback
from tendril.graphs.syncs import find_host_syncs
from tendril.graphs.training import step as step_module
from tests.graphs.training.loops import (
    SEQ_BUCKETS,
    TokenMLP,
    assert_identical,
    batches,
    full_step,
    micro_step,
    padded,
    state_of,
    twins,
)

LENGTHS = [3, 8, 4, 7, 2, 5, 8, 1, 6, 4] * 2
"""20 steps over 8 lengths: two buckets (4, 8) reached from several lengths each."""


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True, capturable=True)


def graphed(fn, model, optimizer, **options):
    options.setdefault("backend", NullBackend())
    return tendril.graphed_step(fn, model=model, optimizer=optimizer, config=Config(), **options)


def eager_loop(model, optimizer, data):
    step = full_step(model, optimizer)
    return [step(*batch) for batch in data]


@pytest.mark.parametrize("buckets", [SEQ_BUCKETS, None], ids=["buckets", "exact-shapes"])
def test_twenty_steps_equal_the_eager_loop_exactly(buckets):
    model, reference = twins(TokenMLP)
    optimizer, reference_optimizer = adamw(model), adamw(reference)
    data = batches(LENGTHS)
    expected_losses = eager_loop(reference, reference_optimizer, padded(data, buckets))
    step = graphed(full_step(model, optimizer), model, optimizer, buckets=buckets)
    losses = [step(*batch) for batch in data]
    assert_identical(state_of(model, optimizer), state_of(reference, reference_optimizer))
    assert torch.equal(torch.stack(losses), torch.stack(expected_losses))
    stats = step.stats
    assert stats.warmup_steps + stats.replays + stats.eager_calls == stats.calls == 20  # one step per call
    assert stats.eager_calls == 0
    # a key is captured at its second call, after one warm-up step: every length comes twice
    assert len(step.keys()) == (2 if buckets is not None else len(set(LENGTHS)))
    assert all(int(s["step"].item()) == 20 for s in optimizer.state.values())
    if buckets is not None:
        assert stats.padded_calls > 0


def test_capture_ahead_of_time_largest_first_takes_no_step_and_every_later_call_replays():
    model, reference = twins(TokenMLP)
    optimizer, reference_optimizer = adamw(model), adamw(reference)
    data = batches(LENGTHS)
    expected_losses = eager_loop(reference, reference_optimizer, padded(data, SEQ_BUCKETS))
    step = graphed(full_step(model, optimizer), model, optimizer, buckets=SEQ_BUCKETS)
    losses = [step(*data[0])]
    before = {name: tensor.clone() for name, tensor in state_of(model, optimizer).items()}
    assert step.capture(batches([2, 8, 3])) == 2
    assert_identical(state_of(model, optimizer), before)
    captured = step.keys()
    assert [key.tensors[0].shape[1] for key in captured] == [8, 4]
    losses += [step(*batch) for batch in data[1:]]
    assert step.stats.replays == len(data) - 1 and step.stats.eager_calls == 0
    assert_identical(state_of(model, optimizer), state_of(reference, reference_optimizer))
    assert torch.equal(torch.stack(losses), torch.stack(expected_losses))
    assert step.capture(batches([1, 5])) == 0


def test_capture_ahead_of_time_needs_the_optimizer_state():
    model, _ = twins(TokenMLP)
    optimizer = adamw(model)
    step = graphed(full_step(model, optimizer), model, optimizer, buckets=SEQ_BUCKETS)
    with pytest.raises(RuntimeError, match="call the graphed step once first"):
        step.capture(batches([4]))


def test_a_first_step_the_scaler_skips_warms_again_and_the_key_is_captured_once_the_optimizer_has_state():
    def scaler():  # the first scaled loss overflows; the backoff brings the scale to 3e8 for the second step
        return tendril.DeviceGradScaler("cpu", init_scale=3e38, backoff_factor=1e-30)

    model, reference = twins(TokenMLP)

    def sgd(module):  # momentum: the optimizer has state only after its first step
        return torch.optim.SGD(module.parameters(), lr=1e-2, momentum=0.9)

    optimizer, reference_optimizer = sgd(model), sgd(reference)
    data = batches([4] * 6)
    reference_scaler, step_scaler = scaler(), scaler()
    for batch in data:
        full_step(reference, reference_optimizer, reference_scaler)(*batch)
    step = graphed(full_step(model, optimizer, step_scaler), model, optimizer, scaler=step_scaler)
    for batch in data:
        step(*batch)
    assert step.stats.warmup_steps == 2 and step.stats.eager_calls == 0 and step.stats.replays == 4
    assert_identical(state_of(model, optimizer), state_of(reference, reference_optimizer))
    assert step_scaler.get_scale() == reference_scaler.get_scale() < 1e9


def test_the_eager_reference_pads_the_arguments_the_buckets_name():
    buckets = wav2vec2_buckets((8, 16))
    audio, mask, labels = torch.randn(2, 5), torch.ones(2, 5, dtype=torch.long), torch.tensor([[3, -100], [4, 5]])
    [(padded_audio, padded_mask, same_labels)] = padded([(audio, mask, labels)], buckets, ("audio", "mask", "labels"))
    assert padded_audio.shape == padded_mask.shape == (2, 8) and same_labels is labels
    assert torch.equal(padded_audio[:, :5], audio) and not padded_mask[:, 5:].any()
    with pytest.raises(ValueError, match=r"pad \['audio', 'mask'\], not parameters of the step"):
        padded([(audio, mask, labels)], buckets)


def test_gradient_accumulation_updates_every_nth_call_exactly_as_eager():
    parts = 4
    model, reference = twins(TokenMLP)
    optimizer, reference_optimizer = adamw(model), adamw(reference)
    data = batches(LENGTHS)
    micro = micro_step(reference, parts)
    for index, batch in enumerate(padded(data, SEQ_BUCKETS)):
        micro(*batch)
        if (index + 1) % parts == 0:
            reference_optimizer.step()
            reference_optimizer.zero_grad(set_to_none=False)
    step = graphed(micro_step(model, parts), model, optimizer, buckets=SEQ_BUCKETS, accumulate=parts)
    for batch in data:
        step(*batch)
    assert_identical(state_of(model, optimizer), state_of(reference, reference_optimizer))
    assert step.stats.optimizer_updates == 5
    assert all(int(s["step"].item()) == 5 for s in optimizer.state.values())
    captured = step.keys()
    assert any(key.structure[0] == "optimizer update" for key in captured)


def test_a_failed_capture_runs_the_step_eagerly_once_with_the_reason_in_stats():
    model, reference = twins(TokenMLP)
    optimizer, reference_optimizer = adamw(model), adamw(reference)
    data = batches([4] * 6)
    eager_loop(reference, reference_optimizer, data)
    backend = NullBackend(fail=lambda key: CaptureFailed(Fallback.HOST_SYNC, "simulated sync"))
    step = graphed(full_step(model, optimizer), model, optimizer, backend=backend)
    with pytest.warns(GraphFallbackWarning, match="simulated sync"):
        for batch in data:
            step(*batch)
    assert_identical(state_of(model, optimizer), state_of(reference, reference_optimizer))
    assert step.stats.fallbacks[Fallback.HOST_SYNC] == 5  # the two captures' calls and every later one
    assert step.stats.warmup_steps == 1 and not step.keys()


def test_a_capture_that_fails_once_is_captured_at_the_keys_next_call_without_a_warning(recwarn):
    model, reference = twins(TokenMLP)
    optimizer, reference_optimizer = adamw(model), adamw(reference)
    data = batches([4] * 6)
    eager_loop(reference, reference_optimizer, data)
    failures = [CaptureFailed(Fallback.HOST_SYNC, "a compiler benchmarked its new kernels")]
    backend = NullBackend(fail=lambda key: failures.pop() if failures else None)
    step = graphed(full_step(model, optimizer), model, optimizer, backend=backend)
    for batch in data:
        step(*batch)
    assert_identical(state_of(model, optimizer), state_of(reference, reference_optimizer))
    assert step.stats.fallbacks[Fallback.HOST_SYNC] == 1 and len(step.keys()) == 1 and step.stats.replays == 4
    assert not step.stats.failed_keys and not step.stats.host_syncs
    assert not [w for w in recwarn if issubclass(w.category, GraphFallbackWarning)]


def test_host_syncs_are_looked_for_only_after_a_capture_failed_and_then_once_naming_their_place(monkeypatch):
    checked = []
    monkeypatch.setattr(step_module, "find_host_syncs", lambda *a, **k: checked.append(1) or find_host_syncs(*a, **k))
    model, _ = twins(TokenMLP)
    optimizer = adamw(model)
    plain = full_step(model, optimizer)
    seen = []

    def logs_the_loss(x, y):
        loss = plain(x, y)
        seen.append(loss.item())  # a host sync on CUDA
        return loss

    step = graphed(logs_the_loss, model, optimizer)  # the null backend's capture cannot fail on a sync
    for batch in batches([4] * 4):
        step(*batch)
    assert step.keys() and not step.stats.host_syncs and not checked

    model, _ = twins(TokenMLP)
    optimizer = adamw(model)
    plain = full_step(model, optimizer)
    backend = NullBackend(fail=lambda key: CaptureFailed(Fallback.HOST_SYNC, "capture invalidated"))
    step = graphed(logs_the_loss, model, optimizer, backend=backend)
    with pytest.warns(GraphFallbackWarning, match="capture invalidated"):
        for batch in batches([4] * 5):
            step(*batch)
    assert not step.keys() and step.stats.fallbacks[Fallback.HOST_SYNC] == 4 and len(checked) == 1
    detail = step.stats.fallback_details[Fallback.HOST_SYNC]
    assert "capture invalidated" in detail and "test_graphed_step.py" in detail and "item" in detail
    assert "test_graphed_step.py" in next(iter(step.stats.host_syncs.values()))


def test_steps_before_a_capture_run_with_no_mode_active_so_a_compiled_model_finishes_compiling_there():
    """A torch function or dispatch mode (as `find_host_syncs` uses) changes what `torch.compile` traces: a warm-up
    step under one would leave the model's real compilation, and its kernel autotuning, which synchronises, to the
    capture."""
    model, _ = twins(TokenMLP)
    optimizer = adamw(model)
    plain = full_step(model, optimizer)
    modes = []

    def watched(x, y):
        modes.append(len(_get_current_function_mode_stack()) + len(_get_current_dispatch_mode_stack()))
        return plain(x, y)

    step = graphed(watched, model, optimizer)
    for batch in batches([4, 4, 6, 6, 4]):
        step(*batch)
    assert step.stats.warmup_steps == 2 and len(modes) >= 5 and set(modes) == {0}


def test_keys_past_max_graphs_and_the_eager_path_without_cuda_are_recorded():
    model, reference = twins(TokenMLP)
    optimizer, reference_optimizer = adamw(model), adamw(reference)
    data = batches([4, 4, 4, 6, 6, 6])
    eager_loop(reference, reference_optimizer, data)
    step = graphed(full_step(model, optimizer), model, optimizer, max_graphs=1)
    with pytest.warns(GraphFallbackWarning, match="max_graphs"):
        for batch in data:
            step(*batch)
    assert_identical(state_of(model, optimizer), state_of(reference, reference_optimizer))
    assert step.stats.fallbacks[Fallback.LIMIT] == 3 and len(step.keys()) == 1

    model, reference = twins(TokenMLP)
    optimizer, reference_optimizer = adamw(model), adamw(reference)
    eager_loop(reference, reference_optimizer, data)
    step = tendril.graphed_step(full_step(model, optimizer), model=model, optimizer=optimizer, config=Config())
    with pytest.warns(GraphFallbackWarning):
        for batch in data:
            step(*batch)
    assert_identical(state_of(model, optimizer), state_of(reference, reference_optimizer))
    assert step.stats.eager_calls == 6 and (Fallback.NO_CUDA in step.stats.fallbacks or step.stats.replays == 0)


def test_train_and_eval_modes_are_separate_keys():
    model, _ = twins(TokenMLP)
    optimizer = adamw(model)
    step = graphed(full_step(model, optimizer), model, optimizer)
    for batch in batches([4] * 3):
        step(*batch)
    model.eval()
    for batch in batches([4] * 3):
        step(*batch)
    captured = step.keys()
    assert len(captured) == 2 and {key.structure[1] for key in captured} == {(True, True), (False, False)}


def test_a_dropout_layer_switched_alone_selects_a_graph_of_its_own():
    """Monte Carlo style: the root stays in training while its dropout layer runs in eval mode (the dropout layer's
    mode is baked into a graph: a graph captured with it on would keep dropping)."""
    model, _ = twins(lambda: TokenMLP(dropout=0.3))
    optimizer = adamw(model)
    step = graphed(full_step(model, optimizer), model, optimizer)
    for batch in batches([4] * 3):
        step(*batch)
    model.net[2].eval()
    for batch in batches([4] * 3):
        step(*batch)
    captured = step.keys()
    assert [key.structure[1] for key in captured] == [(True, True), (True, False)]


@pytest.mark.parametrize("change", ["load_state_dict_assign", "data_swapped", "cast_and_back"])
def test_replacing_or_moving_the_models_tensors_after_the_step_was_made_raises_naming_the_tensor(change):
    """The gradients, the optimizer's state and the graphs hold the old tensors: the next graphed call refuses."""
    model, other = twins(TokenMLP)
    optimizer = adamw(model)
    step = graphed(full_step(model, optimizer), model, optimizer)
    data = batches([4] * 3)
    for batch in data:
        step(*batch)
    if change == "load_state_dict_assign":
        model.load_state_dict(other.state_dict(), assign=True)
    elif change == "data_swapped":
        model.net[0].weight.data = model.net[0].weight.data.clone()
    else:
        model.double().float()
    named = r"parameter net\.\d\.(weight|bias) (was replaced|moved).*make the optimizer"
    with pytest.raises(RuntimeError, match=named):
        step(*data[0])


def test_with_dropout_on_the_graphed_loop_draws_the_eager_loops_masks():
    """The simulated capture puts the generator back as a CUDA capture leaves it, so each replay draws the numbers
    the eager step would have drawn."""
    model, reference = twins(lambda: TokenMLP(dropout=0.3))
    optimizer, reference_optimizer = adamw(model), adamw(reference)
    data = batches([4, 6] * 5)
    torch.manual_seed(5)
    expected = eager_loop(reference, reference_optimizer, data)
    torch.manual_seed(5)
    step = graphed(full_step(model, optimizer), model, optimizer)
    losses = [step(*batch) for batch in data]
    assert step.stats.replays >= 4
    assert torch.equal(torch.stack(losses), torch.stack(expected))
    assert_identical(state_of(model, optimizer), state_of(reference, reference_optimizer))
