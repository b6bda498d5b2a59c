"""``import safepoint`` never imports a framework: each is an optional extra, imported by its integration
module alone."""

from __future__ import annotations

import subprocess

from tests.conftest import PYTHON, SUBPROCESS_ENV

CHECK = """
import sys
import safepoint, safepoint.integrations, safepoint.data.replay
loaded = sorted(m for m in ("accelerate", "transformers", "peft", "torchtitan") if m in sys.modules)
assert not loaded, loaded
import safepoint.integrations.accelerate
assert "accelerate" not in sys.modules  # it reads the accelerator's attributes: no import needed
"""


def test_importing_safepoint_imports_no_framework() -> None:
    done = subprocess.run(
        [PYTHON, "-c", CHECK], capture_output=True, text=True, env=SUBPROCESS_ENV, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
