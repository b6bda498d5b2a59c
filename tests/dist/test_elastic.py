"""Elastic membership changes keep work (issue 15, item 5): two torchrun agents on 127.0.0.1, each its own
host (``unshare --uts``), one c10d rendezvous with ``--nnodes=1:2``. When the second node joins, the
first agent stops its workers with SIGTERM; with ``preemption_signals=[SIGTERM]`` that is a notice, the
emergency save commits the step the worker was at, and the job at world size 2 resumes there: 0 steps
redone. The restarted rank 0 may land on either host; the lease (same torchrun ``--rdzv-id``) never makes
it wait."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import PYTHON, REPO, SUBPROCESS_ENV
from tests.helpers.s3 import free_port
from tests.store.test_fencing import _unshare_works

pytestmark = pytest.mark.skipif(
    not _unshare_works(), reason="needs `unshare --uts` (root, Linux) to run each agent as its own host"
)
WORKER = REPO / "tests" / "helpers" / "procs" / "elastic_worker.py"


def _agent(host: str, port: int, out: Path, root: Path) -> subprocess.Popen[bytes]:
    torchrun = [
        PYTHON, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=0",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test-job",
        "--rdzv-conf=last_call_timeout=1", "--local-addr=127.0.0.1", "--monitor-interval=0.1",
        str(WORKER), str(out), str(root), "3",
    ]  # fmt: skip
    # A fresh store per rendezvous round (docs/elastic.md, "torchrun restarts").
    env = dict(SUBPROCESS_ENV, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    log = open(out / f"agent-{host}.log", "wb")  # noqa: SIM115 (closed with the process)
    script = f'hostname {host} && exec "$@"'
    return subprocess.Popen(
        ["unshare", "--uts", "sh", "-c", script, "sh", *torchrun], stdout=log, stderr=log, env=env
    )


def _wait_for(path: Path, procs: list[subprocess.Popen[bytes]], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        for p in procs:
            assert p.poll() is None, f"agent {p.pid} exited early (rc={p.returncode})"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_node_joining_costs_no_steps_with_preemption_on(tmp_path: Path) -> None:
    out, root = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    port = free_port()
    a = _agent("nodeA", port, out, root)
    agents = [a]
    try:
        _wait_for(out / "ready", agents)  # world size 1 is training
        agents.append(_agent("nodeB", port, out, root))  # scale-up: A's agent SIGTERMs its worker
        for p in agents:
            assert p.wait(timeout=300) == 0, (out / "agent-nodeA.log").read_text()[-3000:]
    finally:
        for p in agents:
            if p.poll() is None:
                p.kill()
                p.wait()
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    first = [r for r in records if r["world"] == 1]
    second = [r for r in records if r["world"] == 2]
    trained = max(r["step"] for r in first if r["event"] == "step")
    notice = [r for r in first if r["event"] == "preempted"]
    assert notice == [{**notice[0], "step": trained, "saved_step": trained}], notice
    restored = [r["step"] for r in second if r["event"] == "restored"]
    assert restored == [trained, trained], f"{trained - min(restored)} steps redone"
    assert sorted(r["host"] for r in second if r["event"] == "finished") == ["nodeA", "nodeB"]
    assert all(r["step"] == trained + 3 for r in second if r["event"] == "finished")
