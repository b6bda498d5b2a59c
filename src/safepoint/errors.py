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

    def __reduce__(self) -> tuple[type, tuple[int | None, str | None, str]]:
        # It crosses ranks inside DCP's CheckpointException (pickled): rebuilt from its own fields.
        return type(self), (self.step, self.file, self.reason)


class LeaseError(CheckpointError):
    """Another live process owns the checkpoint root."""


class StateMismatchError(CheckpointError):
    """The checkpoint does not fit the objects it is being restored into (keys or shapes differ)."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """The checkpoint's metadata references code or types that safepoint refuses to load."""


class SaveError(CheckpointError):
    """A save failed; nothing was committed and older checkpoints are intact."""


class Preempted(SystemExit):
    """Raised by ``maybe_save`` after a preemption notice, once the emergency save is committed (or skipped).

    A ``SystemExit``: it passes through ``except Exception`` and, uncaught, ends the process with ``code``
    (default 143) so that torchrun, Slurm or Kubernetes restart the job, which then resumes from
    ``saved_step`` (or from the previous checkpoint if the save had to be skipped).
    """

    def __init__(self, code: int, *, step: int, saved_step: int | None, resume_step: int | None, reason: str):
        super().__init__(code)  # one int argument: SystemExit's exit status
        self.step = step
        """The step at which the ranks agreed to stop."""
        self.saved_step = saved_step
        """The step saved by the emergency save (or already committed); None if the save was skipped."""
        self.resume_step = resume_step
        """The newest committed step: where a restart resumes."""
        self.reason = reason

    def __str__(self) -> str:
        saved = f"saved step {self.saved_step}" if self.saved_step is not None else "nothing saved"
        return (
            f"preempted at step {self.step} ({self.reason}); {saved}; a restart resumes at step "
            f"{self.resume_step if self.resume_step is not None else 0}; exit code {self.code}"
        )


def os_error_in_chain(e: BaseException) -> BaseException:
    """torch's zip writer turns a failed write (ENOSPC, EIO) into "unexpected pos" RuntimeError and keeps the
    OSError only as __context__: name the OSError, so a full disk is called a full disk."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, OSError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return e


def describe_exception(e: BaseException) -> str:
    """DCP wraps per-rank failures in CheckpointException; surface the root cause (e.g. ENOSPC)."""
    # Imported here: errors.py is imported by everything, torch.distributed.checkpoint is heavy.
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException):
        parts = []
        for rank, (exc, _tb) in sorted(e.failures.items()):
            cause = os_error_in_chain(exc)
            parts.append(f"rank {rank}: {type(cause).__name__}: {cause}")
        return "; ".join(parts) or str(e)
    cause = os_error_in_chain(e)
    return f"{type(cause).__name__}: {cause}"
