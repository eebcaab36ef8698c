"""Case `control-flow`: a data-dependent loop of an 8-layer MLP (batch 1), three ways, N in {10, 100, 1000}.

The loop state is (step counter, activations); it runs while the counter is below a limit held in
device memory and the activations stay bounded, so the host cannot know the trip count. Per step
the body applies the MLP (Linear + ReLU, width 256, fp32) and a tanh.

- (a) eager: PyTorch ops from Python, the exit tested with `.item()` each step (what users write);
- (b) host replay: the step (body + exit test) captured once as a CUDA graph and replayed from a
  host loop that reads the exit flag with `.item()` after each replay (what graph users do today);
- (c) tendril.while_loop captured in one CUDA graph (a WHILE conditional node): one replay runs
  the whole loop on the device.

Each call is timed with CUDA events (device time, including the gaps the host's syncs leave);
medians over repetitions, inputs rotated. `overhead_us_per_iteration` is (c)'s time per iteration at
N=1000 minus the time of one replay of the step graph of (b) measured back to back, i.e. what the
WHILE node adds per iteration over the same kernels launched as a graph. The loop classes live in
`tendril.demo.control_flow`, which shows the same comparison.
"""

from __future__ import annotations

import torch

from benchmarks.registry import Context, Goal, register
from tendril.demo.control_flow import WIDTH, DeviceLoop, HostReplayLoop, MlpLoop, mlp
from tendril.utils.timing import time_callable

STEPS = (10, 100, 1000)
INPUTS = 4


@register("control-flow", "data-dependent loop of an 8-layer MLP: eager .item() / host-replayed graph / WHILE node")
def run(ctx: Context) -> None:
    torch.manual_seed(0)
    device = ctx.device
    with torch.inference_mode():
        limit = torch.tensor(0, device=device)
        loop = MlpLoop(mlp(device), limit)
        inputs = [(torch.randn(1, WIDTH, device=device),) for _ in range(INPUTS)]
        host = HostReplayLoop(loop, inputs[0][0])
        on_device = DeviceLoop(loop, inputs[0][0])
        per_iteration_us: dict[int, float] = {}
        speedups: dict[int, tuple[float, float]] = {}
        for n in STEPS:
            limit.fill_(n)
            reps = max(3, (30 if ctx.quick else 300) // max(1, n // 10))
            _check_agreement(ctx, n, loop, host, on_device, inputs[0][0])
            eager = time_callable(loop.eager, inputs, device=device, warmup=2, reps=reps)
            replay = time_callable(host, inputs, device=device, warmup=2, reps=reps)
            whole = time_callable(on_device, inputs, device=device, warmup=2, reps=reps)
            ctx.add_timing(f"N={n} (a) eager, .item() exit check", eager)
            ctx.add_timing(f"N={n} (b) step graph replayed from host loop", replay)
            ctx.add_timing(f"N={n} (c) tendril.while_loop, one graph", whole)
            per_iteration_us[n] = whole.median_ms * 1e3 / n
            speedups[n] = (eager.median_ms / whole.median_ms, replay.median_ms / whole.median_ms)
            ctx.add_value(f"N={n} (c)", "us_per_iteration", per_iteration_us[n])
        step_us = _step_replay_us(host, device, quick=ctx.quick)
        ctx.add_value("step graph replayed back to back", "us_per_replay", step_us)
        ctx.extra["speedups_vs_eager"] = {n: s[0] for n, s in speedups.items()}
        ctx.extra["speedups_vs_host_replay"] = {n: s[1] for n, s in speedups.items()}
        ctx.target("speedup_vs_eager_sync_loop_n100", speedups[100][0], Goal(">=", 5))
        ctx.target("speedup_vs_host_replay_loop_n100", speedups[100][1], Goal(">=", 1.3))
        ctx.target("overhead_us_per_iteration", per_iteration_us[1000] - step_us, Goal("<=", 3))
        ctx.note(
            f"overhead = (c) per iteration at N=1000 ({per_iteration_us[1000]:.2f} us) minus one back-to-back "
            f"replay of the step graph ({step_us:.2f} us, same kernels plus the graph launch)"
        )


def _check_agreement(
    ctx: Context, n: int, loop: MlpLoop, host: HostReplayLoop, on_device: DeviceLoop, x: torch.Tensor
) -> None:
    ref_i, ref_h = loop.eager(x)
    ref_i, ref_h = ref_i.clone(), ref_h.clone()
    for name, fn in (("host replay", host), ("while_loop", on_device)):
        i, h = fn(x)
        if i.item() != ref_i.item():
            raise AssertionError(f"N={n}: {name} ran {i.item()} steps, eager {ref_i.item()}")
        err = (h - ref_h).abs().max().item()
        if err > 1e-4:
            raise AssertionError(f"N={n}: {name} differs from eager by {err:.2e}")
        ctx.extra.setdefault("max_abs_err_vs_eager", {})[f"{name} N={n}"] = err


def _step_replay_us(host: HostReplayLoop, device: torch.device, quick: bool) -> float:
    replays = 200

    def many() -> None:
        for _ in range(replays):
            host.step.graph.replay()

    timing = time_callable(many, device=device, warmup=1, reps=5 if quick else 20)
    return timing.median_ms * 1e3 / replays
