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
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import PYTHON, REPO, SUBPROCESS_ENV
from tests.preempt.test_preemption import _free_port
from tests.store.test_fencing import _unshare_works

WORKER = REPO / "tests" / "helpers" / "procs" / "nodes_worker.py"
UNSHARE = _unshare_works()


class Cluster:
    """Agents of one job: ``node(name, local_root)`` starts one (its own session, its own host name where
    ``unshare --uts`` works); the first one started hosts the rendezvous store."""

    def __init__(self, out: Path, cfg: dict[str, Any], nnodes: str, max_restarts: int = 0) -> None:
        self.out, self.nnodes, self.max_restarts = out, nnodes, max_restarts
        self.port = _free_port()
        self.plan = out / f"plan-{self.port}.json"
        self.plan.write_text(json.dumps({"out": str(out), **cfg}))
        self.agents: dict[str, subprocess.Popen[bytes]] = {}

    def node(self, name: str, local_root: Path) -> subprocess.Popen[bytes]:
        torchrun = [
            PYTHON, "-m", "torch.distributed.run", f"--nnodes={self.nnodes}", "--nproc-per-node=1",
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

    def wait(self, timeout: float = 300) -> None:
        for name, p in self.agents.items():
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
    by_host = {r["host"]: r for r in restored if r["event"] == "restored"}
    assert len(by_host) == 2 or not UNSHARE
    for r in (r for r in restored if r["event"] == "restored"):
        own = {".metadata", f"__{r['rank']}_0.distcp"}
        assert r["step"] == 4
        if locals_[r["host"]] == node_of[lost]:
            assert set(r["files"].values()) == {"durable"}, r
        else:
            assert {r["files"][f] for f in own} == {"local"}, r
    _equal(out / "saved.pt", out / "durable.pt")


def _node_of_rank(records: list[dict[str, Any]], locals_: dict[str, Path]) -> dict[int, Path]:
    """rank -> the local_root of the node it ran on (told apart by host name)."""
    if not UNSHARE:
        pytest.skip("needs `unshare --uts` (root, Linux): without it both agents share a host name")
    return {r["rank"]: locals_[r["host"]] for r in records if r["event"] == "finished"}
