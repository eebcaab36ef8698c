"""The CUDA C++ sources NVRTC compiles live in `.cu` files beside their launchers, shipped as package data: each
is found and non-empty, defines the kernel its launcher asks NVRTC for, and uses every `-D` define the launcher
passes it."""

from __future__ import annotations

import re
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch

from tendril.sparse.format import ConvGeometry
from tendril.sparse.ops.conv.cartesian_cuda import kernel as cartesian_cuda
from tendril.sparse.ops.conv.register import planner, source

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "tendril"
CUDA_FILES = sorted([*PACKAGE.rglob("*.cu"), *PACKAGE.rglob("*.cuh")])


def _geometry(kernel: int, stride: int, padding: int) -> ConvGeometry:
    return ConvGeometry.of(torch.nn.Conv2d(16, 32, kernel, stride, padding), (14, 14))


def _register_options() -> list[tuple[str, ...]]:
    """The defines of every plan the planner ranks for a 3×3 and a strided 1×1 layer (2-D tiles and pixel runs)."""
    plans = [p for g in (_geometry(3, 1, 1), _geometry(1, 2, 0)) for p in planner.candidates(g, 0.3, 132)]
    assert any(p.pixel_run for p in plans) and not all(p.pixel_run for p in plans)
    return [source.compile_options(p) for p in plans]


def _defines(options: tuple[str, ...]) -> list[str]:
    assert all(option.startswith("-D") and "=" in option for option in options), options
    return [option[2:].split("=")[0] for option in options]


def test_every_cuda_file_is_package_data_and_not_empty():
    tomllib = pytest.importorskip("tomllib")
    assert CUDA_FILES
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["*"]
    for path in CUDA_FILES:
        assert path.read_text(encoding="utf-8").strip(), path
        assert any(fnmatch(path.name, pattern) for pattern in patterns), path


@pytest.mark.parametrize(
    ("module", "options"),
    [(cartesian_cuda, [cartesian_cuda.compile_options()]), (source, _register_options())],
    ids=["cartesian_cuda", "register"],
)
def test_a_launcher_compiles_its_file_defining_its_kernel_and_using_its_defines(module, options):
    path = Path(module.__file__).with_name(module.SOURCE_FILE)
    assert path in CUDA_FILES
    text = module.source()
    assert text == path.read_text(encoding="utf-8")
    assert re.search(rf'extern "C" __global__ void(\s+__launch_bounds__\([^)]*\))?\s+{module.KERNEL_NAME}\(', text)
    for names in {tuple(_defines(o)) for o in options}:
        unused = [name for name in names if not re.search(rf"\b{name}\b", text)]
        assert not unused, f"{module.SOURCE_FILE} never reads the defines {unused}"
