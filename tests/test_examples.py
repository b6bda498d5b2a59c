"""Every example runs as documented."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_quickstart_runs_and_resumes(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    cmd = [sys.executable, str(REPO / "examples" / "quickstart.py"), str(root)]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    assert "finished at step 200, tokens_seen=1600" in first.stdout
    assert sorted(p.name for p in root.glob("step-*")) == ["step-100", "step-150", "step-200"]
    # A second run resumes at 200 and has nothing left to do; the counters come back with it.
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    assert "finished at step 200, tokens_seen=1600" in again.stdout
