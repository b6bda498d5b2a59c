"""Workloads the torture children run (under the fault layer), and the state they save.

Every tensor of a saved state (parameters and both Adam moments) holds one number, the save's *version*,
and ``extra["version"]`` records it: a restored state is checked to be exactly one save's, never a mix.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

import safepoint
from tests.torture import faults
from tests.torture.dist_train import wait_at_gate

# The baseline every crash case starts from (committed by a clean process), and the saves run on top:
# a new step (retention deletes step 1), a replacement of that step (renameat2 exchange), a new step
# (retention deletes step 2).
BASELINE: list[tuple[int, int]] = [(1, 10), (2, 20)]
PLAN: list[tuple[int, int]] = [(3, 30), (3, 31), (4, 40)]
KEEP_LAST = 2


class Model:
    """A small model with optimizer state; every tensor is set to the save's version before saving."""

    def __init__(self, shape: tuple[int, int] = (16, 8)) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(*shape)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.model(torch.randn(2, shape[0])).sum().backward()
        self.opt.step()
        self.extra: dict[str, Any] = {"version": -1}
        self.state = safepoint.TrainState(model=self.model, optimizer=self.opt, extra=self.extra, rng=False)

    def tensors(self) -> list[torch.Tensor]:
        out = [p.data for p in self.model.parameters()]
        out += [st["momentum_buffer"] for st in self.opt.state.values()]
        return out

    def fill(self, version: int) -> None:
        with torch.no_grad():
            for t in self.tensors():
                t.fill_(version)
        self.extra["version"] = version

    def version(self) -> int:
        """The one version every tensor holds (AssertionError if the state is a mix or torn)."""
        v = int(self.extra["version"])
        for t in self.tensors():
            assert torch.all(t == v), f"a tensor does not hold version {v}: torn or mixed checkpoint"
        return v


def make_baseline(root: Path, writer_threads: int = 1) -> None:
    """Commit the baseline checkpoints (in a clean process: no fault layer)."""
    m = Model()
    with safepoint.CheckpointManager(root, writer=safepoint.WriterOptions(threads=writer_threads)) as mgr:
        for step, version in BASELINE:
            m.fill(version)
            mgr.save(step, m.state, metrics={"version": version})


def _listing(mgr: safepoint.CheckpointManager) -> dict[int, int]:
    return {c.step: int(c.metrics.get("version", -1)) for c in mgr.list()}


def workload(
    layer: faults.Layer | None,
    root: str,
    plan: list[list[int]],
    keep_last: int = KEEP_LAST,
    writer_threads: int = 1,
    async_save: bool = False,
    patches: tuple[str, ...] = (),
    background_deletes: bool = True,
    drain: bool = True,
) -> dict[str, Any]:
    """Save each (step, version) of ``plan``; a failed save is reported and training goes on.

    Each outcome records what was listed before and after the save and what was left in .pending.
    ``drain``: ``wait()`` after each save, so retention's deletes (on the deleter thread by default) are
    done before the next save begins: every run issues the same operations in the same order, which the
    crash campaign's trace check compares. False: they run alongside the next save (the operations
    interleave differently each run; the campaign checks the invariants, not the order).
    """
    apply_patches(patches)
    m = Model()
    mark = layer.mark if layer is not None else (lambda **_: None)
    outcomes: list[dict[str, Any]] = []
    mark(what="start")
    # The fault layer patches this process's file operations: the writes must happen here, on the thread.
    with safepoint.CheckpointManager(
        root,
        async_save=async_save,
        writer=safepoint.WriterOptions(threads=writer_threads, async_writer="thread"),
        cluster=safepoint.ClusterOptions(background_deletes=background_deletes),
        keep=safepoint.Keep(last=keep_last),
    ) as mgr:
        mark(what="ready")
        for step, version in plan:
            m.fill(version)
            before = _listing(mgr)
            mark(what="begin", step=step, version=version)
            outcome: dict[str, Any] = {"step": step, "version": version, "ok": True}
            try:
                mgr.save(step, m.state, metrics={"version": version}, overwrite=True)  # PLAN replaces a step
                if async_save:
                    # The next call into the manager surfaces a background failure (async_next_call
                    # checks that save() does too); wait() keeps the saves apart here.
                    mgr.wait()
                mark(what="returned", step=step, version=version)
                if drain:
                    mgr.wait()  # the deleter's pass for this save: done before the listing and next save
                    mark(what="drained", step=step, version=version)
            except safepoint.SaveError as e:
                outcome.update(ok=False, error=str(e))
                mark(what="failed", step=step, version=version)
            if layer is not None and layer.faults:
                layer.disarm()  # the disk has been freed / the device recovered: training goes on
            outcome.update(
                before=before,
                after=_listing(mgr),
                pending=sorted(os.listdir(os.path.join(root, ".pending"))),
            )
            outcomes.append(outcome)
        mark(what="closing")
    mark(what="closed")
    return {"outcomes": outcomes}


