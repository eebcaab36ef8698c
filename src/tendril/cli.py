"""The `tendril` command: `tendril demo` and `tendril info`."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    import torch


def _info(console: Console) -> int:
    from tendril.info import collect

    table = Table(title="tendril info", show_header=False)
    for key, value in collect().rows():
        table.add_row(key, value)
    console.print(table)
    return 0


def _device(name: str) -> torch.device:
    """`--device`: "cpu", or a CUDA device this machine has ("cuda", "cuda:1")."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{name!r} is not a torch device; use 'cpu' or 'cuda[:index]'") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{name!r}: the demo runs on 'cpu' or 'cuda[:index]'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{name!r}: no CUDA device here (torch.cuda.is_available() is False)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def _demo(console: Console, quick: bool, device: torch.device | None) -> int:
    import torch

    from tendril.demo import sections

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        console.print(
            "[bold yellow]No NVIDIA GPU here:[/] running tendril's CPU paths only. "
            "Graphed execution and the GPU kernels need an NVIDIA GPU with CUDA."
        )
    failed = []
    for section in sections():
        try:
            result = section.run(device, quick)
        except Exception as error:  # one broken section must not hide the others; reported, and exit 1
            failed.append(section.title)
            console.print(f"[bold red]{section.title}: failed with {type(error).__name__}: {error}[/]")
            continue
        table = Table(title=f"{result.title} ({device})")
        for column in ("variant", "what", "median ms", "speedup", "checked"):
            table.add_column(column, justify="right" if column in ("median ms", "speedup") else "left")
        for row in result.rows:
            speedup = result.speedup(row)
            table.add_row(
                row.variant,
                row.detail,
                "-" if row.ms is None else f"{row.ms:.3f}",
                "-" if speedup is None else f"{speedup:.2f}x",
                row.check,
            )
        console.print(table)
        for note in result.notes:
            console.print(f"  {note}")
    if failed:
        console.print(f"[bold red]{len(failed)} demo section(s) failed: {', '.join(failed)}[/]")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tendril", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="side-by-side demo of tendril against what users do today")
    demo.add_argument("--quick", action="store_true", help="fewer repetitions (noisier numbers)")
    demo.add_argument("--device", type=_device, help="run on 'cpu' or 'cuda[:index]' (default: cuda if available, "
                      "else cpu)")
    commands.add_parser("info", help="versions, GPU, driver and CUDA feature support")
    args = parser.parse_args(argv)
    console = Console()
    if args.command == "info":
        return _info(console)
    return _demo(console, args.quick, args.device)


if __name__ == "__main__":
    sys.exit(main())
