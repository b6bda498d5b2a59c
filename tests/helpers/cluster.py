"""A simulated cluster for tests/dist/test_nodes.py and test_node_loss.py: torchrun agents on 127.0.0.1
with one c10d rendezvous, each its own node with its own ``local_root`` directory (and, where ``unshare
--uts`` works, its own host name), running tests/helpers/procs/nodes_worker.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import torch

from tests.conftest import REPO, SUBPROCESS_ENV
from tests.helpers.launch import Agent, agent
from tests.helpers.s3 import free_port
from tests.store.test_fencing import _unshare_works

WORKER = REPO / "tests" / "helpers" / "procs" / "nodes_worker.py"
UNSHARE = _unshare_works()


class Cluster:
    """Agents of one job: ``node(name, local_root)`` starts one (its own session, its own host name where
    ``unshare --uts`` works); the first one started hosts the rendezvous store."""

    def __init__(
        self, out: Path, cfg: dict[str, Any], nnodes: str, max_restarts: int = 0, nproc: int = 1
    ) -> None:
        self.out, self.nnodes, self.max_restarts, self.nproc = out, nnodes, max_restarts, nproc
        self.port = free_port()
        self.plan = out / f"plan-{self.port}.json"
        self.plan.write_text(json.dumps({"out": str(out), **cfg}))
        self.agents: dict[str, Agent] = {}

    def node(self, name: str, local_root: Path, addr: str = "127.0.0.1") -> Agent:
        """``addr``: the agent's address (any of 127.0.0.0/8). The rendezvous numbers the nodes by address,
        then pid: agents given ascending addresses get ascending ranks, in every launch."""
        torchrun = [
            f"--nnodes={self.nnodes}", f"--nproc-per-node={self.nproc}",
            f"--max-restarts={self.max_restarts}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id=nodes-{self.port}",
            "--rdzv-conf=last_call_timeout=1", f"--local-addr={addr}", "--monitor-interval=0.1",
            str(WORKER), str(self.plan),
        ]  # fmt: skip
        # A fresh store per rendezvous round (docs/elastic.md, "torchrun restarts"). One OpenMP thread per
        # rank, as tests/helpers/launch.py ``start`` gives its ranks (torchrun sets it only for more than
        # one rank per node): the ranks are then forked from the agent's rank servers, whose torch was
        # loaded with one (a different OMP_NUM_THREADS needs a fresh interpreter).
        env = dict(SUBPROCESS_ENV, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", NODE_LOCAL_ROOT=str(local_root))
        env["OMP_NUM_THREADS"] = "1"
        # The agent is forked from a fork server (tests/helpers/launch.py): its own session, and where
        # ``unshare --uts`` works its own UTS namespace and host name, which its ranks inherit.
        with open(self.out / f"agent-{name}-{len(self.agents)}.log", "wb") as log:
            proc = agent(torchrun, env, log.fileno(), cwd=Path.cwd(), hostname=name if UNSHARE else None)
        self.agents[f"{name}-{len(self.agents)}"] = proc
        return proc

    def listening(self, agent: Agent) -> None:
        """Wait until the first agent hosts the rendezvous store (a later agent must never host it)."""
        deadline = time.monotonic() + 120
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            assert agent.poll() is None, f"agent exited early (rc={agent.returncode})"
            assert time.monotonic() < deadline, "the rendezvous store never came up"
            time.sleep(0.1)

    def wait(self, timeout: float = 300, skip: tuple[str, ...] = ()) -> None:
        for name, p in self.agents.items():
            if name in skip:
                continue
            rc = p.wait(timeout=timeout)
            logs = "\n".join(f.read_text()[-2500:] for f in sorted(self.out.glob("agent-*.log")))
            assert rc == 0, f"agent {name} exited {rc}\n{logs}"

    def kill(self) -> None:
        for p in self.agents.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def run(out: Path, cfg: dict[str, Any], locals_: dict[str, Path]) -> list[dict[str, Any]]:
    """One launch of the two-node job to its end; the records it logged."""
    (out / "log.jsonl").unlink(missing_ok=True)
    cluster = Cluster(out, cfg, "2")
    try:
        for name, local in locals_.items():
            cluster.node(name, local)
        cluster.wait()
    finally:
        cluster.kill()
    return records(out)


def equal(a: Path, b: Path) -> None:
    """The two dumps (full model, optimizer and sampler state) are bitwise equal."""
    _same(torch.load(a, weights_only=False), torch.load(b, weights_only=False), "")


def _same(x: Any, y: Any, where: str) -> None:
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), where
    elif isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), where
        for k in x:
            _same(x[k], y[k], f"{where}.{k}")
    elif isinstance(x, (list, tuple)):
        assert type(x) is type(y) and len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y, strict=True)):
            _same(u, v, f"{where}[{i}]")
    else:
        assert x == y, where


def wait_for(path: Path, agents: list[Agent], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        for p in agents:
            assert p.poll() is None, f"agent {p.pid} exited early (rc={p.returncode})"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def exactly_once(records: list[dict[str, Any]]) -> None:
    """Each step of the run's final history (a step redone after a failure counts once, as redone) saw
    each sample of its epoch at most once, and every finished epoch saw all of them."""
    history: dict[int, list[dict[str, Any]]] = {}
    gen_of: dict[int, str] = {}
    for r in (r for r in records if r["event"] == "step"):
        if gen_of.get(r["step"]) != r["gen"]:
            history[r["step"]], gen_of[r["step"]] = [], r["gen"]
        history[r["step"]].append(r)
    epochs: dict[int, list[int]] = {}
    for step in sorted(history):
        for r in history[step]:
            epochs.setdefault(r["epoch"], []).extend(r["samples"])
    assert sorted(history) == list(range(1, 13))
    for epoch, seen in epochs.items():
        assert len(seen) == len(set(seen)), f"epoch {epoch}: a sample seen twice"
    assert sorted(epochs[0]) == list(range(24))
