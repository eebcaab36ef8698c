"""Graphed training steps on CUDA against eager loops: a small MLP, a tiny GPT-2 LM fine-tune and a tiny Wav2Vec2 CTC
step; fp32 within 1e-5 relative after 20 steps, AMP within 1e-3, dropout drawing new masks at every replay."""

from __future__ import annotations

import contextlib
import copy
import inspect
from typing import Any, NamedTuple

import pytest
import torch
from torch.nn.attention import sdpa_kernel

import tendril
from benchmarks.hf_training_steps import (
    ONE_ATTENTION_KERNEL,
    gpt2_batch,
    gpt2_buckets,
    gpt2_model,
    gpt2_step,
    max_rel_diff,
    rel_diffs,
    wav2vec2_batch,
    wav2vec2_buckets,
    wav2vec2_model,
    wav2vec2_step,
)
from tendril.config import Config
from tendril.graphs.capture import GRAPH_SDPA_BACKENDS
from tendril.graphs.cuda_backend import CudaBackend
from tendril.graphs.stats import Fallback
from tests.graphs.training.loops import (
    SEQ_BUCKETS,
    TokenMLP,
    assert_within,
    batches,
    full_step,
    padded,
    state_of,
    twins,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def no_tf32_convolutions(monkeypatch):
    """fp32 convolutions in full precision: with TF32 (cuDNN's default in PyTorch), eager and captured runs may pick
    different algorithms whose results differ by TF32's rounding, above the fp32 tolerance."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
LENGTHS = [3, 8, 4, 7, 2, 5, 8, 1, 6, 4] * 2


class Both(NamedTuple):
    graphed: dict[str, torch.Tensor]
    eager: dict[str, torch.Tensor]
    step: Any
    eager_again: dict[str, torch.Tensor] | None = None
    trace: list[str] | None = None


class StepRecord(NamedTuple):
    """One step of a traced run: what ran (warm-up, capture, replay, eager), its loss and loss scale (0 without a
    scaler), and the state after it."""

    kind: str
    loss: float
    scale: float
    state: dict[str, torch.Tensor]


def _record(kind: str, loss: torch.Tensor, scaler: Any, model, optimizer) -> StepRecord:
    scale = 0.0 if scaler is None else float(scaler.get_scale())
    state = {name: tensor.clone() for name, tensor in state_of(model, optimizer).items()}
    return StepRecord(kind, float(loss), scale, state)


def _parting(graphed: list[StepRecord], eager: list[StepRecord], shown: int = 4) -> list[str]:
    """The first `shown` steps after which the graphed run's state differs from the eager run's: what the step
    ran, the largest relative difference and where, the two losses and loss scales."""
    lines = []
    for index, (ours, theirs) in enumerate(zip(graphed, eager, strict=True)):
        diffs = rel_diffs(ours.state, theirs.state)
        name, worst = next(iter(diffs.items()))
        if worst > 0 and len(lines) < shown:
            lines.append(f"step {index} ({ours.kind}): {worst:.3g} in {name}; loss {ours.loss:.6g} / {theirs.loss:.6g}"
                         f"; scale {ours.scale:g} / {theirs.scale:g}")
    return lines


def _eager_run(model, make_optimizer, make_step, data, buckets, scaler, trace=False, attention=GRAPH_SDPA_BACKENDS):
    """The steps eagerly on the padded batches, with the attention kernels graphs use (`attention`): the final
    state, and with `trace` every step's `StepRecord`."""
    optimizer = make_optimizer(model)
    step_scaler = None if scaler is None else scaler()
    eager = make_step(model, optimizer, step_scaler)
    records = []
    with sdpa_kernel(list(attention)):
        for batch in padded(data, buckets, tuple(inspect.signature(eager).parameters)):
            loss = eager(*batch)
            if trace:
                records.append(_record("eager", loss, step_scaler, model, optimizer))
    return state_of(model, optimizer), records


def _kind(before: tuple[int, int], step) -> str:
    warmups, graphs = step.stats.warmup_steps, len(step.stats.graphs)
    return "warm-up" if warmups > before[0] else "capture" if graphs > before[1] else "replay"


def run_both(make_model, make_optimizer, make_step, data, buckets, scaler=None, ahead=None, eager_twice=False,
             trace=False, attention=GRAPH_SDPA_BACKENDS) -> Both:
    """The steps eagerly and graphed; the two states and the graphed step. `ahead`: batches the graphed step
    captures ahead of time (`capture`) after its first call. `eager_twice`: a second eager run from the same
    weights (`eager_again`), the floor that the kernels' run-to-run noise sets. `trace`: keep every step's state
    in both runs, and name in `Both.trace` the first steps after which they part (`_parting`). `attention`: the
    attention kernels both runs may use."""
    model, reference = make_model()
    eager, eager_records = _eager_run(reference, make_optimizer, make_step, data, buckets, scaler, trace, attention)
    eager_again = None
    if eager_twice:
        eager_again = _eager_run(make_model()[1], make_optimizer, make_step, data, buckets, scaler, False, attention)[0]
    optimizer = make_optimizer(model)
    step_scaler = None if scaler is None else scaler()
    records = []
    with sdpa_kernel(list(attention)):
        step = tendril.graphed_step(
            make_step(model, optimizer, step_scaler), model=model, optimizer=optimizer, scaler=step_scaler,
            buckets=buckets, backend=CudaBackend(attention), config=Config(),
        )  # fmt: skip
        for index, batch in enumerate(data):
            before = step.stats.warmup_steps, len(step.stats.graphs)
            loss = step(*batch)
            if trace:
                records.append(_record(_kind(before, step), loss, step_scaler, model, optimizer))
            if index == 0 and ahead is not None:
                assert step.capture(ahead) == len(ahead), step.stats.table()
    torch.cuda.synchronize()
    assert step.stats.replays >= 10 and step.stats.eager_calls == 0, step.stats.table()
    parting = _parting(records, eager_records) if trace else None
    return Both(state_of(model, optimizer), eager, step, eager_again, parting)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_mlp_fp32_matches_eager_after_20_steps(fused):
    make_optimizer = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, capturable=True, fused=fused)  # noqa: E731
    both = run_both(
        lambda: twins(TokenMLP, "cuda"), make_optimizer, full_step, batches(LENGTHS, "cuda"), SEQ_BUCKETS
    )
    assert_within(both.graphed, both.eager, 1e-5)


