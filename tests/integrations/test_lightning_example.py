"""examples/lightning_train.py as the contract (issue 25): real processes, real signals, a DataLoader with 2
worker processes. After kill -9 of the process group or SIGTERM to it (workers included), the restart's
first step is the newest committed step + 1, every loss equals the uninterrupted run's bit for bit, after
SIGTERM no printed step is lost (exit code 143), and every root passes ``safepoint verify``.

The default suite runs one SIGTERM and resume (three launches of a job that imports Lightning); the kill -9
runs, a SIGTERM at an epoch boundary and the ``pytorch_lightning`` import path are ``-m slow``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, SUBPROCESS_ENV

EXAMPLE = REPO / "examples" / "lightning_train.py"
STEP = re.compile(r"^step (\d+) loss (\S+)$", re.M)
pytestmark = pytest.mark.timeout(600)
STEPS = 20  # 12 batches an epoch: one boundary crossed


def _losses(text: str) -> dict[int, str]:
    """step -> loss as printed (repr of the float: equal strings are equal bits)."""
    out: dict[int, str] = {}
    for n, loss in STEP.findall(text):
        assert out.setdefault(int(n), loss) == loss, f"step {n} printed twice with different losses"
    return out


def _steps(text: str) -> list[int]:
    return [int(n) for n, _ in STEP.findall(text)]


def _cmd(root: Path, steps: int, sleep: float = 0.0, module: str = "lightning") -> list[str]:
    cmd = [sys.executable, str(EXAMPLE), "--root", str(root), "--steps", str(steps), "--save-every", "4"]
    cmd += ["--step-sleep", str(sleep)] if sleep else []
    if module == "pytorch_lightning":  # the same job through the other import path
        shim = root.parent / "pl_shim.py"
        shim.write_text(
            "import runpy, sys\n"
            "import pytorch_lightning, safepoint.integrations.lightning_pl as pl_cb\n"
            "sys.modules['lightning'] = pytorch_lightning\n"
            "sys.modules['safepoint.integrations.lightning'] = pl_cb\n"
            "sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"
        )
        cmd.insert(1, str(shim))
    return cmd


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, env=SUBPROCESS_ENV, timeout=400)


def _interrupt(cmd: list[str], out: Path, after_step: int, sig: int) -> tuple[int, str]:
    """Start ``cmd`` in its own process group; once it printed ``after_step``, send ``sig`` to the group."""
    with out.open("w") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=SUBPROCESS_ENV, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 400
            while after_step not in _steps(out.read_text()):
                assert proc.poll() is None, out.read_text()[-3000:]
                assert time.monotonic() < deadline, "the job printed nothing in time"
                time.sleep(0.05)
            os.killpg(proc.pid, sig)
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return code, out.read_text()


def _committed(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if (p / "safepoint.json").exists())


def _verify(root: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "safepoint.cli.main", "verify", str(root), "--all"],
        capture_output=True, text=True, env=SUBPROCESS_ENV,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """The uninterrupted run's losses (STEPS steps: 12 batches an epoch, so it crosses an epoch boundary)."""
    root = tmp_path_factory.mktemp("reference") / "ckpt"
    res = _run(_cmd(root, STEPS))
    assert res.returncode == 0, res.stderr[-3000:]
    losses = _losses(res.stdout)
    assert sorted(losses) == list(range(1, STEPS + 1))
    _verify(root)
    return losses


def _sigterm_then_resume(
    tmp_path: Path, reference: dict[int, str], at: int, module: str = "lightning"
) -> None:
    root = tmp_path / "ckpt"
    code, first = _interrupt(
        _cmd(root, STEPS, sleep=0.2, module=module), tmp_path / "first.txt", at, signal.SIGTERM
    )
    assert code == 143, first[-3000:]  # preempted, never "succeeded" (Lightning's own exit is code 0)
    printed = _steps(first)
    assert "emergency save of step" in first
    assert _committed(root)[-1] == printed[-1]  # no printed step is lost
    second = _run(_cmd(root, STEPS, module=module))
    assert second.returncode == 0, second.stderr[-3000:]
    assert _steps(second.stdout)[0] == printed[-1] + 1
    got = _losses(first) | _losses(second.stdout)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == reference  # every loss, bit for bit
    _verify(root)


def test_sigterm_to_the_process_group_saves_exits_143_and_resumes_bit_for_bit(
    tmp_path: Path, reference: dict[int, str]
) -> None:
    _sigterm_then_resume(tmp_path, reference, at=6)  # mid-epoch, between two periodic saves


@pytest.mark.slow
def test_sigterm_at_an_epoch_boundary(tmp_path: Path, reference: dict[int, str]) -> None:
    _sigterm_then_resume(tmp_path, reference, at=12)


@pytest.mark.slow
def test_the_pytorch_lightning_import_path(tmp_path: Path, reference: dict[int, str]) -> None:
    _sigterm_then_resume(tmp_path, reference, at=9, module="pytorch_lightning")


@pytest.mark.slow
@pytest.mark.parametrize("at", [3, 10, 17])
def test_kill_9_of_the_process_group_resumes_from_the_newest_committed_step(
    tmp_path: Path, reference: dict[int, str], at: int
) -> None:
    root = tmp_path / "ckpt"
    code, first = _interrupt(_cmd(root, STEPS, sleep=0.2), tmp_path / "first.txt", at, signal.SIGKILL)
    assert code == -signal.SIGKILL
    newest = _committed(root)[-1] if _committed(root) else 0
    assert newest <= max(_steps(first))
    second = _run(_cmd(root, STEPS))
    assert second.returncode == 0, second.stderr[-3000:]
    assert _steps(second.stdout)[0] == newest + 1
    got = _losses(second.stdout)
    assert got == {s: reference[s] for s in range(newest + 1, STEPS + 1)}
    assert {s: reference[s] for s in _losses(first)} == _losses(first)
    _verify(root)
