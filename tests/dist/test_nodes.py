"""Per-node local tiers on a simulated cluster (issue 15, items 2 and 6): two torchrun agents on 127.0.0.1
with one c10d rendezvous, each its own node with its own ``local_root`` directory (and, where ``unshare
--uts`` works, its own host name); the durable tier is a local directory. The worker is
tests/helpers/procs/nodes_worker.py (FSDP2, so each rank's shards are in its own file)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from tests.conftest import PYTHON, REPO, SUBPROCESS_ENV
from tests.preempt.test_preemption import _free_port
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
        self.port = _free_port()
        self.plan = out / f"plan-{self.port}.json"
        self.plan.write_text(json.dumps({"out": str(out), **cfg}))
        self.agents: dict[str, subprocess.Popen[bytes]] = {}

    def node(self, name: str, local_root: Path) -> subprocess.Popen[bytes]:
        torchrun = [
            PYTHON, "-m", "torch.distributed.run", f"--nnodes={self.nnodes}", f"--nproc-per-node={self.nproc}",
            f"--max-restarts={self.max_restarts}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id=nodes-{self.port}",
            "--rdzv-conf=last_call_timeout=1", "--local-addr=127.0.0.1", "--monitor-interval=0.1",
            str(WORKER), str(self.plan),
        ]  # fmt: skip
        # A fresh store per rendezvous round (docs/elastic.md, "torchrun restarts").
        env = dict(SUBPROCESS_ENV, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", NODE_LOCAL_ROOT=str(local_root))
        log = open(self.out / f"agent-{name}-{len(self.agents)}.log", "wb")  # noqa: SIM115
        cmd = ["unshare", "--uts", "sh", "-c", f'hostname {name} && exec "$@"', "sh", *torchrun]
        proc = subprocess.Popen(
            cmd if UNSHARE else torchrun, stdout=log, stderr=log, env=env, start_new_session=True
        )
        self.agents[f"{name}-{len(self.agents)}"] = proc
        return proc

    def listening(self, agent: subprocess.Popen[bytes]) -> None:
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


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def _run(out: Path, cfg: dict[str, Any], locals_: dict[str, Path]) -> list[dict[str, Any]]:
    """One launch of the two-node job to its end; the records it logged."""
    (out / "log.jsonl").unlink(missing_ok=True)
    cluster = Cluster(out, cfg, "2")
    try:
        for name, local in locals_.items():
            cluster.node(name, local)
        cluster.wait()
    finally:
        cluster.kill()
    return _records(out)


def _equal(a: Path, b: Path) -> None:
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


def test_each_node_commits_and_restores_from_its_own_local_tier(tmp_path: Path) -> None:
    out, durable = tmp_path / "out", tmp_path / "durable"
    out.mkdir()
    locals_ = {"nodeA": tmp_path / "localA", "nodeB": tmp_path / "localB"}
    saved = _run(out, {"durable": str(durable), "end": 4, "save_every": 2, "tag": "saved"}, locals_)
    hosts = {r["rank"]: r["host"] for r in saved if r["event"] == "finished"}
    assert len(set(hosts.values())) == 2 or not UNSHARE
    # The global commit is the durable manifest; each node's local step holds its own rank's file.
    manifest = json.loads((durable / "step-4" / "safepoint.json").read_text())
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    node_of = _node_of_rank(saved, locals_)
    for rank in (0, 1):
        local = node_of[rank] / "step-4"
        assert (local / f"__{rank}_0.distcp").is_file()
        assert not (local / f"__{1 - rank}_0.distcp").exists()  # never on another node's disk
        assert (local / ".metadata").is_file()  # rank 0 wrote it; the other node keeps a verified copy
        assert json.loads((local / "safepoint.json").read_text())["save_id"] == manifest["save_id"]

    # Restore: each rank's own shards (and .metadata) from its node's local copy. DCP also spreads
    # replicated items (AdamW's step counters) over both ranks' files: what a rank reads from the other
    # rank's file comes from the durable tier, as it is on no disk of this node.
    restored = _run(out, {"durable": str(durable), "restore_only": True, "tag": "local"}, locals_)
    for r in (r for r in restored if r["event"] == "restored"):
        own = f"__{r['rank']}_0.distcp"
        assert r["step"] == 4
        assert {k: v for k, v in r["files"].items() if k != f"__{1 - r['rank']}_0.distcp"} == {
            ".metadata": "local",
            own: "local",
        }, r
        assert r["files"].get(f"__{1 - r['rank']}_0.distcp", "durable") == "durable"
    _equal(out / "saved.pt", out / "local.pt")

    # One node loses its disk: its rank reads from the durable tier, the other still from its own.
    lost = 1
    shutil.rmtree(node_of[lost])
    restored = _run(out, {"durable": str(durable), "restore_only": True, "tag": "durable"}, locals_)
    for r in (r for r in restored if r["event"] == "restored"):
        own = {".metadata", f"__{r['rank']}_0.distcp"}
        assert r["step"] == 4
        if Path(r["local"]) == node_of[lost]:
            assert set(r["files"].values()) == {"durable"}, r
        else:
            assert {r["files"][f] for f in own} == {"local"}, r
    _equal(out / "saved.pt", out / "durable.pt")


def _node_of_rank(records: list[dict[str, Any]], locals_: dict[str, Path]) -> dict[int, Path]:
    """rank -> the local_root of the node it ran on."""
    return {r["rank"]: Path(r["local"]) for r in records if r["event"] == "finished"}


def test_a_node_dies_with_its_disk_and_rejoins(tmp_path: Path) -> None:
    """Issue 15, item 6: a two-node elastic job (``--nnodes=1:2``) loses a whole node (agent and worker
    SIGKILLed) and its local_root; the survivor re-rendezvous alone and resumes from the last durable
    checkpoint (its own files from its disk, the lost node's from the durable tier); the node rejoins
    with an empty disk and the job finishes at full size. Every sample is seen once per epoch, and the
    final state is bitwise equal to a reference run with the same world-size schedule."""
    out, durable = tmp_path / "out", tmp_path / "durable"
    out.mkdir()
    local_a, local_b = tmp_path / "localA", tmp_path / "localB"
    # Steps 1-7 on two nodes (saves at 3 and 6), node B dies at 7; 7-9 alone (save at 9); 10-12 on two.
    cfg = {"durable": str(durable), "end": 12, "save_every": 3, "block_at": 7, "pause_at": 9}
    cluster = Cluster(out, cfg, "1:2", max_restarts=3)
    try:
        a = cluster.node("nodeA", local_a)
        cluster.listening(a)  # node A hosts the rendezvous: killing it would end the job (docs/elastic.md)
        b = cluster.node("nodeB", local_b)
        _wait_for(out / "blocked", [a, b])
        pids = json.loads((out / "blocked").read_text())
        first = _records(out)
        rank_b = next(r["rank"] for r in first if r["event"] == "step" and Path(r["local"]) == local_b)
        os.killpg(b.pid, signal.SIGKILL)  # the node: its agent and (in a session of its own) its worker
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[rank_b], signal.SIGKILL)
        b.wait()
        shutil.rmtree(local_b)
        _wait_for(out / "paused", [a])  # node A alone resumed and saved step 9
        cluster.node("nodeB", local_b)  # the node comes back, its disk empty
        cluster.wait(skip=("nodeB-1",))
    finally:
        cluster.kill()
    records = _records(out)
    restored = [(r["world"], r["step"]) for r in records if r["event"] == "restored"]
    assert restored == [(2, 0), (2, 0), (1, 6), (2, 9), (2, 9)], restored
    for r in (r for r in records if r["event"] == "restored" and r["step"] == 9):
        if Path(r["local"]) == local_b:  # the rejoined node has nothing: everything from the durable tier
            assert set(r["files"].values()) == {"durable"}, r
        else:  # node A saved step 9 alone: every file it reads is on its own disk
            assert set(r["files"].values()) == {"local"}, r
    _exactly_once(records)

    # The reference: one node, the same schedule (2 ranks to step 6, 1 rank to 9, 2 ranks to 12).
    ref = tmp_path / "ref"
    ref.mkdir()
    for nproc, end in ((2, 6), (1, 9), (2, 12)):
        run = Cluster(
            ref, {"durable": str(tmp_path / "ref-durable"), "end": end, "save_every": 3}, "1", 0, nproc
        )
        try:
            run.node("ref", tmp_path / "ref-local")
            run.wait()
        finally:
            run.kill()
    _equal(ref / "final.pt", out / "final.pt")


def _wait_for(path: Path, agents: list[subprocess.Popen[bytes]], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        for p in agents:
            assert p.poll() is None, f"agent {p.pid} exited early (rc={p.returncode})"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def _exactly_once(records: list[dict[str, Any]]) -> None:
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
