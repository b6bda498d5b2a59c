#!/usr/bin/env python
"""Issue 5 benchmark: uploads to S3 and what tiering costs the training loop.

Upload throughput (target: safepoint >= 1.0x boto3):
  safepoint  RemoteLayout.put_files + commit of one committed local checkpoint (``--size-mib``, split in
             ``--files`` DCP files): parallel, multipart, per-part and composite CRC32C checked by the
             store, a HEAD per object to confirm where the store's answer does not (moto's), then the
             manifest with every object's parts. Exactly what the background uploader runs for each
             checkpoint.
  safepoint-full-object  the same with S3's full-object CRC32C (TransferOptions(full_object_checksum=True),
             the default before issue 17).
  boto3      boto3's ``S3.Client.upload_file`` of the same files to the same endpoint, one after another,
             with boto3's default TransferOptions (multipart above 8 MiB, 10 threads per file). No
             checksums beyond botocore's defaults, no confirmation, no manifest.

Blocking time (target: tiering == local-only): ``CheckpointManager.save`` of the same state to a local root,
and to the same local root with ``root=s3://...`` tiering on top, ``--saves`` times each; the training loop
does ``--step-ms`` of CPU work between saves. "settled": each upload finishes before the next save (what
tiering adds to the save path); "overlapped": uploads run during the next steps and save (CPU contention).

The endpoint is moto's server (``moto_server``), started here in its own process on 127.0.0.1: an
in-memory S3 on the same 2 cores as the client. Variants run interleaved and every ratio is paired per round.

    .venv/bin/python benchmarks/bench_upload.py --size-mib 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import boto3
import psutil
import torch
from rich.console import Console
from rich.table import Table

import safepoint
from safepoint.dist import Comm
from safepoint.policy.rules import Retention
from safepoint.remote.object_layout import RemoteLayout
from safepoint.remote.upload import TransferOptions
from safepoint.save.saver import SyncSaver
from safepoint.store.posix_layout import Layout

MiB = 1024 * 1024


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_moto(nice: int) -> tuple[subprocess.Popen[bytes], str]:
    """moto_server in its own process. ``nice``: it stands in for a remote service, whose CPU is not the
    training node's; at a higher nice value it takes less from the client under test on 2 shared cores."""
    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    cmd = [str(exe), "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(
        (["nice", "-n", str(nice)] if nice else []) + cmd,
        stderr=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=endpoint)
    for _ in range(200):
        try:
            client.list_buckets()
            return proc, endpoint
        except Exception:
            time.sleep(0.1)
    raise RuntimeError("moto_server did not start")


def make_checkpoint(root: Path, size_mib: int, files: int) -> tuple[Layout, int]:
    """A committed local checkpoint of ``size_mib`` MiB in ``files`` DCP files (writer threads)."""
    n = size_mib * MiB // 4 // 8
    sd = {"model": {f"w{i}": torch.randn(n) for i in range(8)}}
    layout = Layout(root)
    layout.ensure_root()
    SyncSaver(layout, Comm(), Retention(), writer_threads=files).write(1, sd, ["model"], {}, {})
    return layout, layout.read_manifest(1).total_bytes


def upload_safepoint(layout: Layout, remote: RemoteLayout) -> None:
    manifest = layout.read_manifest(1)
    base = layout.step_path(1)
    pending = remote.new_pending(1, manifest.save_id)
    files = [(str(base / n), n, e.size, e.crc32c) for n, e in sorted(manifest.files.items())]
    parts = remote.put_files(pending, files)
    # As the uploader does (tiers/transfer.py): the manifest records the parts of composite uploads.
    remote.commit(pending, manifest.with_parts(parts), confirmed=True)


def upload_boto3(layout: Layout, client: Any, bucket: str, prefix: str) -> None:
    base = layout.step_path(1)
    for name in sorted(layout.read_manifest(1).files):
        client.upload_file(str(base / name), bucket, f"{prefix}/{name}")


def empty_bucket(client: Any, bucket: str) -> None:
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    if keys:
        client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys]})


