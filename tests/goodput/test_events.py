"""The event stream: every kind emitted for a sync save, an async save, a restore with a fallback and a
preemption; from which thread; the logging record; the ready sinks; a failing callback never fails a save."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import safepoint
from safepoint import events as ev
from safepoint.policy.goodput import build_report


class Recorder:
    """A user callback: the events, the thread each came on, and whether its checkpoint was committed."""

    def __init__(self) -> None:
        self.events: list[ev.CheckpointEvent] = []
        self.threads: dict[str, set[str]] = {}

    def __call__(self, event: ev.CheckpointEvent) -> None:
        self.events.append(event)
        self.threads.setdefault(event.event_type, set()).add(threading.current_thread().name)

    def kinds(self, step: int | None = None) -> list[str]:
        return [e.event_type for e in self.events if step is None or e.step == step]

    def one(self, kind: str, step: int | None = None) -> ev.CheckpointEvent:
        found = [e for e in self.events if e.event_type == kind and (step is None or e.step == step)]
        assert len(found) == 1, (kind, step, self.kinds())
        return found[0]


def _state() -> safepoint.TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    return safepoint.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_sync_save_emits_each_phase_in_order_on_the_training_thread(root: Path) -> None:
    rec = Recorder()
    with safepoint.CheckpointManager(root, keep=safepoint.Keep(last=1), on_event=rec) as mgr:
        mgr.save(1, _state())
        mgr.save(2, _state())
    assert rec.kinds(2) == [ev.SAVE_BEGIN, ev.SAVE_WRITTEN, ev.SAVE_COMMITTED, ev.SAVE_DURABLE, ev.SAVE]
    assert ev.SAVE_DELETED in rec.kinds(1)  # keep_last=1: step 1 went once step 2 was committed
    committed, save = rec.one(ev.SAVE_COMMITTED, 2), rec.one(ev.SAVE, 2)
    files = json.loads((root / "step-2/safepoint.json").read_text())["files"]
    assert committed.bytes_written == sum(f["size"] for f in files.values())
    assert committed.directory == str(root / "step-2") and committed.bytes_skipped == 0
    assert committed.throughput_bytes_per_sec == pytest.approx(
        committed.bytes_written / committed.duration_secs, rel=1e-3
    )  # type: ignore[operator]
    assert save.is_async is False and save.rank == 0
    assert (
        save.checkpointer_blocking_duration_secs is not None and save.checkpointer_blocking_duration_secs > 0
    )
    assert save.checkpoint_manager_blocking_duration_secs >= save.checkpointer_blocking_duration_secs  # type: ignore[operator]
    assert rec.one(ev.SAVE_DURABLE, 2).tier == "root"
    assert rec.one(ev.SAVE_DELETED, 1).tier == "root"
    assert rec.threads[ev.SAVE_COMMITTED] == {threading.main_thread().name}


@pytest.mark.parametrize("async_writer", ["thread", "process"])
def test_an_async_save_commits_on_the_writer_thread_and_the_hook_sees_a_committed_checkpoint(
    root: Path, async_writer: str
) -> None:
    rec = Recorder()
    seen: list[tuple[int, bool]] = []
    hook = safepoint.when_committed(
        lambda step, path: seen.append((step, Path(path, "safepoint.json").is_file()))
    )
    # With the writer process the child writes the files; the parent's writer thread reports, as with a thread.
    # if_busy="wait": step 2 waits for step 1's write (the default would write it synchronously at once).
    writer = safepoint.WriterOptions(async_writer=async_writer, if_busy="wait")
    with safepoint.CheckpointManager(root, async_save=True, writer=writer, on_event=[rec, hook]) as mgr:
        mgr.save(1, _state())
        mgr.save(2, _state())  # waits for step 1's write first
        mgr.wait()
    assert rec.kinds(2) == [ev.SAVE_BEGIN, ev.SAVE, ev.SAVE_WRITTEN, ev.SAVE_COMMITTED, ev.SAVE_DURABLE]
    assert rec.one(ev.SAVE, 1).is_async is True and rec.one(ev.SAVE, 1).bytes_written
    assert rec.one(ev.SAVE, 2).wait_for_prev_duration_secs is not None
    assert rec.threads[ev.SAVE_COMMITTED] == {"safepoint-save-1", "safepoint-save-2"}
    assert rec.threads[ev.SAVE] == {threading.main_thread().name}
    assert seen == [(1, True), (2, True)]  # only once committed: the manifest is there when it is called


def test_a_restore_reports_each_fallback_and_the_step_it_loaded(root: Path) -> None:
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, _state())
        mgr.save(2, _state())
    data = next(p for p in (root / "step-2").iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    rec = Recorder()
    with pytest.warns(safepoint.CheckpointWarning), safepoint.CheckpointManager(root, on_event=rec) as mgr:
        assert mgr.restore(_state()) == 1
    assert rec.kinds() == [ev.RESTORE_BEGIN, ev.RESTORE_FALLBACK, ev.RESTORE]
    fallback = rec.one(ev.RESTORE_FALLBACK)
    assert fallback.step == 2 and data.name in (fallback.reason or "")
    done = rec.one(ev.RESTORE)
    assert done.step == 1 and done.directory == str(root / "step-1") and done.duration_secs is not None


def test_a_preemption_emits_the_notice_and_the_emergency_save(root: Path) -> None:
    rec = Recorder()
    state = _state()
    with (
        pytest.raises(safepoint.Preempted),
        safepoint.CheckpointManager(
            root, preemption=safepoint.PreemptionOptions(signals=(signal.SIGTERM,)), on_event=rec
        ) as mgr,
    ):
        for step in range(1, 10):
            if step == 4:
                os.kill(os.getpid(), signal.SIGTERM)
            mgr.maybe_save(step, state)
    notice, emergency = rec.one(ev.PREEMPTION), rec.one(ev.EMERGENCY_SAVE)
    assert notice.step == 4 and notice.reason == "SIGTERM"
    assert emergency.step == 4 and emergency.emergency and emergency.duration_secs is not None
    assert rec.one(ev.SAVE, 4).emergency is True
    kinds = rec.kinds()
    assert kinds.index(ev.PREEMPTION) < kinds.index(ev.SAVE_COMMITTED) < kinds.index(ev.EMERGENCY_SAVE)


class Broken:
    """A Stateful whose state_dict raises (once ``fail``): the save fails in capture, before any write."""

    fail = False

    def state_dict(self) -> dict[str, Any]:
        if self.fail:
            raise RuntimeError("broken state")
        return {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def test_a_failing_callback_never_fails_a_save_and_a_failed_save_is_an_event(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rec = Recorder()
    broken = safepoint.TrainState(model=torch.nn.Linear(2, 2), extra={"b": Broken()})
    Broken.fail = True

    def bad(event: ev.CheckpointEvent) -> None:
        raise ZeroDivisionError("the user's bug")

    with caplog.at_level(logging.INFO, logger="safepoint.events"):
        with safepoint.CheckpointManager(root, on_event=[bad, rec]) as mgr:
            assert mgr.save(1, _state()) is not None  # the callback raised on every event
            with pytest.raises(RuntimeError, match="broken state"):
                mgr.save(2, broken)
    assert (root / "step-1" / "safepoint.json").is_file() and not (root / "step-2").exists()
    failed = rec.one(ev.SAVE_FAILED, 2)
    assert "broken state" in (failed.reason or "")
    # One warning with the traceback for the broken callback, then quiet; every event still reached `rec`.
    warned = [
        r for r in caplog.records if "event callback" in r.getMessage() and r.levelno == logging.WARNING
    ]
    assert len(warned) == 1 and warned[0].exc_info is not None
    assert rec.kinds(1) == [ev.SAVE_BEGIN, ev.SAVE_WRITTEN, ev.SAVE_COMMITTED, ev.SAVE_DURABLE, ev.SAVE]
    # The logging record: logger safepoint.events, the fields in `extra`.
    records = [r for r in caplog.records if r.name == "safepoint.events" and getattr(r, "event_type", None)]
    save = next(r for r in records if r.event_type == ev.SAVE)  # type: ignore[attr-defined]
    assert save.step == 1 and save.checkpointer_blocking_duration_secs > 0  # type: ignore[attr-defined]
    assert next(r for r in records if r.event_type == ev.SAVE_FAILED).levelno == logging.ERROR  # type: ignore[attr-defined]


def test_jsonl_and_tensorboard_sinks(root: Path, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log, tb = tmp_path / "events.jsonl", tmp_path / "tb"
    with safepoint.CheckpointManager(
        root, on_event=[safepoint.JsonlSink(log), safepoint.TensorBoardSink(str(tb))]
    ) as mgr:
        mgr.restore(_state())
        mgr.save(3, _state())
        mgr.save(6, _state())
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["event_type"] for r in lines if r.get("step") == 6] == [
        ev.SAVE_BEGIN, ev.SAVE_WRITTEN, ev.SAVE_COMMITTED, ev.SAVE_DURABLE, ev.SAVE,
    ]  # fmt: skip
    save = next(r for r in lines if r["event_type"] == ev.SAVE)
    # The names ml-goodput-measurement reads from Orbax's logs.
    for key in ("step", "event_type", "checkpointer_blocking_duration_secs",
                "checkpoint_manager_blocking_duration_secs", "wait_for_prev_duration_secs"):  # fmt: skip
        assert key in save
    acc = EventAccumulator(str(tb))
    acc.Reload()
    blocking = acc.Scalars("safepoint/save/checkpointer_blocking_duration_secs")
    assert [s.step for s in blocking] == [3, 6] and all(s.value > 0 for s in blocking)
    assert [s.step for s in acc.Scalars("safepoint/save_committed/bytes_written")] == [3, 6]


def test_on_event_must_be_callables(root: Path) -> None:
    with pytest.raises(ValueError, match="on_event must be a callable"):
        safepoint.CheckpointManager(root, on_event=["events.jsonl"])  # type: ignore[list-item]
    assert not root.exists()  # refused before anything was created


def test_tiering_reports_each_tier_and_the_report_its_durability_lag(
    tmp_path: Path, moto_endpoint: str, bucket: str
) -> None:
    from tests.helpers.s3 import storage_options

    rec = Recorder()
    local = tmp_path / "local"
    with safepoint.CheckpointManager(
        f"s3://{bucket}/run",
        local_root=local,
        storage_options=storage_options(moto_endpoint),
        keep=safepoint.Keep(last=1, local_last=1),
        on_event=rec,
    ) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state())
            mgr.wait()  # each upload done before the next save: none is superseded (tiering.py)
    durable = [e for e in rec.events if e.event_type == ev.SAVE_DURABLE]
    assert [(e.step, e.tier) for e in durable] == [(1, "durable"), (2, "durable"), (3, "durable")]
    assert all(e.directory and e.directory.startswith(f"s3://{bucket}/run") for e in durable)
    assert all(e.lag_secs is not None and e.lag_secs >= 0 and e.bytes_written for e in durable)
    assert rec.threads[ev.SAVE_DURABLE] != {threading.main_thread().name}  # the uploader's thread
    deleted = {(e.step, e.tier) for e in rec.events if e.event_type == ev.SAVE_DELETED}
    assert deleted == {
        (1, "durable"),
        (2, "durable"),
        (1, "local"),
        (2, "local"),
    }  # keep_last=1, keep_local_last=1
    assert [e.step for e in rec.events if e.event_type == ev.SAVE_COMMITTED] == [1, 2, 3]
    # The journal is on the local root; the report's durability lag comes from the uploads.
    from safepoint.policy.goodput import build_report

    report = build_report(local)
    assert report.saves == 3 and report.last_durable_step == 3
    assert report.durable_lag_max_s == pytest.approx(max(e.lag_secs for e in durable), abs=1e-3)  # type: ignore[type-var]


# "process" under -m slow (time bar): tests/save/test_incremental_process.py checks what the process links
@pytest.mark.parametrize("async_writer", [None, pytest.param("process", marks=pytest.mark.slow)])
def test_bytes_skipped_are_the_bytes_an_incremental_save_linked(root: Path, async_writer: str | None) -> None:
    """A frozen base is linked from the third save on: the events say how many bytes that spared (sync, and
    async with the writer process), written + skipped is the checkpoint's size, and the run report sums it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    frozen = torch.nn.Embedding(4096, 16)
    frozen.weight.requires_grad_(False)
    state = safepoint.TrainState(model=torch.nn.ModuleDict({"head": model, "emb": frozen}), rng=False)
    rec = Recorder()
    writer = safepoint.WriterOptions(async_writer=async_writer or "auto")
    with safepoint.CheckpointManager(
        root, async_save=async_writer is not None, writer=writer, on_event=rec
    ) as mgr:
        if mgr._process is not None:
            mgr._process.wait_ready()
        for step in (1, 2, 3):
            with torch.no_grad():
                model.weight.add_(1.0)
            mgr.save(step, state)
            mgr.wait()
    for step in (1, 2, 3):
        manifest = json.loads((root / f"step-{step}/safepoint.json").read_text())
        linked = manifest["extra"]["incremental"]["linked"]
        committed = rec.one(ev.SAVE_COMMITTED, step)
        assert committed.bytes_skipped == linked == rec.one(ev.SAVE_WRITTEN, step).bytes_skipped
        total = sum(f["size"] for f in manifest["files"].values())
        assert committed.bytes_written + linked == total  # type: ignore[operator]
    assert rec.one(ev.SAVE_COMMITTED, 2).bytes_skipped == 0
    skipped = rec.one(ev.SAVE_COMMITTED, 3).bytes_skipped
    assert skipped is not None and skipped >= 4096 * 16 * 4
    report = build_report(str(root))
    assert report.bytes_skipped == skipped
    assert report.bytes_saved == sum(rec.one(ev.SAVE_COMMITTED, s).bytes_written or 0 for s in (1, 2, 3))