@pytest.mark.parametrize("scaler", ["grad-scaler-fused", "device-grad-scaler-capturable"])
def test_mlp_amp_matches_eager_after_20_steps(scaler):
    fused = scaler == "grad-scaler-fused"
    make_scaler = (lambda: torch.amp.GradScaler("cuda")) if fused else (lambda: tendril.DeviceGradScaler("cuda"))
    make_optimizer = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, capturable=True, fused=fused)  # noqa: E731

    def amp_step(model, optimizer, grad_scaler):
        plain = full_step(model, optimizer, grad_scaler)

        def step(x, y):
            with torch.autocast("cuda", torch.float16):
                return plain(x, y)

        return step

    both = run_both(
        lambda: twins(TokenMLP, "cuda"), make_optimizer, amp_step, batches(LENGTHS, "cuda"), SEQ_BUCKETS, make_scaler
    )
    assert_within(both.graphed, both.eager, 1e-3)


def test_tiny_gpt2_lm_fine_tune_matches_eager():
    generator = torch.Generator().manual_seed(0)
    data = [gpt2_batch(n, 2, 1000, generator) for n in [20, 33, 64, 50, 17, 40, 64, 30, 9, 60] * 2]
    both = run_both(
        lambda: _twins(gpt2_model),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True, capturable=True),
        gpt2_step,
        data,
        gpt2_buckets((32, 64)),
    )
    assert_within(both.graphed, both.eager, 1e-5)


def test_tiny_gpt2_amp_with_overflowing_steps_skipped_inside_replays_matches_eager():
    """A loss scale of 2**30 overflows fp16 gradients for about twenty steps: most of the steps GradScaler skips
    (on the device, in the fused optimizer) and the scale halvings are replays, then real updates follow. At this
    learning rate, from random weights, two eager runs already part (the attention backward's atomics, scaled up by
    Adam): the graphed run must stay within twice that, or 1e-3."""
    both = _tiny_gpt2_amp_twice(repeats=3, init_scale=2.0**30)
    assert_within(both.graphed, both.eager, max(1e-3, 2 * max_rel_diff(both.eager_again, both.eager)), both.trace)


