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