def cpu_seconds(server: psutil.Process) -> tuple[float, float]:
    """(this process's CPU seconds, all threads; the server's)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    srv = server.cpu_times()
    return me.ru_utime + me.ru_stime, srv.user + srv.system


def quartiles(xs: list[float]) -> str:
    if len(xs) < 2:
        return f"{xs[0]:.2f}x" if xs else "-"
    q = statistics.quantiles(xs, n=4)
    return f"{statistics.median(xs):.2f}x (q1-q3 {q[0]:.2f}-{q[2]:.2f})"


def bench_throughput(
    args: argparse.Namespace, endpoint: str, work: Path, server: psutil.Process
) -> dict[str, Any]:
    client = boto3.client("s3", endpoint_url=endpoint)
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    layout, nbytes = make_checkpoint(work / "tput", args.size_mib, args.files)
    opts = {"client_kwargs": {"endpoint_url": endpoint}}
    remotes = {
        "safepoint": RemoteLayout(f"s3://{bucket}/run", opts),
        "safepoint-full-object": RemoteLayout(
            f"s3://{bucket}/run", opts, transfer=TransferOptions(full_object_checksum=True)
        ),
    }
    for mib in args.part_mib:  # the same default upload with bigger parts: fewer requests per byte
        remotes[f"safepoint-{mib}MiB-parts"] = RemoteLayout(
            f"s3://{bucket}/run", opts, transfer=TransferOptions(part_size=mib * MiB)
        )
    if args.no_full_object:
        remotes.pop("safepoint-full-object")
    variants = [*remotes, "boto3"]
    rows: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    for variant in variants if args.warmup else []:  # untimed: sessions, connection pools, thread pools
        empty_bucket(client, bucket)
        if variant in remotes:
            upload_safepoint(layout, remotes[variant])
        else:
            upload_boto3(layout, client, bucket, "boto3")
    requests: dict[str, dict[str, int]] = {v: {} for v in variants}
    counting: list[str] = [""]  # the variant whose requests are being counted now (none while emptying)
    for variant, c in [*((v, r.store.fs.s3) for v, r in remotes.items()), ("boto3", client)]:
        c.meta.events.register("before-send.s3", _counter(requests[variant], counting, variant))
    for r in range(args.rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]  # rotated each round
        for variant in order:
            empty_bucket(client, bucket)
            counting[0] = variant if r == 0 else ""
            c0, s0 = cpu_seconds(server)
            t0 = time.perf_counter()
            if variant in remotes:
                upload_safepoint(layout, remotes[variant])
            else:
                upload_boto3(layout, client, bucket, "boto3")
            rows[variant].append(time.perf_counter() - t0)
            counting[0] = ""
            c1, s1 = cpu_seconds(server)
            cpu[variant].append((c1 - c0, s1 - s0))
        print(
            f"round {r}: " + ", ".join(f"{v} {nbytes / rows[v][-1] / 1e6:.0f} MB/s" for v in rows), flush=True
        )
    empty_bucket(client, bucket)
    ratios = {v: [b / x for x, b in zip(rows[v], rows["boto3"], strict=True)] for v in remotes}
    return {
        "bytes": nbytes,
        "files": args.files,
        "seconds": rows,
        "cpu_client_server_s": cpu,
        "ratios": ratios,
        "requests_per_upload": requests,
    }


def _counter(into: dict[str, int], counting: list[str], variant: str) -> Any:
    """A botocore ``before-send`` hook counting the requests of one upload by kind (retries included)."""

    def count(request: Any, **_: Any) -> None:
        if counting[0] != variant:
            return
        query = request.url.partition("?")[2]
        kind = request.method + (
            " part"
            if "partNumber=" in query
            else " complete"
            if "uploadId=" in query
            else " create"
            if "uploads" in query
            else ""
        )
        into[kind] = into.get(kind, 0) + 1
        into["all"] = into.get("all", 0) + 1

    return count


def bench_blocking(args: argparse.Namespace, endpoint: str, work: Path, settled: bool) -> dict[str, Any]:
    """Median blocking time of ``save`` with and without tiering.

    overlapped (settled=False): the next save comes while the previous upload is still running, as in a
    run whose upload takes longer than the save interval: uploads compete with training for the CPU.
    settled (settled=True): each upload finishes before the next step (mgr.wait(), outside the timing):
    what tiering adds to the save path itself.
    """
    client = boto3.client("s3", endpoint_url=endpoint)
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    opts = {"client_kwargs": {"endpoint_url": endpoint}}
    layers = args.block_mib * MiB // (2048 * 2048 * 4)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(layers)])
    state = safepoint.TrainState(model=model, rng=False)
    x = torch.randn(256, 256)
    out: dict[str, list[float]] = {"local": [], "tiered": []}
    for r in range(args.rounds):
        order = ["local", "tiered"] if r % 2 == 0 else ["tiered", "local"]
        for variant in order:
            local = work / f"block-{variant}-{r}"
            kw: dict[str, Any] = {"keep": safepoint.Keep(last=2)}
            if variant == "tiered":
                empty_bucket(client, bucket)
                kw.update(local_root=local, storage_options=opts)
                root: str | Path = f"s3://{bucket}/run{r}"
            else:
                root = local
            with safepoint.CheckpointManager(root, **kw) as mgr:
                for step in range(1, args.saves + 1):
                    t_end = time.perf_counter() + args.step_ms / 1000
                    while time.perf_counter() < t_end:  # "training": CPU work the uploads overlap with
                        x = torch.tanh(x @ x.T / 256)
                    mgr.save(step, state)
                    if settled:
                        mgr.wait()  # not part of the save's blocking time
                blocking = [s.blocking_s for s in mgr.saves]
            out[variant].append(statistics.median(blocking))
            shutil.rmtree(local, ignore_errors=True)
        mode = "settled" if settled else "overlapped"
        print(f"{mode} round {r}: local {out['local'][-1]:.3f}s tiered {out['tiered'][-1]:.3f}s", flush=True)
    empty_bucket(client, bucket)
    ratios = [t / lo for lo, t in zip(out["local"], out["tiered"], strict=True)]
    return {"state_mib": args.block_mib, "saves": args.saves, "median_blocking_s": out, "ratios": ratios}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--block-mib", type=int, default=256, help="state size for the blocking-time test")
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=2000)
    p.add_argument("--work", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    p.add_argument("--out", default="bench-out")
    p.add_argument("--moto-nice", type=int, default=10, help="nice value of the moto server (0: none)")
    p.add_argument("--skip", choices=["throughput", "blocking"], action="append", default=[])
    p.add_argument("--part-mib", type=int, action="append", default=[], help="also safepoint, these parts")
    p.add_argument("--warmup", type=int, default=1, help="an untimed upload per variant first (0: none)")
    p.add_argument("--no-full-object", action="store_true", help="leave out safepoint-full-object")
    args = p.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    work = Path(tempfile.mkdtemp(prefix="bench-upload-", dir=args.work))
    proc, endpoint = start_moto(args.moto_nice)
    result: dict[str, Any] = {"cpus": os.cpu_count(), "args": vars(args), "work": str(work)}
    try:
        if "throughput" not in args.skip:
            result["throughput"] = bench_throughput(args, endpoint, work, psutil.Process(proc.pid))
        if "blocking" not in args.skip:
            result["blocking_settled"] = bench_blocking(args, endpoint, work, settled=True)
            result["blocking_overlapped"] = bench_blocking(args, endpoint, work, settled=False)
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    console = Console()
    if "throughput" in result:
        t = result["throughput"]
        table = Table(title=f"upload of {t['bytes'] / MiB:.0f} MiB in {t['files']} files to moto (MB/s)")
        for col in ("variant", "median MB/s", "best MB/s", "client CPU s", "server CPU s", "rounds"):
            table.add_column(col)
        for v, secs in t["seconds"].items():
            table.add_row(
                v,
                f"{t['bytes'] / statistics.median(secs) / 1e6:.0f}",
                f"{t['bytes'] / min(secs) / 1e6:.0f}",
                f"{statistics.median(c for c, _ in t['cpu_client_server_s'][v]):.2f}",
                f"{statistics.median(s for _, s in t['cpu_client_server_s'][v]):.2f}",
                str(len(secs)),
            )
        console.print(table)
        for v, counts in t["requests_per_upload"].items():
            console.print(f"{v}: requests in one upload: {dict(sorted(counts.items()))}")
        for v, ratios in t["ratios"].items():
            paired = ", ".join(f"{r:.2f}x" for r in ratios)
            console.print(f"{v} / boto3 throughput, paired per round: {paired}; {quartiles(ratios)}")
    for mode in ("settled", "overlapped"):
        if f"blocking_{mode}" not in result:
            continue
        b = result[f"blocking_{mode}"]
        console.print(
            f"blocking time per save, {mode} ({b['state_mib']} MiB state, median of {b['saves']} saves): "
            f"local {statistics.median(b['median_blocking_s']['local']):.3f}s, tiered "
            f"{statistics.median(b['median_blocking_s']['tiered']):.3f}s; tiered/local paired: "
            f"{', '.join(f'{r:.2f}x' for r in b['ratios'])}; {quartiles(b['ratios'])}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_upload.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