def async_next_call(layer: faults.Layer | None, root: str) -> dict[str, Any]:
    """Async: a background failure surfaces from the *next* save() call, and the one after works."""
    m = Model()
    out: dict[str, Any] = {}
    # The fault layer patches this process's file operations: the writes must happen here, on the thread.
    with safepoint.CheckpointManager(
        root,
        async_save=True,
        # "wait": save(4) waits for step 3's write and raises its failure (the default, "auto", would write
        # step 4 synchronously beside a write still in flight; its failure would surface a call later).
        writer=safepoint.WriterOptions(async_writer="thread", if_busy="wait"),
        keep=safepoint.Keep(last=KEEP_LAST),
    ) as mgr:
        m.fill(30)
        mgr.save(3, m.state)  # returns once staged; the fault (if any) hits the background writer
        m.fill(40)
        try:
            mgr.save(4, m.state)  # waits for step 3's writer, then raises its failure
            out["second"] = "ok"
        except safepoint.SaveError as e:
            out["second"] = f"SaveError: {e}"
            if layer is not None:
                layer.disarm()
            mgr.save(4, m.state)  # training continues: the retry is accepted
        try:
            mgr.wait()
            out["wait"] = "ok"
        except safepoint.SaveError as e:
            out["wait"] = f"SaveError: {e}"
        out["listed"] = [c.step for c in mgr.list()]
    return out


def _skipping_fsync_dir(real: Any, skip: Any) -> Any:
    def fsync_dir(path: Any) -> None:
        if not skip(Path(path)):
            real(path)

    return fsync_dir


def _commit_no_rollback(self: Any, pending: Path, manifest: Any) -> Path:
    """Layout.commit (and its renameat2 replacement) before the fix: an fsync of ROOT that fails after the
    commit rename or exchange is raised with the new step left listed (no rename back, no swap back)."""
    from safepoint.store import posix_layout as layout

    layout.write_file_durably(pending / layout.MANIFEST_NAME, manifest.to_json())
    layout.fsync_dir(pending)
    final = self.step_path(manifest.step)
    replacing = layout._identity(final)
    self.fence(f"committing step {manifest.step}")
    if replacing is not None:
        assert layout._rename_exchange(pending, final), "only for runs with renameat2"
        if layout._identity(pending) != replacing:
            layout._rename_exchange(pending, final)
            self._lost(f"replacing {final.name}", f"{final} was replaced meanwhile")
        layout.fsync_dir(self.root)  # the bug: a failure here leaves the new copy listed
        layout.remove_tree(pending)
    else:
        changed = ""
        try:
            os.rename(pending, final)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.ENOENT):
                raise
            changed = f"{final} or {pending} changed meanwhile ({e.strerror})"
        if changed:
            self._lost(f"committing step {manifest.step}", changed)
        layout.fsync_dir(self.root)  # the bug: a failure here leaves the new step listed
    with contextlib.suppress(OSError):
        layout.fsync_dir(self.pending_root)
    return final


def _describe_top_only(e: BaseException) -> str:
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException):
        return "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, (x, _tb) in sorted(e.failures.items()))
    return f"{type(e).__name__}: {e}"


