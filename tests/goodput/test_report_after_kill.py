"""``safepoint report`` against what was measured from outside a real job that was SIGKILLed once: the
saves counted and timed around the calls, the step printed before the kill, the step the restart restored."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
from pathlib import Path

from safepoint.cli.main import main as cli
from tests.helpers.example_runs import spawn_job


def _run(args: list[str], *, hang: bool) -> tuple[list[str], int]:
    """tests/helpers/goodput_runs.py ``run_worker``, the worker forked from the fork server
    (tests/helpers/example_runs.py ``spawn_job``: a real process with its own session, killed with a real
    SIGKILL once it prints ``REACHED``), without a fresh interpreter's ~4.5 s of CPU per run."""
    out_r, out_w = os.pipe()
    with tempfile.TemporaryFile() as err:
        try:
            proc = spawn_job(["-m", "tests.helpers.procs.goodput_worker", *args], out_w, err.fileno())
        except BaseException:
            os.close(out_r)
            raise
        finally:
            os.close(out_w)  # the worker holds the write end now
        lines: list[str] = []
        try:
            with open(out_r) as stdout:
                for line in stdout:
                    lines.append(line.strip())
                    if hang and line.startswith("REACHED"):
                        os.kill(proc.pid, signal.SIGKILL)
                        break
            rc = proc.wait(timeout=120)
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        err.seek(0)
        if not hang:
            assert rc == 0, err.read().decode(errors="replace")[-3000:]
    return lines, rc


def _saves(lines: list[str]) -> list[tuple[int, float]]:
    return [(int(line.split()[1]), float(line.split()[2])) for line in lines if line.startswith("SAVE ")]


def test_report_matches_what_was_measured_outside_a_killed_job(tmp_path: Path, capsys: object) -> None:
    root = tmp_path / "ckpt"
    first, rc = _run([str(root), "30", "5", "13"], hang=True)
    assert rc == -signal.SIGKILL
    reached = int(next(line for line in first if line.startswith("REACHED")).split()[1])
    assert reached == 13
    second, _ = _run([str(root), "30", "5"], hang=False)
    restored = int(next(line for line in second if line.startswith("RESTORED")).split()[1])
    assert restored == 10  # the last save before the kill (every 5 steps)
    saves = _saves(first) + _saves(second)
    assert [s for s, _ in saves] == [5, 10, 15, 20, 25, 30]

    plot = tmp_path / "timeline.png"
    assert cli(["report", str(root), "--json", "--plot", str(plot)]) == 0
    report = json.loads(capsys.readouterr().out)  # type: ignore[attr-defined]
    assert report["attempts"] == 2 and report["restarts"] == 1
    assert report["saves"] == len(saves)
    assert report["steps_redone"] == reached - restored
    assert report["last_step"] == 30
    # Blocking is measured inside the calls the worker timed from outside: never more, and most of it.
    outside = sum(t for _, t in saves)
    assert 0.5 * outside <= report["blocking_s"] <= outside
    assert report["attempt_list"][0]["outcome"] in ("killed", "running or killed")
    assert report["attempt_list"][1]["restored"] == restored
    assert report["redone_s"] > 0 and report["time_lost_to_restarts_s"] >= report["redone_s"]
    assert 0 < report["goodput"] < 1
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert cli(["report", str(root)]) == 0
    text = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "2 (1 restart(s))" in text and f"redoing {reached - restored} step(s)" in text
