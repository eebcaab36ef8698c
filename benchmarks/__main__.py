"""Command line of the benchmark runner (`list`, `run`, `merge`, `plot`); see `benchmarks/__init__.py`."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch
from rich.console import Console

from benchmarks import plots, registry, results

RESULTS_DIR = Path(__file__).parent / "results"


def run_case(name: str, quick: bool, out_dir: Path, command: str, device: str | None = None) -> dict:
    cases = registry.discover()
    if name not in cases:
        raise SystemExit(f"unknown benchmark case {name!r}; known: {', '.join(sorted(cases)) or 'none'}")
    case = cases[name]
    chosen = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if case.needs_gpu and chosen.type != "cuda":
        raise SystemExit(f"benchmark case {name!r} needs an NVIDIA GPU; run it on the device lane")
    ctx = registry.Context(device=chosen, quick=quick)
    try:
        case.run(ctx)
    except Exception as error:
        # what was measured before the failure is kept (a device-side fault late in a long case loses nothing)
        partial = results.build(name, command, ctx, error=f"{type(error).__name__}: {error}")
        results.write(partial, out_dir)
        raise
    result = results.build(name, command, ctx)
    results.write(result, out_dir)
    return result


def plot_case(name: str, results_dir: Path, console: Console) -> bool:
    """Draw `results_dir/name.png` from `name.json`; False (with one line saying why) when it cannot."""
    if not plots.available():
        console.print(plots.INSTALL_HINT, markup=False)
        return False
    json_path = results_dir / f"{name}.json"
    if not json_path.exists():
        raise SystemExit(f"no results file {json_path}")
    png_path = plots.plot_file(json_path)
    done = f"wrote {png_path}" if png_path else f"no plot for {name!r}; plots exist for {', '.join(plots.PLOTS)}"
    console.print(done, markup=False)
    return png_path is not None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="list benchmark cases")
    run = commands.add_parser("run", help="run one case and write NAME.json and NAME.md")
    run.add_argument("name")
    run.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    run.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"output folder (default {RESULTS_DIR})")
    run.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    merge = commands.add_parser("merge", help="unite NAME.json of a case run in parts (one folder each) into one")
    merge.add_argument("name")
    merge.add_argument("parts", type=Path, nargs="+", help="the folders holding each part's NAME.json")
    merge.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"output folder (default {RESULTS_DIR})")
    plot = commands.add_parser("plot", help="draw NAME.png from NAME.json (needs matplotlib)")
    plot.add_argument("name", help="a results file's name without .json, e.g. graphs-memory")
    plot.add_argument("--results", type=Path, default=RESULTS_DIR, help=f"its folder (default {RESULTS_DIR})")
    args = parser.parse_args(argv)
    console = Console()
    if args.command == "list":
        for case in sorted(registry.discover().values(), key=lambda c: c.name):
            console.print(f"{case.name:28s} {'GPU' if case.needs_gpu else 'any'}  {case.description}", soft_wrap=True)
        return 0
    if args.command == "plot":
        return 0 if plot_case(args.name, args.results, console) else 1
    if args.command == "merge":
        parts = [json.loads((folder / f"{args.name}.json").read_text()) for folder in args.parts]
        merged = results.merge(parts)
        results.write(merged, args.out)
        console.print(results.markdown(merged))
        if merged["case"] in plots.PLOTS:
            plot_case(args.name, args.out, console)
        return 0
    command = "python -m benchmarks " + shlex.join(argv)
    result = run_case(args.name, args.quick, args.out, command, args.device)
    console.print(results.markdown(result))
    if result["case"] in plots.PLOTS:
        plot_case(args.name, args.out, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