def test_an_event_no_sink_reads_and_the_log_does_not_record_is_not_built(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A sink with ``event_types`` (the run journal) reads only those: an event of another type is not
    built unless the log records it or another sink may read it."""
    got: list[str] = []

    class Picky:
        event_types = frozenset({ev.SAVE_COMMITTED})

        def __call__(self, event: ev.CheckpointEvent) -> None:
            got.append(event.event_type)

    caplog.set_level(logging.WARNING, logger="safepoint")
    events = ev.Events([Picky()])
    assert events.emit(ev.SAVE_BEGIN, 1) is None
    assert events.emit(ev.SAVE_COMMITTED, 1) is not None
    caplog.set_level(logging.INFO, logger="safepoint")
    assert events.emit(ev.SAVE_BEGIN, 2) is not None  # the log records it
    assert any(r.getMessage().startswith(f"safepoint event {ev.SAVE_BEGIN} step=2") for r in caplog.records)
    caplog.set_level(logging.WARNING, logger="safepoint")
    plain: list[ev.CheckpointEvent] = []
    events.subscribe(plain.append)
    assert events.emit(ev.SAVE_BEGIN, 3) is not None
    assert got == [ev.SAVE_COMMITTED, ev.SAVE_BEGIN, ev.SAVE_BEGIN]
    assert [e.step for e in plain] == [3]
