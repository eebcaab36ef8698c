import json

import pytest
import torch

from benchmarks import registry
from benchmarks.__main__ import main, run_case
from benchmarks.registry import Context, Goal
from tendril.utils.timing import time_callable


@pytest.fixture
def fake_case():
    name = "fake-cpu-case"

    @registry.register(name, "a CPU-only case for testing the runner", needs_gpu=False)
    def run(ctx: Context) -> None:
        x = torch.randn(64, 64)
        ctx.add_timing("matmul", time_callable(torch.mm, [(x, x)], device=ctx.device, warmup=1, reps=5))
        ctx.add_value("matmul", "bytes", 64 * 64 * 4)
        ctx.target("speedup_fake", 2.0, Goal(">=", 5))
        ctx.target("ratio_fake", 0.5)
        ctx.note("fake note")

    yield name
    registry.CASES.pop(name)


def test_run_writes_json_and_markdown_with_the_contract_fields(fake_case, tmp_path):
    run_case(fake_case, quick=True, out_dir=tmp_path, command="python -m benchmarks run fake-cpu-case")
    result = json.loads((tmp_path / f"{fake_case}.json").read_text())
    for key in ("case", "command", "device", "driver", "torch", "date", "rows", "targets"):
        assert key in result
    assert result["case"] == fake_case
    assert result["rows"][0]["variant"] == "matmul"
    assert set(result["rows"][0]) == {"variant", "metric", "median", "p10", "p90", "n"}
    assert result["rows"][0]["n"] == 5 and result["rows"][0]["median"] > 0
    assert result["targets"] == {"speedup_fake": 2.0, "ratio_fake": 0.5}
    assert result["goals"]["speedup_fake"] == {"goal": ">= 5", "met": False}
    md = (tmp_path / f"{fake_case}.md").read_text()
    assert "`speedup_fake`" in md and "**no**" in md and "fake note" in md


def test_a_failing_case_still_writes_what_it_measured(tmp_path):
    name = "fake-failing-case"

    @registry.register(name, "measures one value, then fails", needs_gpu=False)
    def run(ctx: Context) -> None:
        ctx.add_value("first model", "MiB", 12.0)
        raise RuntimeError("device-side assert triggered")

    try:
        with pytest.raises(RuntimeError, match="device-side assert"):
            run_case(name, quick=True, out_dir=tmp_path, command="cmd")
    finally:
        registry.CASES.pop(name)
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["error"] == "RuntimeError: device-side assert triggered"
    assert result["rows"][0]["variant"] == "first model"
    assert "partial: the case failed" in (tmp_path / f"{name}.md").read_text()


def test_list_shows_registered_cases(fake_case, capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert fake_case in out and "launch-overhead" in out


def test_unknown_case_and_gpu_case_on_cpu_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown benchmark case 'nope'"):
        run_case("nope", True, tmp_path, "cmd")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs an NVIDIA GPU"):
            run_case("launch-overhead", True, tmp_path, "cmd")


def test_goal_rejects_unknown_operators_and_targets_are_reported_once():
    with pytest.raises(ValueError):
        Goal("~", 1)
    ctx = Context(device=torch.device("cpu"), quick=True)
    ctx.target("a", 1)
    with pytest.raises(ValueError, match="reported twice"):
        ctx.target("a", 2)


def test_merge_unites_a_case_run_in_parts(fake_case, tmp_path):
    for part in ("a", "b"):
        run_case(fake_case, quick=True, out_dir=tmp_path / part, command=f"run part {part}")
    first = json.loads((tmp_path / "a" / f"{fake_case}.json").read_text())
    second = json.loads((tmp_path / "b" / f"{fake_case}.json").read_text())
    second["targets"] = {"other_target": 3.0}
    second["goals"] = {"other_target": {"goal": "<= 4", "met": True}}
    second["extra"] = {"per_model": {"vgg16": 1}}
    first["extra"] = {"per_model": {"resnet50": 2}}
    (tmp_path / "a" / f"{fake_case}.json").write_text(json.dumps(first))
    (tmp_path / "b" / f"{fake_case}.json").write_text(json.dumps(second))
    assert main(["merge", fake_case, str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "m")]) == 0
    merged = json.loads((tmp_path / "m" / f"{fake_case}.json").read_text())
    assert merged["targets"] == {"speedup_fake": 2.0, "ratio_fake": 0.5, "other_target": 3.0}
    assert merged["goals"]["other_target"]["met"] and not merged["goals"]["speedup_fake"]["met"]
    assert merged["extra"] == {"per_model": {"resnet50": 2, "vgg16": 1}}
    assert len(merged["rows"]) == len(first["rows"]) + len(second["rows"])
    assert merged["command"] == "run part a && run part b"
    assert "`other_target`" in (tmp_path / "m" / f"{fake_case}.md").read_text()


def test_merge_keeps_the_worst_value_of_a_target_several_parts_set(fake_case, tmp_path):
    from benchmarks import results

    run_case(fake_case, quick=True, out_dir=tmp_path, command="cmd")
    part = json.loads((tmp_path / f"{fake_case}.json").read_text())
    part["targets"] = {"error": 0.01, "speedup": 2.0}
    part["goals"] = {"error": {"goal": "<= 0.02", "met": True}, "speedup": {"goal": ">= 1.5", "met": True}}
    worse = {**part, "targets": {"error": 0.03, "speedup": 1.2},
             "goals": {"error": {"goal": "<= 0.02", "met": False}, "speedup": {"goal": ">= 1.5", "met": False}}}
    merged = results.merge([part, worse, part])
    assert merged["targets"] == {"error": 0.03, "speedup": 1.2}
    assert not merged["goals"]["error"]["met"] and not merged["goals"]["speedup"]["met"]
    assert part["goals"]["error"]["met"], "merge must not change its parts"


def test_merge_refuses_parts_that_set_one_target_twice_or_differ_in_case(fake_case, tmp_path):
    from benchmarks import results

    run_case(fake_case, quick=True, out_dir=tmp_path, command="cmd")
    part = json.loads((tmp_path / f"{fake_case}.json").read_text())
    part["targets"] = {"no_goal": 1.0}
    part["goals"] = {}
    with pytest.raises(ValueError, match="more than one part"):
        results.merge([part, part])
    other_goal = {**part, "goals": {"no_goal": {"goal": ">= 2", "met": False}}}
    with pytest.raises(ValueError, match="more than one part"):
        results.merge([other_goal, {**other_goal, "goals": {"no_goal": {"goal": ">= 3", "met": False}}}])
    with pytest.raises(ValueError, match="cannot merge"):
        results.merge([part, {**part, "case": "another", "targets": {}}])
