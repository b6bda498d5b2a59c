"""The CUDA path of a save (issue 27), on a GPU machine: how long the loop is blocked, against a pinned copy.

A state of parameters + Adam moments lives on the GPU. Each round saves it with every variant in turn
(interleaved, the order rotated each round), and reports, per variant, the time the caller was blocked:

- ``pinned-copy``: the reference. The same tensors copied into pinned host buffers allocated once
  (``copy_(non_blocking=True)`` then a synchronize): the least any checkpoint can block for these bytes.
- ``pinned-foreach``: the same copy as one ``torch._foreach_copy_`` (what staging does since the
  ``stagefast`` round); ``x_floor`` is each variant's ratio to the faster of the two.
- ``pinned-arena``: the same ``torch._foreach_copy_`` into buffers laid in one shared-memory segment
  pinned with ``cudaHostRegister``, as the process writer's staging buffers are (``SharedArena``), where
  ``pinned-foreach``'s come from torch's pinned allocator: whether that memory alone makes the copy of
  many small tensors slower (issue 27: at 9,000 tensors the process writer blocked 1.67x the pinned copy,
  the thread writer 1.02x, where on CPU both block alike).
- ``pinned-bulk``: the same number of bytes in one device-to-host copy from one contiguous device tensor:
  the transfer alone, without a launch per tensor (what gathered staging, save/gather.py, approaches for
  a state of many small tensors); ``x_bulk`` is each variant's ratio to it.
- ``sp-async-process`` / ``sp-async-thread``: ``CheckpointManager(async_save=True)`` with the writer process
  (default) or thread; blocked = the time ``save()`` took (capture + staging into pinned buffers). Each
  record also has ``cpu_s`` (the calling thread's CPU time in ``save()``), ``gc_s`` (cyclic collections
  on that thread inside ``save()``), ``copy_s`` (staging's copy, the side stream's synchronize
  included), so a gap between the two writers shows where it lies, and ``gathered`` (the tensors staging
  copied through save/gather.py's chunks).
- ``sp-sync``: a sync save, the whole write; ``torch-save``: ``torch.save`` of the state + fsync.
- ``dcp-async``: ``dcp.async_save`` with its default stager (thread), blocked = its return.

Targets (issue 27): the async blocking <= 1.2x the pinned copy. Also checks, every round, that the staging
buffers are pinned and allocated once, and prints the card. Run::

    PYTHONPATH=src python benchmarks/bench_gpu.py --cases 2048x300,512x3000 --rounds 3 --out gpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import async_save

import safepoint

SCENARIOS = ("step", "frozen-steps", "frozen-half")
KEEP = safepoint.Keep(last=1)  # one checkpoint per manager: the bench holds GiBs in /dev/shm
VARIANTS = ("pinned-copy", "pinned-foreach", "pinned-arena", "pinned-bulk", "sp-async-process",
            "sp-async-thread", "sp-sync", "torch-save", "dcp-async")  # fmt: skip


class Bag(nn.Module):
    def __init__(self, n: int, numel: int) -> None:
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.empty(numel)) for _ in range(n))


def make_state(size_bytes: int, n_tensors: int, device: torch.device) -> tuple[Bag, torch.optim.Adam]:
    """Parameters + Adam's two moments adding up to ``size_bytes`` in ``3 * n_tensors`` tensors."""
    numel = max(1, size_bytes // (3 * 4 * n_tensors))
    torch.manual_seed(0)
    model = Bag(n_tensors, numel).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach() for p in model.parameters()]
    for st in opt.state.values():
        out.extend(v for v in st.values() if isinstance(v, torch.Tensor) and v.numel() > 1)
    return out


