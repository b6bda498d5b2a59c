"""Incremental saves (store/incremental.py) against full saves, interleaved, on three states:

- ``lora``: a LoRA-shaped state: 128 MiB frozen base, 1 MiB trainable adapters + AdamW;
- ``embedding``: a frozen 64 MiB embedding table (tied to the output head) + a 4 MiB trained MLP + AdamW;
- ``dense``: every tensor changes every step (64 MiB trained + AdamW): what fingerprinting costs.

Per steady save (after the third, when unchanged tensors are linked): bytes passed to write() (the
process's ``wchar``), wall time, CPU time; the root's size with keep_last=3 (distinct inodes); restore time
of the newest step. Runs alternate full/incremental (``--rounds``) and the 1-minute load average is recorded.

    PYTHONPATH=src python benchmarks/bench_incremental.py --rounds 3 --saves 8 --dir /tmp

``--s3``: the saves go straight to a bucket on moto's S3 server (no ``local_root``), and what is measured is
the bytes the client sends per steady save (every byte through a loopback TCP proxy: requests, headers
and bodies; tests/helpers/tcpproxy.py): unchanged stable groups are copied server-side
(remote/incremental_copy.py).

    PYTHONPATH=src python benchmarks/bench_incremental.py --models lora --s3 --rounds 2 --saves 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import safepoint
import safepoint.save.staging as staging
import safepoint.store.incremental as inc

MiB = 1 << 20


class Lora(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.ParameterList(
            [nn.Parameter(torch.randn(4 * MiB // 4), requires_grad=False) for _ in range(32)]
        )
        self.adapters = nn.ParameterList([nn.Parameter(torch.randn(32 * 1024 // 4)) for _ in range(32)])

    def loss(self) -> torch.Tensor:
        return sum((a * a).sum() for a in self.adapters)  # type: ignore[return-value]


class Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16384, 1024)
        self.emb.weight.requires_grad_(False)
        self.mlp = nn.Sequential(nn.Linear(1024, 512), nn.Linear(512, 1024))
        self.head = nn.Linear(1024, 16384, bias=False)
        self.head.weight = self.emb.weight

    def loss(self) -> torch.Tensor:
        return self.mlp(self.emb(torch.randint(0, 16384, (4,)))).sum()


class Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ParameterList([nn.Parameter(torch.randn(2 * MiB // 4)) for _ in range(32)])

    def loss(self) -> torch.Tensor:
        return sum((p * p).sum() for p in self.layers)  # type: ignore[return-value]


MODELS = {"lora": Lora, "embedding": Embedding, "dense": Dense}


def _wchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


def _root_bytes(root: Path) -> int:
    seen: dict[tuple[int, int], int] = {}
    for p in root.glob("step-*/*"):
        st = p.lstat()
        seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def _one_step_bytes(root: Path) -> int:
    newest = max(root.glob("step-*"), key=lambda p: int(p.name[5:]))
    return sum(p.lstat().st_size for p in newest.iterdir())


def run(kind: str, incremental: bool, saves: int, base: Path, process: bool = False) -> dict[str, Any]:
    """``process``: async saves written by the writer process (each waited for: wall is save + wait, and
    bytes written are the committed event's ``bytes_written``: the process's writes are not this one's)."""
    torch.manual_seed(0)
    model = MODELS[kind]()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    changed = 3 * sum(p.nbytes for p in model.parameters() if p.requires_grad)
    fp_cpu = [0.0]
    real = inc.fingerprints

    def timed(ts: list[torch.Tensor]) -> list[bytes | None]:
        t0 = time.thread_time()  # the calling thread's: staging's (training thread) or the writer's
        try:
            return real(ts)
        finally:
            fp_cpu[0] += time.thread_time() - t0

    # Where fingerprints are taken: the writer's arrangement and async staging (save/staging.py).
    inc.fingerprints = staging.fingerprints = timed  # type: ignore[assignment]
    root = Path(tempfile.mkdtemp(dir=base)) / "root"
    state = safepoint.TrainState(model=model, optimizer=opt)
    mode = "process" if process else "auto"
    writer = safepoint.WriterOptions(incremental=incremental, full_every=0, async_writer=mode)
    wall, cpu, wrote, fps = [], [], [], []
    committed: list[int] = []

    def on_event(e: safepoint.CheckpointEvent) -> None:
        if e.event_type == "save_committed":
            committed.append(e.bytes_written or 0)

    try:
        with safepoint.CheckpointManager(
            root, keep=safepoint.Keep(last=3), writer=writer, async_save=process, on_event=on_event
        ) as mgr:
            if mgr._process is not None:
                mgr._process.wait_ready()
            for step in range(1, saves + 1):
                model.loss().backward()
                opt.step()
                opt.zero_grad()
                fp_cpu[0] = 0.0
                w0, t0, c0 = _wchar(), time.perf_counter(), time.process_time()
                mgr.save(step, state)
                mgr.wait()
                wall.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                wrote.append(committed[-1] if process else _wchar() - w0)
                fps.append(fp_cpu[0])
        fresh = MODELS[kind]()
        fopt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-3)
        t0 = time.perf_counter()
        with safepoint.CheckpointManager(root) as mgr:
            mgr.restore(safepoint.TrainState(model=fresh, optimizer=fopt))
        restore_s = time.perf_counter() - t0
        steady = slice(3, None)
        return {
            "wall": statistics.median(wall[steady]),
            "cpu": statistics.median(cpu[steady]),
            "wrote": statistics.median(wrote[steady]),
            "fp_share": sum(fps[steady]) / sum(cpu[steady]),
            "changed": changed,
            "root": _root_bytes(root),
            "one": _one_step_bytes(root),
            "restore": restore_s,
        }
    finally:
        inc.fingerprints = staging.fingerprints = real  # type: ignore[assignment]
        import shutil

        shutil.rmtree(root.parent, ignore_errors=True)


