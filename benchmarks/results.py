"""Writing a case's results: `NAME.json` (the contract other tools read) and `NAME.md` (for people)."""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path
from typing import Any

from benchmarks.registry import Context


def machine() -> dict[str, str]:
    import torch

    from tendril.cuda.runtime import driver_version_text
    from tendril.info import gpu_name

    cpu = "CPU" if not torch.cuda.is_available() else gpu_name()
    return {"device": cpu, "driver": driver_version_text(), "torch": torch.__version__}


def build(case: str, command: str, ctx: Context, error: str | None = None) -> dict[str, Any]:
    """The results of a case; `error` marks a case that failed after measuring `ctx`'s rows (partial)."""
    return {
        "case": case,
        "command": command,
        **machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": ctx.quick,
        "rows": [dataclasses.asdict(row) for row in ctx.rows],
        "targets": ctx.targets,
        "goals": {name: {"goal": str(goal), "met": goal.met(ctx.targets[name])} for name, goal in ctx.goals.items()},
        "notes": ctx.notes,
        "extra": ctx.extra,
        **({"error": error} if error is not None else {}),
    }


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from the results of one case run in parts (e.g. one model per device call, chosen by the case's
    environment variable): rows and notes in order, targets, goals and `extra` united. The parts must be of one
    case, on one kind of device (`ValueError`). A target with a goal that several parts set (an aggregate such as
    the largest error over models) takes its worst value under that goal; one without a goal may be set once."""
    if not parts:
        raise ValueError("merge needs at least one result")
    case = parts[0]["case"]
    for part in parts:
        if part["case"] != case:
            raise ValueError(f"cannot merge results of {case!r} and {part['case']!r}")
        if (part["device"], part["torch"]) != (parts[0]["device"], parts[0]["torch"]):
            raise ValueError(f"{case}: parts ran on different devices or torch versions: "
                             f"{parts[0]['device']} / {parts[0]['torch']} and {part['device']} / {part['torch']}")
    targets: dict[str, Any] = {}
    goals: dict[str, Any] = {}
    for part in parts:
        for name, value in part["targets"].items():
            goal = part["goals"].get(name)
            if name not in targets:
                targets[name] = value
                if goal is not None:
                    goals[name] = dict(goal)
                continue
            if goal is None or goals.get(name, {}).get("goal") != goal["goal"]:
                raise ValueError(f"{case}: target {name!r} is set by more than one part without one goal")
            higher_is_worse = goal["goal"].startswith("<")
            targets[name] = (max if higher_is_worse else min)(targets[name], value)
            goals[name]["met"] = goals[name]["met"] and goal["met"]
    extra: dict[str, Any] = {}
    for part in parts:
        _unite(extra, part.get("extra", {}), case)
    errors = [part["error"] for part in parts if "error" in part]
    return {
        "case": case,
        "command": " && ".join(part["command"] for part in parts),
        **{key: parts[0][key] for key in ("device", "driver", "torch")},
        "date": max(part["date"] for part in parts),
        "quick": any(part["quick"] for part in parts),
        "rows": [row for part in parts for row in part["rows"]],
        "targets": targets,
        "goals": goals,
        "notes": [note for part in parts for note in part["notes"]],
        "extra": extra,
        **({"error": "; ".join(errors)} if errors else {}),
    }


def _unite(into: dict[str, Any], part: dict[str, Any], case: str) -> None:
    """`part`'s entries added to `into`, nested dictionaries united; one key with two other values is an error."""
    for key, value in part.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _unite(into[key], value, case)
        elif key in into and into[key] != value:
            raise ValueError(f"{case}: the parts disagree on extra[{key!r}]")
        else:
            into[key] = value


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# Benchmark `{result['case']}`",
        "",
        f"- command: `{result['command']}`",
        f"- device: {result['device']}; driver: {result['driver']}; torch {result['torch']}; {result['date']}",
        *([f"- **partial: the case failed** with {result['error']}"] if "error" in result else []),
        "",
        "| variant | metric | median | p10 | p90 | n |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['variant']} | {row['metric']} | {row['median']:.4g} | {row['p10']:.4g} "
            f"| {row['p90']:.4g} | {row['n']} |"
        )
    if result["targets"]:
        lines += ["", "| target | value | goal | met |", "|---|---:|---|---|"]
        for name, value in result["targets"].items():
            goal = result["goals"].get(name)
            met = "-" if goal is None else ("yes" if goal["met"] else "**no**")
            lines.append(f"| `{name}` | {value:.4g} | {goal['goal'] if goal else '-'} | {met} |")
    if result["notes"]:
        lines += ["", *[f"- {note}" for note in result["notes"]]]
    for title, table in result.get("extra", {}).get("markdown_tables", {}).items():  # a case's own tables
        lines += ["", f"## {title}", "", *table]
    return "\n".join(lines) + "\n"


def write(result: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{result['case']}.json"
    md_path = out_dir / f"{result['case']}.md"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    md_path.write_text(markdown(result))
    return json_path, md_path