def _park_replace(
    self: Any, pending: Path, final: Path, expected: tuple[int, int], *, undo: bool, rmtree: bool
) -> None:
    """Layout._replace without renameat2 (the fault layer's no_exchange), before two fixes: ``undo=False``
    does not put the old copy back when renaming the new one in fails; ``rmtree=True`` deletes the parked
    copy in place, ignoring errors."""
    import shutil
    import uuid

    from safepoint.store import posix_layout as layout

    assert not layout._rename_exchange(pending, final), "only for runs without renameat2"
    parked = self.pending_root / f"replaced-{final.name}-{uuid.uuid4().hex[:8]}"
    os.rename(final, parked)
    if layout._identity(parked) != expected:
        os.rename(parked, final)
        self._lost(f"replacing {final.name}", f"{final} was replaced meanwhile")
    try:
        os.rename(pending, final)
    except OSError:
        if undo:
            os.rename(parked, final)
        raise
    try:
        layout.fsync_dir(self.root)
    except OSError:
        os.rename(final, pending)
        os.rename(parked, final)
        raise
    if rmtree:
        shutil.rmtree(parked, ignore_errors=True)
        return
    doomed = self.pending_root / f"deleting-{final.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(parked, doomed)
    except OSError:
        layout._remove_manifest_first(parked, expected)
        return
    layout.remove_tree(doomed)


def apply_patches(names: tuple[str, ...] | list[str]) -> None:
    """*Mutations*: change safepoint's behaviour inside this child only (never in the source tree).

    Each removes one guarantee, and the campaigns must catch every one of them (test_torture_crash,
    test_torture_faults). Eight of them put back bugs this suite found and that were then fixed:
    ``metadata_not_flushed``, ``writer_threads_unchecked``, ``commit_no_rollback``, ``ensure_root_no_fsync``,
    ``describe_top_exception_only``, ``park_rename_no_undo``, ``parked_rmtree``, ``thread_cause_unrecorded``.
    """
    import shutil
    import types

    from safepoint.save import saver
    from safepoint.store import checksum, storage
    from safepoint.store import posix_layout as layout

    for name in names:
        if name == "torch_save_items":  # not a mutation: every tensor through torch.save, each write direct
            from safepoint.store import item_writer

            item_writer._TEMPLATE_MAX = -1  # as a tensor over the template limit is written
            item_writer._DIRECT_MIN = 1  # as a big piece is: straight through, so a fault lands mid-record
        elif name == "metadata_not_flushed":  # DCP fsyncs .metadata while its bytes sit in Python's buffer
            checksum.ChecksummingWriter.fileno = lambda self: self._raw.fileno()  # type: ignore[method-assign]
        elif name == "writer_threads_unchecked":  # trust DCP's write_data, whose extra threads swallow errors
            storage.SafepointWriter.write_data = storage.FileSystemWriter.write_data  # type: ignore[method-assign]
        elif name == "thread_cause_unrecorded":  # a failed stream does not record its exception
            checksum.ChecksumRecorder.failed = lambda self, name, error: None  # type: ignore[method-assign]
        elif name == "commit_no_rollback":  # an error after the commit rename leaves the new step listed
            layout.Layout.commit = _commit_no_rollback  # type: ignore[method-assign]
        elif name == "ensure_root_no_fsync":  # ROOT is created, its parent never fsynced

            def ensure_root(self: Any) -> None:
                self.root.mkdir(parents=True, exist_ok=True)
                self.pending_root.mkdir(exist_ok=True)

            layout.Layout.ensure_root = ensure_root  # type: ignore[method-assign]
        elif name == "describe_top_exception_only":  # name torch's RuntimeError, not the OSError behind it
            saver.describe_exception = _describe_top_only
        elif name in ("park_rename_no_undo", "parked_rmtree"):  # the park-and-rename replacement, as it was
            layout.Layout._replace = functools.partialmethod(
                _park_replace, undo=name != "park_rename_no_undo", rmtree=name == "parked_rmtree"
            )  # type: ignore[method-assign,assignment]
        elif name == "no_data_fsync":
            init = storage.SafepointWriter.__init__

            def no_sync(self: Any, *a: Any, _init: Any = init, **k: Any) -> None:
                _init(self, *a, **k)
                self.sync_files = False

            storage.SafepointWriter.__init__ = no_sync  # type: ignore[method-assign]
        elif name == "no_manifest_fsync":

            def write_file(path: Path, data: bytes) -> None:
                with open(path, "wb") as f:
                    f.write(data)

            layout.write_file_durably = write_file
        elif name == "no_pending_dir_fsync":  # the save's own directory is not fsynced before the rename
            layout.fsync_dir = _skipping_fsync_dir(layout.fsync_dir, lambda p: p.parent.name == ".pending")
        elif name == "no_root_fsync":  # ROOT is not fsynced after the rename
            layout.fsync_dir = _skipping_fsync_dir(layout.fsync_dir, lambda p: (p / ".pending").is_dir())
        elif name == "delete_in_place":

            def remove(self: Any, step: int) -> None:
                shutil.rmtree(self.step_path(step))
                layout.fsync_dir(self.root)

            layout.Layout.remove = remove  # type: ignore[method-assign]
        elif name == "replace_by_delete":

            def replace(self: Any, pending: Path, final: Path, expected: tuple[int, int]) -> None:
                if layout._identity(final) != expected:
                    self._lost(f"replacing {final.name}", f"{final} was replaced meanwhile")
                layout.remove_tree(final)  # the bug: the old copy is gone before the new one is in place
                os.rename(pending, final)
                layout.fsync_dir(self.root)

            layout.Layout._replace = replace  # type: ignore[method-assign]
        elif name == "no_failed_cleanup":  # a failed save's pending directory is left behind
            if hasattr(layout.Layout, "discard"):
                layout.Layout.discard = lambda self, pending: None  # type: ignore[method-assign]
            else:
                saver.shutil = types.SimpleNamespace(rmtree=lambda *a, **k: None)  # type: ignore[attr-defined]
        elif name == "swallow_write_errors":  # what DCP's own writer threads do (pytorch#191391)
            real_save = saver.dcp_save

            def dcp_save(*a: Any, _real: Any = real_save, **k: Any) -> Any:
                try:
                    return _real(*a, **k)
                except BaseException:  # DCP's CheckpointException is a BaseException
                    return None

            saver.dcp_save = dcp_save
        else:
            raise ValueError(f"unknown patch {name!r}")


