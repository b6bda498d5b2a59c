"""Checks of CheckpointManager's arguments that no part it builds makes before its first process group.

Every argument is validated before the first process group exists (dist.new_group): a bad one must not
leak a gloo group (and its threads) per attempt.
"""

from __future__ import annotations


def check_manager_arguments(writer_threads: int, if_busy: str, collective_timeout_s: float) -> None:
    if not isinstance(writer_threads, int) or writer_threads < 1:
        raise ValueError(f"writer_threads must be a positive int, got {writer_threads!r}")
    if if_busy not in ("wait", "skip"):
        raise ValueError(f"if_busy must be 'wait' or 'skip', got {if_busy!r}")
    if collective_timeout_s <= 0:
        raise ValueError(f"collective_timeout_s must be positive, got {collective_timeout_s!r}")


def check_keep_local_last(keep_local_last: int) -> None:
    if isinstance(keep_local_last, bool) or not isinstance(keep_local_last, int) or keep_local_last < 1:
        raise ValueError(f"keep_local_last must be a positive int, got {keep_local_last!r}")
