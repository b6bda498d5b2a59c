"""Checks of CheckpointManager's arguments that no part it builds makes before its first process group.

Every argument is validated before the first process group exists (dist.new_group): a bad one must not
leak a gloo group (and its threads) per attempt.
"""

from __future__ import annotations

import math
import os

from safepoint.lease import MIN_STALE_AFTER_S, check_lease_timing, heartbeat_for

ASYNC_WRITERS = ("auto", "thread", "process")


def check_manager_arguments(
    writer_threads: int, if_busy: str, collective_timeout_s: float, async_save: bool, async_writer: str
) -> None:
    if not isinstance(writer_threads, int) or writer_threads < 1:
        raise ValueError(f"writer_threads must be a positive int, got {writer_threads!r}")
    if if_busy not in ("wait", "skip"):
        raise ValueError(f"if_busy must be 'wait' or 'skip', got {if_busy!r}")
    if async_writer not in ASYNC_WRITERS:
        raise ValueError(f"async_writer must be 'auto', 'thread' or 'process', got {async_writer!r}")
    if async_writer == "process" and not async_save:
        raise ValueError("async_writer='process' writes async saves: pass async_save=True as well")
    if async_writer == "process" and not hasattr(os, "memfd_create"):
        raise ValueError("async_writer='process' needs Linux (memfd_create); use async_writer='thread'")
    if collective_timeout_s <= 0:
        raise ValueError(f"collective_timeout_s must be positive, got {collective_timeout_s!r}")


def check_lease_stale_after(stale_after_s: float) -> None:
    """A finite number of seconds, at least MIN_STALE_AFTER_S; the heartbeat then beats at most every
    quarter of it (lease.heartbeat_for), so the limit always exceeds twice the heartbeat interval."""
    ok = isinstance(stale_after_s, (int, float)) and not isinstance(stale_after_s, bool)
    if not ok or not math.isfinite(stale_after_s) or stale_after_s < MIN_STALE_AFTER_S:
        raise ValueError(
            f"lease_stale_after_s must be a finite number of seconds >= {MIN_STALE_AFTER_S:g}, got "
            f"{stale_after_s!r}"
        )
    check_lease_timing(stale_after_s, heartbeat_for(stale_after_s))


def check_keep_local_last(keep_local_last: int) -> None:
    if isinstance(keep_local_last, bool) or not isinstance(keep_local_last, int) or keep_local_last < 1:
        raise ValueError(f"keep_local_last must be a positive int, got {keep_local_last!r}")


def writer_process_mode(async_save: bool, async_writer: str, local_files: bool) -> bool | None:
    """None: async saves (if any) need no writer process; else whether one that cannot start may be
    replaced by the writer thread ("auto") rather than fail the save ("process").

    "auto" is the process wherever it can run: measured in docs/benchmarks.md ("The process writer"), it
    halves what a save costs a Python-bound loop over a many-tensor state and ties elsewhere.
    """
    if async_writer == "process" and not local_files:
        raise ValueError(
            "async_writer='process' writes local files: with a URL root, pass local_root= (saves commit "
            "there and upload in the background) or use async_writer='thread'"
        )
    if not async_save:
        return None
    if async_writer == "process":
        return False
    if async_writer == "auto" and local_files and hasattr(os, "memfd_create"):
        return True
    return None