def changer(model: nn.Module, opt: torch.optim.Optimizer, scenario: str) -> Any:
    """What changes between two saves (``--scenario``), as a function. ``step``: a training step's worth,
    every tensor: the parameters, Adam's moments and its step counts, as ``opt.step()`` changes them (until
    the ``stagefast`` round only the parameters changed, and the unchanged moments went through the
    incremental check instead of the copy). ``frozen-steps``: the parameters and moments, not the 0-d step
    counts (what ``profile_gpu_save.py`` changed before the ``gpustage`` round): a mix of written and
    untouched tensors, so every save goes through the per-tensor incremental check. ``frozen-half``: the
    first half of the parameters and their Adam state, as ``opt.step()`` changes them; the other half
    untouched (frozen layers, or parameters that got no gradient: Adam leaves their state as it was)."""
    params = [p.detach() for p in model.parameters()]
    # Each parameter's two moments, in parameter order (Adam's state: step, exp_avg, exp_avg_sq).
    moments = [opt.state[p][k] for p in model.parameters() for k in ("exp_avg", "exp_avg_sq")]
    steps = [opt.state[p]["step"] for p in model.parameters()]
    half = len(params) // 2
    written = {
        "step": (params + moments, steps),
        "frozen-steps": (params + moments, []),
        "frozen-half": (params[:half] + moments[: 2 * half], steps[:half]),
    }[scenario]

    def change() -> None:
        with torch.no_grad():
            torch._foreach_add_(written[0], 1e-3)
            if written[1]:
                torch._foreach_add_(written[1], 1.0)

    return change


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Runner:
    def __init__(self, base: Path, model: Bag, opt: torch.optim.Adam, scenario: str = "step") -> None:
        self.base, self.model, self.opt = base, model, opt
        self._change = changer(model, opt, scenario)
        self.state = safepoint.TrainState(model=model, optimizer=opt, rng=False)
        src = state_tensors(model, opt)
        pin = torch.cuda.is_available()
        self.src = src
        self.bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in src]
        from safepoint.save.shared_buffers import move_into_arena

        # The process writer's kind of pinned memory: one memfd segment, cudaHostRegister'd.
        self.arena_bufs = [torch.empty(t.shape, dtype=t.dtype) for t in src]
        self.arena = move_into_arena(self.arena_bufs, pin=pin)
        nbytes = sum(t.numel() * t.element_size() for t in src)
        self.bulk_src = torch.zeros(nbytes, dtype=torch.uint8, device=src[0].device)
        self.bulk_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.mgrs = {
            "sp-async-process": safepoint.CheckpointManager(
                base / "proc",
                async_save=True,
                keep=KEEP,
                writer=safepoint.WriterOptions(async_writer="process"),
            ),
            "sp-async-thread": safepoint.CheckpointManager(
                base / "thread",
                async_save=True,
                keep=KEEP,
                writer=safepoint.WriterOptions(async_writer="thread"),
            ),
            "sp-sync": safepoint.CheckpointManager(base / "sync", keep=KEEP),
        }
        process = self.mgrs["sp-async-process"]._process
        if process is not None:  # every save, the warm-up's too, goes to the process (not the thread)
            process.wait_ready()
        self.copy_s = 0.0  # staging's copy inside the last save
        for name in ("sp-async-process", "sp-async-thread"):
            self._time_copies(self.mgrs[name]._stager)
        self.gc_s = 0.0
        self._gc_on, self._gc_t0 = False, 0.0
        gc.callbacks.append(self._gc_callback)
        self.step = 0

    def _time_copies(self, stager: Any) -> None:
        for attr in ("_copy_on_side_stream", "_copy"):
            inner = getattr(stager, attr)

            def timed(*args: Any, _inner: Any = inner, _attr: str = attr) -> Any:
                t0 = time.perf_counter()
                try:
                    return _inner(*args)
                finally:
                    if _attr == "_copy_on_side_stream" or not torch.cuda.is_available():
                        self.copy_s += time.perf_counter() - t0

            setattr(stager, attr, timed)

    def _gc_callback(self, phase: str, info: dict[str, Any]) -> None:
        if self._gc_on and threading.current_thread() is threading.main_thread():
            if phase == "start":
                self._gc_t0 = time.perf_counter()
            else:
                self.gc_s += time.perf_counter() - self._gc_t0

    def pinned_copy(self) -> None:
        for s, d in zip(self.src, self.bufs, strict=True):
            d.copy_(s, non_blocking=True)
        sync()

    def touch(self) -> None:
        self._change()
        sync()

    def run(self, variant: str) -> dict[str, Any]:
        self.step += 1
        self.touch()
        rec: dict[str, Any] = {"variant": variant, "step": self.step}
        if variant == "pinned-copy":
            t0 = time.perf_counter()
            self.pinned_copy()
            rec["blocked_s"] = time.perf_counter() - t0
            return rec
        if variant in ("pinned-foreach", "pinned-arena"):
            bufs = self.bufs if variant == "pinned-foreach" else self.arena_bufs
            t0 = time.perf_counter()
            torch._foreach_copy_(bufs, self.src, non_blocking=True)
            sync()
            rec["blocked_s"] = time.perf_counter() - t0
            return rec
        if variant == "pinned-bulk":
            t0 = time.perf_counter()
            self.bulk_dst.copy_(self.bulk_src, non_blocking=True)
            sync()
            rec["blocked_s"] = time.perf_counter() - t0
            return rec
        if variant in self.mgrs:
            mgr = self.mgrs[variant]
            mgr.wait()
            self.copy_s = self.gc_s = 0.0
            self._gc_on = True
            c0, t0 = time.thread_time(), time.perf_counter()
            mgr.save(self.step, self.state)
            rec["blocked_s"] = time.perf_counter() - t0
            rec["cpu_s"] = time.thread_time() - c0
            self._gc_on = False
            rec["gc_s"], rec["copy_s"] = self.gc_s, self.copy_s
            mgr.wait()
            rec["durable_s"] = time.perf_counter() - t0
            stager = getattr(mgr, "_stager", None)
            bufs = getattr(stager, "_buffers", None)
            if bufs is not None:
                from safepoint.save.shared_buffers import buffer_tensors

                found = list(buffer_tensors(bufs))
                rec["staging_pinned"] = all(t.is_pinned() for t in found if t.numel() > 1)
                rec["staging_allocations"] = stager.allocations
                rec["gathered"] = stager.gathered
            return rec
        if variant == "torch-save":
            path = self.base / f"torch-{self.step}.pt"
            t0 = time.perf_counter()
            torch.save({"model": self.model.state_dict(), "optim": self.opt.state_dict()}, path)
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            rec["blocked_s"] = rec["durable_s"] = time.perf_counter() - t0
            path.unlink()
            return rec
        if variant == "dcp-async":
            out = self.base / f"dcp-{self.step}"
            sd = {"model": self.model.state_dict(), "optim": self.opt.state_dict()}
            t0 = time.perf_counter()
            fut = async_save(sd, storage_writer=FileSystemWriter(out, sync_files=True), no_dist=True)
            rec["blocked_s"] = time.perf_counter() - t0
            done = fut.result() if hasattr(fut, "result") else fut.upload_completion.result()
            del done
            rec["durable_s"] = time.perf_counter() - t0
            shutil.rmtree(out, ignore_errors=True)
            return rec
        raise ValueError(variant)

    def close(self) -> None:
        gc.callbacks.remove(self._gc_callback)
        for mgr in self.mgrs.values():
            mgr.close()
        self.arena_bufs.clear()
        self.arena.release()