def run_s3(kind: str, incremental: bool, saves: int, endpoint: str) -> dict[str, Any]:
    """Saves straight to a fresh moto bucket through a byte-counting proxy: bytes sent per save."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests.helpers
    from tests.helpers.s3 import new_bucket
    from tests.helpers.stores import s3_store
    from tests.helpers.tcpproxy import proxied, tcp_proxy

    torch.manual_seed(0)
    model = MODELS[kind]()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    changed = 3 * sum(p.nbytes for p in model.parameters() if p.requires_grad)
    state = safepoint.TrainState(model=model, optimizer=opt)
    writer = safepoint.WriterOptions(incremental=incremental, full_every=0)
    url = f"s3://{new_bucket(endpoint)}/run"
    sent, wall = [], []
    with tcp_proxy(endpoint) as proxy:
        opts = proxied(s3_store(endpoint), proxy).options
        with safepoint.CheckpointManager(
            url, storage_options=opts, keep=safepoint.Keep(last=3), writer=writer
        ) as mgr:
            for step in range(1, saves + 1):
                model.loss().backward()
                opt.step()
                opt.zero_grad()
                proxy.reset_counts()
                t0 = time.perf_counter()
                mgr.save(step, state)
                wall.append(time.perf_counter() - t0)
                sent.append(proxy.up)
    steady = slice(3, None)
    return {
        "sent": statistics.median(sent[steady]),
        "wall": statistics.median(wall[steady]),
        "changed": changed,
    }


def main_s3(args: argparse.Namespace) -> None:
    from moto.server import ThreadedMotoServer

    os.environ.update(
        AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1"
    )
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{server._server.server_port}"  # type: ignore[attr-defined]
    try:
        for kind in args.models.split(","):
            results: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
            loads = []
            for _ in range(args.rounds):
                for incremental in (False, True):  # interleaved
                    loads.append(os.getloadavg()[0])
                    results[incremental].append(run_s3(kind, incremental, args.saves, endpoint))
            full = {k: statistics.median(r[k] for r in results[False]) for k in ("sent", "wall")}
            inc_ = {k: statistics.median(r[k] for r in results[True]) for k in ("sent", "wall", "changed")}
            print(
                f"== {kind} straight to S3 (moto): changed bytes per save {inc_['changed'] / MiB:.2f} MiB; "
                f"load avg {min(loads):.1f}-{max(loads):.1f}"
            )
            print(
                f"  bytes sent per steady save: full {full['sent'] / MiB:.2f} MiB, incremental "
                f"{inc_['sent'] / MiB:.2f} MiB = {inc_['sent'] / inc_['changed']:.2f}x changed, "
                f"{inc_['sent'] / full['sent']:.3f}x full"
            )
            print(
                f"  steady save wall: full {full['wall'] * 1e3:.0f} ms, "
                f"incremental {inc_['wall'] * 1e3:.0f} ms "
                f"= {inc_['wall'] / full['wall']:.2f}x"
            )
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--saves", type=int, default=8)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--models", default="lora,embedding,dense")
    ap.add_argument("--process", action="store_true", help="async saves through the writer process")
    ap.add_argument("--s3", action="store_true", help="save straight to a moto S3 bucket, count bytes sent")
    args = ap.parse_args()
    if args.s3:
        main_s3(args)
        return
    for kind in args.models.split(","):
        results: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        loads = []
        for _ in range(args.rounds):
            for incremental in (False, True):  # interleaved: full, incremental, full, ...
                loads.append(os.getloadavg()[0])
                results[incremental].append(run(kind, incremental, args.saves, Path(args.dir), args.process))

        report(kind, results, loads)


def report(kind: str, results: dict[bool, list[dict[str, Any]]], loads: list[float]) -> None:
    def full(key: str) -> float:
        return statistics.median(r[key] for r in results[False])

    def incr(key: str) -> float:
        return statistics.median(r[key] for r in results[True])

    changed = incr("changed")
    span = f"{min(loads):.1f}-{max(loads):.1f}"
    print(f"== {kind}: changed bytes per save {changed / MiB:.2f} MiB; load avg {span}")
    print(
        f"  bytes written per steady save: full {full('wrote') / MiB:.1f} MiB, incremental "
        f"{incr('wrote') / MiB:.2f} MiB = {incr('wrote') / changed:.2f}x changed "
        f"(target <= 1.2x + 1 MiB: {incr('wrote') <= 1.2 * changed + MiB})"
    )
    print(
        f"  steady save wall: full {full('wall') * 1e3:.0f} ms, incremental {incr('wall') * 1e3:.0f} ms "
        f"= {incr('wall') / full('wall'):.2f}x; CPU {full('cpu') * 1e3:.0f} vs {incr('cpu') * 1e3:.0f} ms"
    )
    print(
        f"  root with keep_last=3: full {full('root') / full('one'):.2f}x one checkpoint, incremental "
        f"{incr('root') / incr('one'):.2f}x"
    )
    print(
        f"  restore: full {full('restore') * 1e3:.0f} ms, incremental {incr('restore') * 1e3:.0f} ms "
        f"= {incr('restore') / full('restore'):.2f}x"
    )
    print(f"  fingerprinting: {incr('fp_share') * 100:.1f}% of the save's CPU time")


if __name__ == "__main__":
    main()