def emit(**fields: Any) -> None:
    """A progress line for the parent (the zygote's stdout is the protocol pipe; JSON lines pass through).

    One write() of the whole line: print() may issue the text and its newline as two writes (unbuffered
    stdout), and a SIGKILL between them would glue this line to the zygote's next one."""
    faults._os["write"](1, (json.dumps(fields) + "\n").encode())


def train(
    layer: faults.Layer | None,
    root: str,
    total: int,
    snapshots: str | None = None,
    async_save: bool = False,
    gate: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Real training (dropout, every RNG in play, tests/_train.Setup) that saves every step; the parent
    SIGKILLs it at random moments. ``snapshots``: dump model+optimizer after every step trained here.

    ``gate`` ({"path": P, "deadline": T}): before the last step, emit "gate" and wait until P exists, so
    the run cannot end before the parent has made all its kills however late it reads these lines
    (tests/torture/kills.py). T (wall clock) opens the gate by itself: no child waits for a dead parent."""
    from tests.helpers.train import Setup

    s = Setup(seed=0)
    state = s.state()
    trained: dict[int, dict[str, torch.Tensor]] = {}
    with safepoint.CheckpointManager(
        root, save_every_steps=1, async_save=async_save, keep=safepoint.Keep(last=2, every_steps=10)
    ) as mgr:
        listed = [c.step for c in mgr.list()]
        step = mgr.restore(state)
        emit(ev="restored", step=step, listed=listed, pid=os.getpid())
        while step < total:
            if gate and step == total - 1:
                emit(ev="gate", step=step)
                wait_at_gate(Path(gate["path"]), gate["deadline"])
            s.step()
            step += 1
            if snapshots:
                trained[step] = s.snapshot()
            emit(ev="begin", step=step)
            mgr.maybe_save(step, state)
            emit(ev="end", step=step)
    if snapshots:
        torch.save(trained, snapshots)
    return {"step": step, "tokens_seen": s.extra["tokens_seen"]}


def soak(
    layer: faults.Layer | None, root: str, cycles: int, async_save: bool, per_cycle_manager: bool, every: int
) -> dict[str, Any]:
    """save/restore cycles with retention; samples fds, threads, tasks and RSS every ``every`` cycles."""
    import threading

    import psutil

    width = 128
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    twin = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    twin(torch.randn(2, width)).sum().backward()
    twin_opt.step()
    state = safepoint.TrainState(model=model, optimizer=opt, extra={"cycle": 0})
    twin_state = safepoint.TrainState(model=twin, optimizer=twin_opt, extra={"cycle": -1})
    proc = psutil.Process()
    samples: list[dict[str, Any]] = []
    pending_seen: list[list[str]] = []

    def sample(cycle: int) -> None:
        # The least seen over 0.2 s: a thread or descriptor that is just going away (a finished writer
        # thread not yet reaped) is not a leak; a leaked one is there every time.
        readings = []
        for _ in range(8):
            readings.append(
                (
                    len(os.listdir("/proc/self/fd")),
                    threading.active_count(),
                    len(os.listdir("/proc/self/task")),
                )
            )
            time.sleep(0.025)
        fds, threads, tasks = (min(r[i] for r in readings) for i in range(3))
        samples.append(
            {"cycle": cycle, "fds": fds, "threads": threads, "tasks": tasks, "rss": proc.memory_info().rss}
        )

    def one(mgr: safepoint.CheckpointManager, cycle: int) -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        state.extra["cycle"] = cycle  # type: ignore[index]
        mgr.save(cycle, state)
        step = mgr.restore(twin_state)  # waits for an async save first
        assert step == cycle and twin_state.extra["cycle"] == cycle  # type: ignore[index]
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
        leftovers = sorted(os.listdir(os.path.join(root, ".pending")))
        if leftovers:
            pending_seen.append(leftovers)

    def kw() -> dict[str, Any]:
        # The thread writer: a writer process per cycle would add seconds per cycle (its torch import);
        # tests/save/test_writer_process.py checks managers leave no process or descriptor behind.
        return {
            "keep": safepoint.Keep(last=2),
            "async_save": async_save,
            "writer": safepoint.WriterOptions(async_writer="thread"),
        }

    if per_cycle_manager:
        for cycle in range(1, cycles + 1):
            with safepoint.CheckpointManager(root, **kw()) as mgr:
                one(mgr, cycle)
            if cycle % every == 0:
                sample(cycle)
    else:
        with safepoint.CheckpointManager(root, **kw()) as mgr:
            for cycle in range(1, cycles + 1):
                one(mgr, cycle)
                if cycle % every == 0:
                    sample(cycle)
    listed = sorted(os.listdir(root))
    return {"samples": samples, "pending_seen": pending_seen, "dir": listed}


def objstore(layer: faults.Layer | None, **args: Any) -> dict[str, Any]:
    """The object-store workload (tests/torture/objstore.py): its fault layer is the S3 proxy."""
    from tests.torture import objstore as o

    return o.workload(layer, **args)


def objreads(layer: faults.Layer | None, **args: Any) -> dict[str, Any]:
    """The object-store read-fault jobs (tests/torture/objreads.py): the proxy fails reads."""
    from tests.torture import objreads as o

    return o.workload(layer, **args)


SCENARIOS = {
    "objreads": objreads,
    "workload": workload,
    "async_next_call": async_next_call,
    "train": train,
    "soak": soak,
    "objstore": objstore,
}


def warm_up(tmp: Path) -> None:
    """Run one save/restore cycle so the children forked later pay no lazy imports or first-use costs."""
    # The object-store children's clients (imported only: their event-loop thread starts in the child), and
    # botocore's data files parsed for every session a child opens (tests/helpers/botocore_data.py).
    import s3fs  # noqa: F401

    from tests.helpers import botocore_data

    botocore_data.preload()

    import safepoint.remote.object_lease
    import safepoint.remote.s3store
    import safepoint.remote.s3writer
    import safepoint.tiers.tiering
    from tests.torture import objstore  # noqa: F401

    make_baseline(tmp / "ckpt")
    with safepoint.CheckpointManager(
        tmp / "ckpt", writer=safepoint.WriterOptions(threads=2), keep=safepoint.Keep(last=1)
    ) as mgr:
        m = Model()
        mgr.restore(m.state)
        m.fill(3)
        mgr.save(3, m.state)
        mgr.save(3, m.state, overwrite=True)  # the replacement path (renameat2 exchange) too


def run_child(cmd: dict[str, Any]) -> int:
    """Entry point of a forked child: install the fault layer (if asked), run, write the result."""
    result: dict[str, Any]
    try:
        layer = faults.install(faults.Layer(**cmd["fault"])) if cmd.get("fault") else None
        result = {"ok": True, **SCENARIOS[cmd["scenario"]](layer, **cmd.get("args", {}))}
        code = 0
    except BaseException as e:
        result = {"ok": False, "exception": type(e).__name__, "message": str(e), "tb": traceback.format_exc()}
        code = 1
    if cmd.get("out"):
        with faults._open(cmd["out"], "w") as f:
            json.dump(result, f)
    sys.stderr.flush()
    return code