def test_tiny_gpt2_amp_under_deterministic_algorithms_matches_eager_within_1e_3():
    """The benchmark's correctness setting: eager and graphed runs under torch's deterministic algorithms (the
    graphs capture them without a fallback), where the eager run's own noise is gone."""
    from benchmarks.cases.graphs_training import deterministic_algorithms

    found: list[str] = []
    with deterministic_algorithms(found):
        both = _tiny_gpt2_amp_twice(repeats=2, init_scale=2.0**16)
    assert max_rel_diff(both.eager_again, both.eager) == 0.0, found  # deterministic indeed
    assert_within(both.graphed, both.eager, 1e-3, both.trace)


def test_tiny_wav2vec2_ctc_step_matches_eager():
    generator = torch.Generator().manual_seed(0)
    data = [wav2vec2_batch(n, 2, 8, 32, generator) for n in [4000, 8000, 6000, 8000, 3000] * 4]
    both = run_both(
        lambda: _twins(wav2vec2_model),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True, capturable=True),
        wav2vec2_step,
        data,
        wav2vec2_buckets((4000, 8000)),
    )
    assert_within(both.graphed, both.eager, 1e-5)


def test_wav2vec2_captured_ahead_largest_first_matches_eager_and_reuses_the_largest_graphs_memory():
    generator = torch.Generator().manual_seed(0)
    data = [wav2vec2_batch(n, 2, 8, 32, generator) for n in [4000, 8000, 6000, 8000, 3000] * 4]
    both = run_both(
        lambda: _twins(wav2vec2_model),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True, capturable=True),
        wav2vec2_step,
        data,
        wav2vec2_buckets((4000, 6000, 8000)),
        ahead=[wav2vec2_batch(n, 2, 8, 32, generator) for n in (3000, 5000, 8000)],
    )
    assert both.step.stats.replays == len(data) - 1, both.step.stats.table()
    assert_within(both.graphed, both.eager, 1e-5)
    largest, *smaller = both.step.stats.graphs.values()
    assert sum(r.pool_growth_bytes for r in smaller) <= 0.25 * largest.pool_growth_bytes, both.step.stats.table()


def test_dropout_draws_new_masks_at_every_replay():
    torch.manual_seed(0)
    model = TokenMLP(dropout=0.5).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, fused=True, capturable=True)
    masks = torch.zeros(5, 2, 4, 16, device="cuda")
    calls = {"n": 0}
    slot = torch.zeros((), dtype=torch.long, device="cuda")

    def step(x, y):
        kept = torch.nn.functional.dropout(torch.ones(2, 4, 16, device="cuda"), 0.5)
        masks.index_copy_(0, slot.view(1), kept.unsqueeze(0))
        slot.add_(1).remainder_(masks.shape[0])
        calls["n"] += 1
        return full_step(model, optimizer)(x, y)

    fast = tendril.graphed_step(step, model=model, optimizer=optimizer, config=Config())
    x, y = batches([4], "cuda")[0]
    for _ in range(8):
        fast(x, y)
    torch.cuda.synchronize()
    assert fast.stats.replays >= 5 and calls["n"] < 8  # replays ran no Python
    distinct = {tuple(m.flatten().tolist()) for m in masks}
    assert len(distinct) == masks.shape[0]
    losses = torch.stack([fast(x, y) for _ in range(20)])
    assert losses.unique().numel() > 1  # dropout in the model varies too


