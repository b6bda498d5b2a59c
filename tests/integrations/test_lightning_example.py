"""examples/lightning_train.py as the contract (issue 25): real processes, real signals, a DataLoader with 2
worker processes. After kill -9 of the process group or SIGTERM to it (workers included), the restart's
first step is the newest committed step + 1, every loss equals the uninterrupted run's bit for bit, after
SIGTERM no printed step is lost (exit code 143), and every root passes ``safepoint verify``.

The default suite runs one SIGTERM and resume (three launches of a job that imports Lightning: the
uninterrupted one as ``python examples/lightning_train.py``, the others forked from the fork server of
tests/helpers/forkserver.py, which imported Lightning once); the kill -9 runs, a SIGTERM at an epoch boundary
and the ``pytorch_lightning`` import path are ``-m slow``."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from safepoint.cli.main import main as safepoint_cli
from tests.helpers.example_runs import EXAMPLES, Run, committed_steps, run_example

pytestmark = pytest.mark.timeout(600)
STEPS = 20  # 12 batches an epoch: one boundary crossed
ARGS = ("--steps", str(STEPS), "--save-every", "4")
SCRIPT = "lightning_train.py"


def _losses(run: Run) -> dict[int, str]:
    """step -> loss as printed (repr of the float: equal strings are equal bits)."""
    out: dict[int, str] = {}
    for n, loss in run.losses:
        assert out.setdefault(n, loss) == loss, f"step {n} printed twice with different losses"
    return out


def _steps(run: Run) -> list[int]:
    return [n for n, _ in run.losses]


def _script(root: Path, module: str) -> str:
    if module == "lightning":
        return SCRIPT
    # the same job through the other import path
    shim = root.parent / "pl_shim.py"
    shim.write_text(
        "import runpy, sys\n"
        "import pytorch_lightning, safepoint.integrations.lightning_pl as pl_cb\n"
        "sys.modules['lightning'] = pytorch_lightning\n"
        "sys.modules['safepoint.integrations.lightning'] = pl_cb\n"
        f"sys.argv[0] = {str(EXAMPLES / SCRIPT)!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    return str(shim)


def _verify(root: Path) -> None:
    assert safepoint_cli(["verify", str(root), "--all"]) == 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """The uninterrupted run's losses (STEPS steps: 12 batches an epoch, so it crosses an epoch boundary),
    run as a user runs it: ``python examples/lightning_train.py`` (the interrupted runs are forked from the
    fork server, tests/helpers/forkserver.py; their losses equal these, bit for bit)."""
    root = tmp_path_factory.mktemp("reference") / "ckpt"
    res = run_example(SCRIPT, root, *ARGS, fresh=True)
    assert res.returncode == 0, res.stderr[-3000:]
    losses = _losses(res)
    assert sorted(losses) == list(range(1, STEPS + 1))
    _verify(root)
    return losses


def _sigterm_then_resume(
    tmp_path: Path, reference: dict[int, str], at: int, module: str = "lightning"
) -> None:
    root = tmp_path / "ckpt"
    script = _script(root, module)
    first = run_example(script, root, *ARGS, stop_at=at, sig=signal.SIGTERM, step_sleep=0.2)
    # preempted, never "succeeded" (Lightning's own exit is code 0)
    assert first.returncode == 143, first.stderr[-3000:]
    printed = _steps(first)
    assert "emergency save of step" in first.stderr
    assert committed_steps(root)[-1] == printed[-1]  # no printed step is lost
    second = run_example(script, root, *ARGS)
    assert second.returncode == 0, second.stderr[-3000:]
    assert _steps(second)[0] == printed[-1] + 1
    got = _losses(first) | _losses(second)
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
    first = run_example(SCRIPT, root, *ARGS, stop_at=at, sig=signal.SIGKILL, step_sleep=0.2)
    assert first.returncode == -signal.SIGKILL
    newest = committed_steps(root)[-1] if committed_steps(root) else 0
    assert newest <= max(_steps(first))
    second = run_example(SCRIPT, root, *ARGS)
    assert second.returncode == 0, second.stderr[-3000:]
    assert _steps(second)[0] == newest + 1
    got = _losses(second)
    assert got == {s: reference[s] for s in range(newest + 1, STEPS + 1)}
    assert {s: reference[s] for s in _losses(first)} == _losses(first)
    _verify(root)
