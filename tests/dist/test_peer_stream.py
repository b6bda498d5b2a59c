"""Peer replicas move files in chunks (tiers/peer_stream.py): three real ranks on gloo, every pattern the
replicas use (a ring, one rank sending to two, two sending to one), sizes around the chunk size, and files
a receiver must refuse (wrong crc32c, short or absent on the sender). Memory stays one chunk per pair: a
48 MiB file crosses with 1 MiB chunks while neither end's peak memory grows by as much as half of it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

from tests.helpers.example_runs import spawn_job

WORKER = Path(__file__).parents[1] / "helpers" / "procs" / "peer_stream_worker.py"


def test_files_cross_in_chunks_checked_in_bounded_memory_and_never_through_a_link(tmp_path: Path) -> None:
    # One run (three interpreters with torch are the cost): rank 1's receiving directory is also hostile.
    # It holds a directory named like a file it receives ("exact") and a symlinked "below.part": the file
    # that cannot be put in place is left out (every rank still finishes: no peer waits for a rank that
    # raised mid-stream), and nothing is written through the symlink.
    # The ranks are forked from the suite's fork server (torch, DCP and safepoint imported once: ~4.5 s of
    # CPU each otherwise); their gloo group, their files and their memory are their own.
    procs = [spawn_job([str(WORKER), str(rank), str(tmp_path)], 1, 2) for rank in range(3)]
    try:
        assert [p.wait(timeout=300) for p in procs] == [0, 0, 0]
    finally:
        for p in procs:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    results = [json.loads((tmp_path / f"result{rank}.json").read_text()) for rank in range(3)]
    assert results[0]["received"] == ["big"]  # "wrong", "short" and "absent" are refused
    assert results[0]["files"] == ["big"]  # ... and leave no .part behind
    assert results[1]["received"] == ["above", "below", "empty", "one", "second-partner", "several"]
    assert results[2]["received"] == ["also", "ring"]
    for r in results:
        assert all(r["same"].values()), r
    for rank in (0, 1):  # the big file's receiver and sender
        assert results[rank]["peak_growth_kib"] < 24 * 1024, results[rank]
    assert (tmp_path / "outside").read_bytes() == b"precious"
    assert not (tmp_path / "in1" / "below").is_symlink()
    assert not list((tmp_path / "in1").glob("*.part"))
