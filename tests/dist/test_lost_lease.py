"""A lost lease stops the save on every rank alike (the lease lives on rank 0 only): every rank raises the
same error (rank 0's commit fence refuses, and the save's one broadcast carries its verdict), never
rank 0 alone while the others wait in the save for a peer that is gone (they got a PeerTimeoutError
instead). Two ranks, torchrun, gloo; tests/dist/test_collectives.py checks no collective was added."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

from tests.conftest import REPO
from tests.helpers.launch import run_agent

WORKER = textwrap.dedent(
    """
    import json, os, sys, torch, torch.distributed as dist, safepoint
    root, out = sys.argv[1:3]
    safepoint.init_process_group("gloo", timeout_s=60)
    rank = dist.get_rank()
    state = safepoint.TrainState(model=torch.nn.Linear(4, 4), rng=False)
    cluster = safepoint.ClusterOptions(collective_timeout_s=60)
    mgr = safepoint.CheckpointManager(root, cluster=cluster)
    mgr.save(1, state)
    if rank == 0:
        # Another job takes the root over (as a takeover of a stale lease would), and rank 0 learns it.
        record = dict(json.load(open(root + "/.lease")), token="theirs", pid=1, host="nodeB")
        with open(root + "/.lease.new", "w") as f:
            json.dump(record, f)
        os.rename(root + "/.lease.new", root + "/.lease")
        try:
            mgr._lease.fence("looking")
        except safepoint.LeaseError:
            pass
    dist.barrier()
    try:
        mgr.save(2, state)
        said = "saved 2"
    except Exception as e:
        said = f"{type(e).__name__}: {e}"
    with open(f"{out}/rank{rank}.txt", "w") as f:  # a file each: the ranks' stdout lines interleave
        f.write(said)
    try:
        mgr.close()
    except safepoint.CheckpointError:
        pass
    dist.destroy_process_group()
    """
)


def test_a_lost_lease_raises_the_same_lease_error_on_every_rank(tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    cmd = ["--standalone", "--nproc-per-node=2", str(worker)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{REPO}")
    # The agent forked from a fork server (tests/helpers/launch.py); its ranks are fresh processes.
    done = run_agent([*cmd, str(tmp_path / "ckpt"), str(tmp_path)], env, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        said = (tmp_path / f"rank{rank}.txt").read_text()
        assert said.startswith("SaveError: save of step 2 failed and was not committed"), said
        assert "taken over by pid 1 on host 'nodeB'" in said, said
    assert json.loads((tmp_path / "ckpt" / ".lease").read_text())["token"] == "theirs"
