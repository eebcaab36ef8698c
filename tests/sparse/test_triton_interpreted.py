"""The Triton kernels (compress, conv, linear) and a converted network, under the Triton interpreter."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_triton_kernels_match_their_references_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    result = subprocess.run(
        [sys.executable, "-m", "tests.sparse.interpreted"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "interpreted checks passed" in result.stdout
