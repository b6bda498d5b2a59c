"""examples/production_template.py under real torchrun with 2 ranks (gloo on CPU): one rank is killed with
``kill -9`` (torchrun restarts both), then SIGTERM goes to torchrun's agent (emergency save, exit 143), then
a new launch resumes; its final checkpoint equals an uninterrupted run's bitwise, every section included
(model, EMA, optimizer, scheduler, data position, counters, RNG).

Every kill is sequenced by the files the script writes (its ``--heartbeat`` files and the committed
``step-N`` directories), never by sleeping. The run that gets interrupted has no end in reach (``--steps``
far away), so it cannot finish before the test acts; the resumed and reference runs stop at the same
``--until`` step.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import fsspec
import pytest

from tests.conftest import REPO
from tests.helpers.s3 import new_bucket, storage_options

SCRIPT = REPO / "examples" / "production_template.py"
# A tiny GPT and data set. --steps is the LR schedule's length, far beyond any launch here: the interrupted
# run never ends by itself, the others stop at --until. 48 sequences over 2 ranks at 4 x 2 per step is 3
# steps per epoch, so the runs cross epoch boundaries (and save across them) too.
TINY = [
    *("--steps", "100000", "--warmup", "3", "--save-every", "2", "--samples", "48", "--seq", "8"),
    *("--dim", "16", "--layers", "1", "--heads", "2", "--micro-batch", "4", "--accum", "2"),
]


def launch(
    out: Path, tag: str, *args: str, max_restarts: int = 0, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """torchrun on the template in a session of its own (for cleanup); output to ``out/<tag>.log``."""
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"),
        *(f"--max-restarts={max_restarts}", "--monitor-interval=0.1", str(SCRIPT), *TINY, *args),
    ]
    env = dict(
        os.environ, **(env or {}), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"), CUDA_VISIBLE_DEVICES=""
    )
    with open(out / f"{tag}.log", "w") as log:
        return subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=REPO, start_new_session=True
        )


def finish(out: Path, tag: str, proc: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        rc = proc.wait(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of a failed launch
        proc.wait()
    return rc, (out / f"{tag}.log").read_text()


def beats(hb: Path) -> dict[int, dict[str, int]]:
    found: dict[int, dict[str, int]] = {}
    for r in (0, 1):
        with contextlib.suppress(FileNotFoundError):
            found[r] = json.loads((hb / f"rank{r}.json").read_text())
    return found


def wait_for(what: str, proc: subprocess.Popen[str], out: Path, tag: str, ok: Callable[[], object]) -> None:
    deadline = time.monotonic() + 240  # only to fail instead of hanging: nothing here waits on time
    while not ok():
        log = (out / f"{tag}.log").read_text()
        assert proc.poll() is None, f"torchrun exited before {what}:\n{log[-4000:]}"
        assert time.monotonic() < deadline, f"never {what}:\n{log[-4000:]}"
        time.sleep(0.05)


def committed(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*"))


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("durable", "precision"),
    [pytest.param("dir", "bf16", marks=pytest.mark.slow), pytest.param("s3", "fp16", marks=pytest.mark.slow)],
)
def test_template_survives_kill9_and_sigterm_and_resumes_bitwise(
    durable: str, precision: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The durable root: a directory (a shared file system), or under -m slow a bucket on moto's S3, with
    fp16 autocast and its GradScaler (whose state must then resume too)."""
    local, hb, env = tmp_path / "local", tmp_path / "hb", {}
    root = str(tmp_path / "durable")
    if durable == "s3":
        endpoint = request.getfixturevalue("moto_endpoint")
        root, env = f"s3://{new_bucket(endpoint)}/run", {"AWS_ENDPOINT_URL_S3": endpoint}
    tiers = ("--precision", precision, "--root", root, "--local-root", str(local))

    # 1. A run with no end, restartable once. When a checkpoint is committed and both ranks trained past it,
    #    rank 1 is killed with SIGKILL: torchrun stops rank 0 and starts both again, and they resume.
    a = launch(tmp_path, "a", *tiers, "--heartbeat", str(hb), max_restarts=1, env=env)
    try:
        wait_for(
            "a checkpoint and two steps past it",
            a,
            tmp_path,
            "a",
            lambda: (
                committed(local)
                and all(b["step"] >= committed(local)[0] + 2 for b in beats(hb).values())
                and len(beats(hb)) == 2
            ),
        )
        first = beats(hb)
        os.kill(first[1]["pid"], signal.SIGKILL)

        # 2. In the restarted attempt (new pids), two steps after its restore: SIGTERM to the agent only,
        #    which forwards it to each rank's process group, DataLoader workers included.
        def restarted() -> bool:
            now = beats(hb)
            resumed = re.findall(r"resumed at step (\d+)", (tmp_path / "a.log").read_text())
            return (
                len(resumed) == 2
                and len(now) == 2
                and all(
                    now[r]["pid"] != first[r]["pid"] and now[r]["step"] >= int(resumed[1]) + 2 for r in now
                )
            )

        wait_for("the restarted attempt trained", a, tmp_path, "a", restarted)
        os.kill(a.pid, signal.SIGTERM)
    finally:
        rc, log_a = finish(tmp_path, "a", a)
    resumed = [int(s) for s in re.findall(r"resumed at step (\d+)", log_a)]
    assert resumed[0] == 0 and resumed[1] > 0, log_a[-4000:]  # the restart resumed from a checkpoint
    preempted = re.findall(r"preempted at step (\d+), saved step (\d+), exiting 143", log_a)
    assert len(preempted) == 1 and preempted[0][0] == preempted[0][1], log_a[-4000:]
    stop = int(preempted[0][0])
    assert stop >= resumed[1] + 2
    assert "killed by signal: Terminated" not in log_a  # the loader's workers outlived the notice
    assert "forcefully exiting" not in log_a  # the ranks exited by themselves, the agent never SIGKILLed
    assert rc != 0

    # 3. A new launch resumes from the emergency save and trains three more steps; a reference run trains
    #    to the same step without interruption.
    end = stop + 3
    rc, log_b = finish(tmp_path, "b", launch(tmp_path, "b", *tiers, "--until", str(end), env=env))
    assert rc == 0, log_b[-4000:]
    assert f"resumed at step {stop} with 2 ranks" in log_b
    ref = tmp_path / "ref"
    rc, log_ref = finish(
        tmp_path,
        "ref",
        launch(tmp_path, "ref", "--precision", precision, "--root", str(ref), "--until", str(end)),
    )
    assert rc == 0, log_ref[-4000:]
    tokens = re.findall(r"finished at step \d+, tokens_seen=\d+", log_ref)
    assert tokens == [f"finished at step {end}, tokens_seen={end * 2 * 4 * 8}"]
    assert tokens[0] in log_b

    # 4. The durable copies, compared key by key by the CLI: every tensor and value bitwise equal.
    durable_copy = tmp_path / "durable"
    if durable == "s3":  # diff reads local roots: fetch the step from the bucket
        fs = fsspec.filesystem("s3", **storage_options(env["AWS_ENDPOINT_URL_S3"]))
        fs.get(f"{root[len('s3://') :]}/step-{end}/", str(durable_copy / f"step-{end}") + "/", recursive=True)
    cli = [sys.executable, "-m", "safepoint.cli", "diff", str(ref), str(durable_copy), "--step", str(end)]
    diff = subprocess.run(
        [*cli, "--all"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO / "src"), COLUMNS="200"),
    )
    assert diff.returncode == 0, diff.stdout[-4000:] + diff.stderr[-2000:]
    for section in (
        "model.",
        "modules.ema.",
        "optimizer.",
        "scheduler.",
        "dataloader.rank_1.",
        "extra.",
        "rng.",
    ):
        assert section in diff.stdout, f"{section} not compared:\n{diff.stdout[-3000:]}"
    assert ("objects.scaler." in diff.stdout) == (precision == "fp16")
    assert re.search(r"(\d+) keys: \1 identical, 0 differ", diff.stdout), diff.stdout[-2000:]