def rotated(xs: Sequence[str], k: int) -> list[str]:
    k %= len(xs)
    return list(xs[k:]) + list(xs[:k])


def bench(
    size_mib: int, n_tensors: int, rounds: int, base: Path, variants: Sequence[str], scenario: str = "step"
) -> dict[str, Any]:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model, opt = make_state(size_mib << 20, n_tensors, device)
    runner = Runner(base, model, opt, scenario)
    runs: list[dict[str, Any]] = []
    try:
        for v in variants:  # warm-up: allocations, the writer process, CUDA contexts
            runner.run(v)
        for r in range(rounds):
            for v in rotated(variants, r):
                rec = runner.run(v)
                rec["round"] = r
                runs.append(rec)
                print(json.dumps(rec), flush=True)
    finally:
        runner.close()
    med: dict[str, float] = {}
    parts: dict[str, dict[str, float]] = {}
    for v in variants:
        xs = [x["blocked_s"] for x in runs if x["variant"] == v]
        med[v] = statistics.median(xs)
        for part in ("cpu_s", "gc_s", "copy_s"):
            ys = [x[part] for x in runs if x["variant"] == v and part in x]
            if ys:
                parts.setdefault(v, {})[part] = statistics.median(ys)
    ratios = {v: med[v] / med["pinned-copy"] for v in variants if "pinned-copy" in med}
    floors = [med[v] for v in ("pinned-copy", "pinned-foreach") if v in med]  # torch's pinned memory
    to_floor = {v: med[v] / min(floors) for v in variants} if floors else {}
    to_bulk = {v: med[v] / med["pinned-bulk"] for v in variants} if "pinned-bulk" in med else {}
    nbytes = sum(t.numel() * t.element_size() for t in state_tensors(model, opt))
    return {"size_bytes": nbytes, "tensors": len(state_tensors(model, opt)), "median_blocked_s": med,
            "x_pinned_copy": ratios, "x_floor": to_floor, "x_bulk": to_bulk, "median_parts_s": parts,
            "loadavg": os.getloadavg(), "runs": runs}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--cases",
        type=lambda s: [tuple(int(v) for v in c.split("x")) for c in s.split(",")],
        default=[(2048, 300), (512, 3000)],
        help="MIBxPARAMS,...: state MiB (params + Adam) and parameter count (default 2048x300,512x3000)",
    )
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default="step",
        help="what changes between saves (Runner.touch): every tensor (a training step, the default), all "
        "but Adam's 0-d step counts, or half the parameters with their Adam state",
    )
    p.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    p.add_argument("--dir", default=None, help="where checkpoints go (default: /dev/shm if there, else tmp)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    where = Path(args.dir or ("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()))
    meta: dict[str, Any] = {"torch": torch.__version__, "location": str(where)}
    if torch.cuda.is_available():
        meta["card"] = torch.cuda.get_device_name(0)
    results: dict[str, Any] = {"meta": meta, "cases": []}
    for size, n in args.cases:
        base = Path(tempfile.mkdtemp(prefix="sp-gpu-", dir=where))
        try:
            case = bench(size, n, args.rounds, base, args.variants, args.scenario)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        case.update(size_mib=size, n_param=n, scenario=args.scenario)
        results["cases"].append(case)
        summary = {k: v for k, v in case.items() if k != "runs"}
        print(json.dumps(summary, indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