def test_with_dropout_on_replays_draw_the_eager_steps_numbers():
    """Each replay starts from the generator's offset and advances it by the graph's total, so with the same seed
    a graphed loop draws exactly the masks an eager loop draws (see `tendril.graphs.training`)."""
    model, reference = twins(lambda: TokenMLP(dropout=0.3), "cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True, fused=True)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, capturable=True, fused=True)
    data = batches([4, 6] * 10, "cuda")
    torch.manual_seed(5)
    eager = full_step(reference, reference_optimizer)
    expected = torch.stack([eager(*batch) for batch in data])
    torch.manual_seed(5)
    step = tendril.graphed_step(full_step(model, optimizer), model=model, optimizer=optimizer, config=Config())
    losses = torch.stack([step(*batch) for batch in data])
    assert step.stats.replays >= 14
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    assert_within(state_of(model, optimizer), state_of(reference, reference_optimizer), 1e-5)


def test_the_loss_with_dropout_tracks_eager_over_50_steps():
    generator = torch.Generator().manual_seed(0)
    data = [gpt2_batch(n, 4, 1000, generator) for n in [24, 32, 17, 30] * 13][:50]

    def losses(graphed: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = gpt2_model(dropout=0.1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
        step = gpt2_step(model, optimizer)
        if graphed:
            step = tendril.graphed_step(step, model=model, optimizer=optimizer, buckets=gpt2_buckets((32,)))
        return torch.stack([step(*batch) for batch in data])

    with sdpa_kernel(list(GRAPH_SDPA_BACKENDS)):
        eager, fast = losses(False), losses(True)
    assert abs(fast[-10:].mean() - eager[-10:].mean()) <= 0.05 * eager[-10:].mean()


def test_a_step_that_syncs_runs_eagerly_with_the_place_in_stats():
    model = TokenMLP().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
    plain = full_step(model, optimizer)
    logged = []

    def logs_the_loss(x, y):
        loss = plain(x, y)
        logged.append(loss.item())
        return loss

    step = tendril.graphed_step(logs_the_loss, model=model, optimizer=optimizer, config=Config())
    with pytest.warns(tendril.GraphFallbackWarning):
        for batch in batches([4] * 5, "cuda"):
            step(*batch)
    assert len(logged) == 5 and not step.keys() and step.stats.warmup_steps == 1
    assert step.stats.fallbacks[Fallback.HOST_SYNC] == 4
    assert "test_graphed_step_gpu.py" in step.stats.fallback_details[Fallback.HOST_SYNC]


def test_a_key_warms_with_the_attention_kernels_its_capture_uses():
    """cuDNN attention, PyTorch's choice outside `GRAPH_SDPA_BACKENDS`, would warm kernels (or, in a compiled model,
    compile a graph) that the capture does not use."""
    model = TokenMLP().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
    plain = full_step(model, optimizer)
    cudnn_attention = []

    def noted(x, y):
        cudnn_attention.append(torch.backends.cuda.cudnn_sdp_enabled())
        return plain(x, y)

    step = tendril.graphed_step(noted, model=model, optimizer=optimizer, config=Config())
    for batch in batches([4] * 3, "cuda"):
        step(*batch)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    assert cudnn_attention == [False, False] and step.stats.replays == 2, step.stats.table()


def _tiny_gpt2_amp_twice(repeats: int, init_scale: float) -> Both:
    """`run_both` of tiny GPT-2 AMP LM steps (lr 1e-3, lengths 9-64 in two buckets, `repeats` times ten batches),
    with a second eager run."""
    generator = torch.Generator().manual_seed(0)
    data = [gpt2_batch(n, 2, 1000, generator) for n in [20, 33, 64, 50, 17, 40, 64, 30, 9, 60] * repeats]
    return run_both(
        lambda: _twins(gpt2_model),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True, capturable=True),
        lambda model, optimizer, scaler: gpt2_step(model, optimizer, scaler, amp=True),
        data,
        gpt2_buckets((32, 64)),
        lambda: torch.amp.GradScaler("cuda", init_scale=init_scale),
        eager_twice=True,
        trace=True,
        attention=ONE_ATTENTION_KERNEL,
    )


def _twins(make):
    torch.manual_seed(0)
    model = make()
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("on_device", [True, False], ids=["layerdrop_on_device", "host LayerDrop"])
def test_layerdrop_drawn_on_the_device_drops_other_layers_at_every_replay(on_device):
    """At learning rate 0 and dropout 0 one batch's loss changes between steps only through LayerDrop. Drawn on the
    device, the replays of one graph drop other layers from step to step; drawn on the host (HF's way), each
    replay repeats what was drawn while capturing, which `graphed_step` warns of."""
    from tendril.graphs.training import HostLayerDropWarning, layerdrop_on_device

    torch.manual_seed(0)
    model = wav2vec2_model()
    model.config.layerdrop = 0.5
    if on_device:
        layerdrop_on_device(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, fused=True, capturable=True)
    with pytest.warns(HostLayerDropWarning) if not on_device else contextlib.nullcontext():
        step = tendril.graphed_step(wav2vec2_step(model, optimizer), model=model, optimizer=optimizer,
                                    buckets=wav2vec2_buckets((8000,)))  # fmt: skip
    batch = wav2vec2_batch(8000, 2, 8, 32, torch.Generator().manual_seed(0))
    losses = [float(step(*batch)) for _ in range(14)]
    assert step.stats.eager_calls == 0 and step.stats.replays >= 10, step.stats.table()
    replayed = set(losses[len(losses) - step.stats.replays :])
    assert len(replayed) > 1 if on_device else len(replayed) == 1, losses
