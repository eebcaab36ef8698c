"""Case `reliability`: the fuzzing suites of `tests/fuzz`, run programmatically, reported as totals.

Differential cases: seeded random models, dtypes, buckets, memory budgets, zero-copy and call orders, graphed
against eager (`tests.fuzz.cases`); bad-input cases: invalid, degenerate and hostile inputs, each a clear exception
or the eager result, with the callable working afterwards (`tests.fuzz.bad_inputs`, `bad_library_inputs`). On
CUDA the graphs are CUDA graphs and device memory is checked after each callable is deleted; on the CPU they run
through `NullBackend`. Each failure is noted with its seed or name and a one-line reproduction.
"""

from __future__ import annotations

import time

from benchmarks.registry import Context, Goal, register

SEEDS = 1000
QUICK_SEEDS = 40
_DETAIL_CHARS = 600


@register("reliability", "differential fuzzing of graphed calls against eager, and bad inputs", needs_gpu=False)
def run(ctx: Context) -> None:
    # the suites live in the repository's tests (imported here, so listing the cases needs no test tree)
    from tests.fuzz.bad_inputs import graphed_cases, run_bad_case
    from tests.fuzz.bad_library_inputs import library_cases
    from tests.fuzz.cases import draw_case, run_case

    device = ctx.device.type
    seeds = QUICK_SEEDS if ctx.quick else SEEDS
    # cases sharing a model build run together, so each build serves all of them
    cases = sorted((draw_case(seed) for seed in range(seeds)),
                   key=lambda case: (case.model, str(case.structure), str(case.dtype), case.seed))
    start = time.perf_counter()
    statuses = {"ok": 0, "mismatch": 0, "crash": 0, "skipped": 0}
    leaked = 0
    failures: list[str] = []
    for done, case in enumerate(cases):
        if done % 100 == 0:
            print(f"reliability: {done} of {len(cases)} differential cases, {time.perf_counter() - start:.0f} s")
        outcome = run_case(case, device)
        statuses[outcome.status] += 1
        leaked = max(leaked, outcome.leaked_bytes)
        if outcome.failed:
            failures.append(outcome.message()[:_DETAIL_CHARS])
            ctx.note(outcome.message()[:_DETAIL_CHARS])
    ctx.add_value("differential", "seconds", time.perf_counter() - start)

    start = time.perf_counter()
    bad = {"ok": 0, "silent_wrong": 0, "crash": 0}
    for bad_case in [*graphed_cases(), *library_cases()]:
        if device not in bad_case.devices:
            continue
        bad_outcome = run_bad_case(bad_case, device)
        bad[bad_outcome.status] += 1
        if bad_outcome.status != "ok":
            failures.append(bad_outcome.message()[:_DETAIL_CHARS])
            ctx.note(bad_outcome.message()[:_DETAIL_CHARS])
    ctx.add_value("bad inputs", "seconds", time.perf_counter() - start)

    ctx.extra.update(differential=statuses, bad_inputs=bad, failures=failures)
    if device != "cuda":
        ctx.note("graphs ran on NullBackend (CPU): no CUDA graphs, memory budgets or device-memory checks")
    ctx.target("differential_cases", statuses["ok"] + statuses["mismatch"] + statuses["crash"], Goal(">=", 1000))
    ctx.target("mismatches", statuses["mismatch"], Goal("<=", 0))
    ctx.target("crashes", statuses["crash"] + bad["crash"], Goal("<=", 0))
    ctx.target("bad_input_cases", sum(bad.values()), Goal(">=", 100))
    ctx.target("silent_wrong_answers", bad["silent_wrong"], Goal("<=", 0))
    ctx.target("leaked_mib_after_delete", leaked / 2**20, Goal("<=", 1))
