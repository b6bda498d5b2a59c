"""safepoint's exceptions.

Every error safepoint raises derives from :class:`CheckpointError`, an ordinary ``Exception``. DCP's own
``CheckpointException`` derives from ``BaseException`` (so a bare ``except Exception`` misses it); we wrap
it at the boundary so callers never have to know.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every safepoint error."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint failed verification: a missing, truncated or altered file, or a bad manifest."""

    def __init__(self, step: int | None, file: str | None, reason: str) -> None:
        self.step = step
        self.file = file
        self.reason = reason
        where = f"step {step}" if step is not None else "checkpoint"
        what = f", file {file!r}" if file else ""
        super().__init__(f"{where}{what}: {reason}")


class LeaseError(CheckpointError):
    """Another live process owns the checkpoint root."""


class StateMismatchError(CheckpointError):
    """The checkpoint does not fit the objects it is being restored into (keys or shapes differ)."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """The checkpoint's metadata references code or types that safepoint refuses to load."""


class SaveError(CheckpointError):
    """A save failed; nothing was committed and older checkpoints are intact."""
