"""Restore from a peer node's replica against restore from the durable tier (issue 15, item 3).

    python benchmarks/bench_node_restore.py [--width 1000000] [--rounds 3] [--s3]

On the simulated cluster of tests/dist/test_nodes.py (two torchrun agents on 127.0.0.1, each its own node
with its own local_root; tests/helpers/cluster.py), an FSDP2 model with a hidden layer of ``width`` units
(about 48 * width bytes of weights and AdamW state per rank's share) is saved once; then node B loses its
local_root and the job restores, alternating two cases, ``rounds`` times each:

- ``peer``: node A holds B's replica; B's share comes over torch.distributed (gloo, loopback).
- ``durable``: A's replica is gone too; B's share comes from the durable tier: a local directory (the
  fastest durable tier there is), or with ``--s3`` a bucket on a moto server on loopback (an object store
  over HTTP, in this process: slow, as a stand-in for a store farther away than the peer).

Reported: the seconds of ``CheckpointManager.restore`` on node B's rank (the slower of the two ranks), and
where its files came from.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.cluster import run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--s3", action="store_true", help="the durable tier on a moto server (loopback)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-nodes-"))
    out, durable = tmp / "out", tmp / "durable"
    out.mkdir()
    where: dict[str, object] = {"durable": str(durable)}
    if args.s3:
        from moto.server import ThreadedMotoServer
        from tests.helpers.s3 import free_port, new_bucket, storage_options

        os.environ.update(AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x", AWS_DEFAULT_REGION="us-east-1")
        port = free_port()
        ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False).start()
        endpoint = f"http://127.0.0.1:{port}"
        opts = storage_options(endpoint, key="x", secret="x")  # the workers' environment has no credentials
        where = {"durable": f"s3://{new_bucket(endpoint)}/run", "storage_options": opts}
    locals_ = {"nodeA": tmp / "localA", "nodeB": tmp / "localB"}
    saved = run(out, {**where, "end": 1, "save_every": 1, "width": args.width}, locals_)
    node_b = next(Path(r["local"]) for r in saved if r["event"] == "finished" and r["rank"] == 1)
    node_a = next(p for p in locals_.values() if p != node_b)
    mb = sum(f.stat().st_size for f in (node_a / "step-1").iterdir()) / 1e6 * 2  # about: two shares
    keep = tmp / "replica-backup"
    shutil.copytree(node_a / ".peers", keep)
    times: dict[str, list[float]] = {"peer": [], "durable": []}
    for i in range(args.rounds * 2):
        case = ("peer", "durable")[i % 2]
        shutil.rmtree(node_b, ignore_errors=True)
        shutil.rmtree(node_a / ".peers", ignore_errors=True)
        if case == "peer":
            shutil.copytree(keep, node_a / ".peers")
        cfg = {**where, "restore_only": True, "width": args.width, "tag": f"r{i}"}
        rec = next(
            r for r in run(out, cfg, locals_) if r["event"] == "restored" and Path(r["local"]) == node_b
        )
        times[case].append(rec["seconds"])
        print(f"round {i}: {case:8s} {rec['seconds']:.3f}s  files={json.dumps(rec['files'])}", flush=True)
    print(f"checkpoint {mb:.1f} MB in total (each rank's share about half)")
    for case, ts in times.items():
        print(f"{case:8s} median {statistics.median(ts):.3f}s  (all: {', '.join(f'{t:.3f}' for t in ts)})")
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
