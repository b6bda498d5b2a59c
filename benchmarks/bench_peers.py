"""safepoint against what a user would pick instead: dcp, torch.save, meta-pytorch's torch-checkpointing.

Every variant runs in this one process, interleaved with the others in each round, the order rotated by
one each round; each is paired with ``torch.save`` (+ fsync) of the same round and the median of the
paired ratios is reported. Two states: ``small`` (LAYERS x ``Linear(132, 132)`` + Adam: 1,250 layers make
10,018 DCP items, ~250 MiB; 625 layers the 5,000-tensor variant) and ``large`` (one ``Linear(W, W)`` + Adam:
a few tensors of W*W*4 bytes). Save variants, all timed until the checkpoint is durable:

- ``torch.save``: one file, then fsync. The baseline.
- ``safepoint-sync``: ``CheckpointManager.save`` (capture, crc32c, manifest, atomic commit).
- ``safepoint-async``: ``CheckpointManager(async_save=True).save`` then ``wait()`` (its blocking part is
  reported too).
- ``safepoint-async-nice0``: the same with the writer thread at normal priority (``WRITER_NICE = 0``;
  by default it runs at nice 10 so that training wins the CPU, which on a shared machine also lets every
  other process win it).
- ``dcp.save``: ``get_state_dict`` + ``dcp.save`` with ``FileSystemWriter(sync_files=True)``.
- ``dcp.async_save``: the same through ``dcp.async_save`` with its default stager, until its future ends.
- ``dcp.async_save-stager``: with one ``DefaultStager`` reused across saves.
- ``tc-sync`` / ``tc-async``: torch-checkpointing's ``CheckpointManager`` (sync and its default async
  saver) on ``LocalFileSystemStorageConfig(use_direct_io=False)``; its files and directories are then
  fsynced here (it does not fsync), so every variant is equally durable.

Restore variants: ``torch.load`` + ``load_state_dict`` (baseline), ``safepoint`` (verified restore),
``dcp.load`` (+ ``set_state_dict``), ``tc`` (torch-checkpointing's ``load`` into the live state).
Install the peer with ``pip install -e '.[bench]'``; without it the ``tc-*`` variants are skipped.

``cpu s`` is this process's CPU (all threads); ``helper cpu s`` that of its live child processes during the
save (safepoint's writer process, torch-checkpointing's saver process), which ``cpu s`` cannot see.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import resource
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed.checkpoint as dcp
from _common import linear_adam, loadavg, markdown_table, median, paired_ratios, quartiles, rotated, timed
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import safepoint
from safepoint.save import background

try:
    import torch_checkpointing as tc
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
except ImportError:  # the benchmark-only extra is not installed
    tc = None

SAVES = (
    "torch.save",
    "safepoint-sync",
    "safepoint-async",
    "safepoint-async-nice0",
    "dcp.save",
    "dcp.async_save",
    "dcp.async_save-stager",
    "tc-sync",
    "tc-async",
)
RESTORES = ("torch.load", "safepoint", "dcp.load", "tc")


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` and every directory (for peers that do not)."""
    paths = [path] if path.is_file() else [*path.rglob("*"), path]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Peers:
    def __init__(self, base: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.base, self.model, self.opt = base, model, opt
        self.state = safepoint.TrainState(model=model, optimizer=opt)
        self.sp = safepoint.CheckpointManager(base / "sp-sync", keep=safepoint.Keep(last=1))
        self.sp_async = safepoint.CheckpointManager(
            base / "sp-async", async_save=True, keep=safepoint.Keep(last=1)
        )
        opts = StagingOptions(False, False, True, False)  # pinned, shared, async staging, non-blocking
        self.stager = DefaultStager(opts)
        self.tc_sync = self.tc_async = None
        if tc is not None:
            storage = LocalFileSystemStorageConfig(use_direct_io=False)
            self.tc_sync = tc.CheckpointManager(
                tc.CheckpointManager.Config(save=tc.SyncCheckpointSaverConfig(), storage_config=storage)
            )
            self.tc_async = tc.CheckpointManager(
                tc.CheckpointManager.Config(save=tc.AsyncCheckpointSaverConfig(), storage_config=storage)
            )
        self.step = 0
        self.blocking: dict[str, float] = {}

    def plain(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def dcp_sd(self) -> dict[str, Any]:
        m, o = get_state_dict(self.model, self.opt)
        return {"model": m, "optim": o}

    def save(self, variant: str, out: Path) -> Callable[[], None]:
        self.step += 1
        step = self.step

        def torch_save() -> None:
            with open(out, "wb") as f:
                torch.save(self.plain(), f)
                f.flush()
                os.fsync(f.fileno())

        def sp_async(nice: int | None = None) -> None:
            default = background.WRITER_NICE
            if nice is not None:
                background.WRITER_NICE = nice  # read by the writer thread as it starts
            try:
                t = timed(lambda: self.sp_async.save(step, self.state))
                self.blocking[variant] = t.seconds
                self.sp_async.wait()
            finally:
                background.WRITER_NICE = default

        def dcp_async(stager: DefaultStager | None) -> None:
            writer = dcp.FileSystemWriter(out, single_file_per_rank=True, sync_files=True)
            fut = dcp.async_save(self.dcp_sd(), storage_writer=writer, async_stager=stager, no_dist=True)
            (fut if hasattr(fut, "result") else fut.upload_completion).result()

        def tc_save(mgr: Any) -> None:
            fut = mgr.save(str(out), self.plain())
            if fut is not None:
                fut.result()
            fsync_tree(out)

        return {
            "torch.save": torch_save,
            "safepoint-sync": lambda: self.sp.save(step, self.state),
            "safepoint-async": sp_async,
            "safepoint-async-nice0": lambda: sp_async(0),
            "dcp.save": lambda: dcp.save(
                self.dcp_sd(),
                storage_writer=dcp.FileSystemWriter(out, single_file_per_rank=True, sync_files=True),
                no_dist=True,
            ),
            "dcp.async_save": lambda: dcp_async(None),
            "dcp.async_save-stager": lambda: dcp_async(self.stager),
            "tc-sync": lambda: tc_save(self.tc_sync),
            "tc-async": lambda: tc_save(self.tc_async),
        }[variant]

    def restore(self, variant: str, src: Path) -> Callable[[], None]:
        def torch_load() -> None:
            sd = torch.load(src, weights_only=True)
            self.model.load_state_dict(sd["model"])
            self.opt.load_state_dict(sd["optim"])

        def dcp_load() -> None:
            sd = self.dcp_sd()
            dcp.load(sd, checkpoint_id=src, no_dist=True)
            set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

        def tc_load() -> None:
            assert self.tc_sync is not None
            got = self.tc_sync.load(str(src), into=self.plain())
            self.model.load_state_dict(got["model"])
            self.opt.load_state_dict(got["optim"])

        return {
            "torch.load": torch_load,
            "safepoint": lambda: self.sp.restore(self.state),
            "dcp.load": dcp_load,
            "tc": tc_load,
        }[variant]

    def close(self) -> None:
        self.sp.close()
        self.sp_async.close()
        self.stager.close()
        for mgr in (self.tc_sync, self.tc_async):
            if mgr is not None:
                mgr.close()


def make_state(kind: str, layers: int, width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    return linear_adam(layers) if kind == "small" else linear_adam(1, width)


def helpers_cpu() -> dict[int, float]:
    """CPU seconds so far of each live child process (safepoint's writer process, torch-checkpointing's
    saver): ``timed`` counts only children that were waited for, and these live on between saves."""
    out = {}
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            times = child.cpu_times()
            out[child.pid] = times.user + times.system
    return out


def helpers_cpu_since(before: dict[int, float]) -> float:
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in helpers_cpu().items())


def remove(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()


def run_state(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    model, opt = make_state(kind, args.layers, args.width)
    base = Path(args.base) / f"safepoint-bench-peers-{kind}"
    remove(base)
    base.mkdir(parents=True)
    peers = Peers(base, model, opt)
    saves = [v for v in args.saves if tc is not None or not v.startswith("tc")]
    restores = [v for v in args.restores if tc is not None or v != "tc"]
    runs: list[dict[str, Any]] = []
    try:
        for rnd in range(-1, args.rounds):  # round -1: untimed warm-up
            for v in rotated(saves, rnd):
                out = base / f"save-{v}"
                gc.collect()
                helpers = helpers_cpu()
                try:
                    t = timed(peers.save(v, out))
                except Exception as e:  # a failed save is a result too: recorded, reported, not timed
                    runs.append({"phase": "save", "variant": v, "round": rnd, "error": repr(e)})
                    print(f"{kind} save {v} round {rnd} failed: {e!r}", flush=True)
                    remove(out)
                    continue
                runs.append(
                    {
                        "phase": "save",
                        "variant": v,
                        "round": rnd,
                        "s": t.seconds,
                        "cpu_s": t.cpu_s,
                        "helper_cpu_s": helpers_cpu_since(helpers),
                        "blocking_s": peers.blocking.pop(v, None),
                        "loadavg_1m": loadavg()[:1],
                    }
                )
                remove(out)
        sources = {"torch.load": base / "ck.pt", "dcp.load": base / "ck-dcp", "tc": base / "ck-tc"}
        for v, src in sources.items():
            if v in restores:
                peers.save({"torch.load": "torch.save", "dcp.load": "dcp.save", "tc": "tc-sync"}[v], src)()
        peers.sp.save(10**6, peers.state)
        for rnd in range(-1, args.rounds):
            for v in rotated(restores, rnd):
                gc.collect()
                t = timed(peers.restore(v, sources.get(v, base)))
                runs.append(
                    {
                        "phase": "restore",
                        "variant": v,
                        "round": rnd,
                        "s": t.seconds,
                        "cpu_s": t.cpu_s,
                        "loadavg_1m": loadavg()[:1],
                    }
                )
    finally:
        peers.close()
        remove(base)
    n_items = len(get_state_dict(model, opt)[0]) + sum(len(s) for s in opt.state.values())
    return {"state": kind, "tensors": n_items, "runs": [r for r in runs if r["round"] >= 0]}


def summarize(result: dict[str, Any]) -> list[list[str]]:
    rows = []
    for phase, base in (("save", "torch.save"), ("restore", "torch.load")):
        failed = [r for r in result["runs"] if r["phase"] == phase and "error" in r]
        runs = [r for r in result["runs"] if r["phase"] == phase and "error" not in r]
        ref = {r["round"]: r["s"] for r in runs if r["variant"] == base}
        for v in dict.fromkeys(r["variant"] for r in result["runs"] if r["phase"] == phase):
            mine = [r for r in runs if r["variant"] == v]
            if not mine:
                rows.append(
                    [result["state"], phase, v, *[""] * 6, str(sum(r["variant"] == v for r in failed))]
                )
                continue
            ratios = paired_ratios({r["round"]: r["s"] for r in mine}, ref, lambda a, b: a / b)
            q1, q3 = quartiles(ratios)
            blocking = [r["blocking_s"] for r in mine if r.get("blocking_s") is not None]
            helper = [r["helper_cpu_s"] for r in mine if r.get("helper_cpu_s") is not None]
            rows.append(
                [
                    result["state"],
                    phase,
                    v,
                    f"{median(r['s'] for r in mine):.3f}",
                    f"{median(ratios):.2f} ({q1:.2f}-{q3:.2f})",
                    f"{median(r['cpu_s'] for r in mine):.2f}",
                    f"{median(helper):.2f}" if helper else "",
                    f"{median(blocking):.3f}" if blocking else "",
                    f"{median(r['loadavg_1m'][0] for r in mine if r['loadavg_1m']):.1f}",
                    str(sum(r["variant"] == v for r in failed)),
                ]
            )
    return rows


COLUMNS = [
    "state",
    "phase",
    "variant",
    "median s",
    "x torch paired (q1-q3)",
    "cpu s",
    "helper cpu s",
    "blocking s",
    "load 1m",
    "failed",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--states", default="small,large")
    p.add_argument("--layers", type=int, default=1250, help="Linear(132, 132) layers of the small state")
    p.add_argument("--width", type=int, default=4096, help="W of the large state's Linear(W, W)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--base", default="/dev/shm")
    p.add_argument("--saves", default=",".join(SAVES))
    p.add_argument("--restores", default=",".join(RESTORES))
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--out", default="bench-out/peers")
    args = p.parse_args()
    args.saves, args.restores = args.saves.split(","), args.restores.split(",")
    torch.set_num_threads(args.torch_threads)
    # torch-checkpointing's async saver keeps one shared-memory descriptor per tensor open (still after
    # close): 10,000 tensors ran out of the default 20,000 descriptors here. Root may raise the limit.
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (262144, 262144))
    if tc is not None:
        # Its async saver sends every staged tensor to its writer process, by default as one duplicated
        # descriptor each: 10,000 tensors still ran out. torch's documented remedy for many tensors.
        torch.multiprocessing.set_sharing_strategy("file_system")
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    meta = {
        "started": started,
        "loadavg_start": loadavg(),
        "args": vars(args),
        "torch_checkpointing": getattr(tc, "__version__", None),
    }
    results = [run_state(kind, args) for kind in args.states.split(",")]
    meta["loadavg_end"] = loadavg()
    rows = [row for r in results for row in summarize(r)]
    text = markdown_table(COLUMNS, rows)
    caption = (
        f"{started} UTC, rounds {args.rounds}, tensors "
        f"{', '.join(str(r['state']) + '=' + str(r['tensors']) for r in results)}, load average "
        f"{meta['loadavg_start']} at the start, {meta['loadavg_end']} at the end"
    )
    print(caption + "\n\n" + text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_peers.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "bench_peers.md").write_text(caption + "\n\n" + text + "\n")


if __name__ == "__main__":
    main()
