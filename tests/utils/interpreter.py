"""Running a module of checks in a fresh process under Triton's CPU interpreter (TRITON_INTERPRET is read when
Triton is imported, so the checks cannot run in the test process itself)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(module: str, marker: str) -> None:
    """Run `python -m module` with TRITON_INTERPRET=1 from the repository root; fail unless it exits cleanly and
    prints `marker` (so a module that checks nothing cannot pass)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    result = subprocess.run([sys.executable, "-m", module], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert marker in result.stdout, result.stdout
