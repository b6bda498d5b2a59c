"""safepoint's exceptions.

Every error safepoint raises derives from :class:`CheckpointError`, an ordinary ``Exception``. DCP's own
``CheckpointException`` derives from ``BaseException`` (so a bare ``except Exception`` misses it); we wrap
it at the boundary so callers never have to know.
"""

from __future__ import annotations

import os
import sys
import types
import warnings


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


class StoreReadError(CorruptCheckpointError):
    """A checkpoint could not be read: the store failed the request past every retry (not proven damaged).
    Restore falls back as for damage; ``safepoint verify`` and ``ls`` report an error of the store, never a
    damaged checkpoint (a script acting on "damaged" must not remove an intact one because the store was
    busy)."""


class LeaseError(CheckpointError):
    """Another live process owns the checkpoint root."""


class LeaseUnconfirmed(LeaseError):
    """The lease could not be read (the store failed the read), so this owner cannot confirm it still owns
    the root: this commit or delete is refused, but nothing says the lease is lost (a later one may go on)."""


class StateMismatchError(CheckpointError):
    """The checkpoint does not fit the objects it is being restored into (keys or shapes differ)."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """The checkpoint's metadata references code or types that safepoint refuses to load."""


class SaveError(CheckpointError):
    """A save failed; nothing was committed and older checkpoints are intact."""

    @classmethod
    def not_committed(cls, step: int, why: str) -> SaveError:
        """The one line a failed save of ``step`` raises, sync or async alike (``why``: per rank)."""
        return cls(f"save of step {step} failed and was not committed ({why}). Older checkpoints are intact.")


class Preempted(SystemExit):
    """Raised by ``maybe_save`` after a preemption notice, once the emergency save is committed (or skipped).

    A ``SystemExit``: it passes through ``except Exception`` and, uncaught, ends the process with ``code``
    (default 143) so that torchrun, Slurm or Kubernetes restart the job, which then resumes from
    ``saved_step`` (or from the previous checkpoint if the save had to be skipped).
    """

    code: int
    """The exit status (``PreemptionOptions.exit_code``, 143 by default)."""

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


def _first_in_chain(e: BaseException, kinds: tuple[type[BaseException], ...]) -> BaseException:
    """The first exception of ``kinds`` along ``e``'s chain (``__cause__`` else ``__context__``), or ``e``."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, kinds):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return e


def os_error_in_chain(e: BaseException) -> BaseException:
    """torch's zip writer turns a failed write (ENOSPC, EIO) into "unexpected pos" RuntimeError and keeps the
    OSError only as __context__: name the OSError, so a full disk is called a full disk."""
    return _first_in_chain(e, (OSError,))


def _named_cause(e: BaseException) -> BaseException:
    """The exception a message names: the first OSError along the chain (os_error_in_chain), unless one of
    safepoint's own errors comes first: that one already says what failed and names its cause (an
    UploadError "replacing committed step 3 failed midway (...)" over a store's OSError)."""
    return _first_in_chain(e, (OSError, CheckpointError))


def _one_line(e: BaseException) -> str:
    # A store's message may span lines (gcsfs: "Forbidden: <path>\n<message>"); an error is one line.
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def describe_exception(e: BaseException) -> str:
    """DCP wraps per-rank failures in CheckpointException; surface the root cause (e.g. ENOSPC), on one
    line."""
    # Imported here: errors.py is imported by everything, torch.distributed.checkpoint is heavy.
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException):
        parts = [
            f"rank {rank}: {_one_line(_named_cause(exc))}" for rank, (exc, _tb) in sorted(e.failures.items())
        ]
        return "; ".join(parts) or " ".join(str(e).split())
    return _one_line(_named_cause(e))


_WEIGHTS_ONLY_BOILERPLATE = (
    "Weights only load failed",
    "Please file an issue",
    "Check the documentation",
    "In PyTorch 2.6",
)


def weights_only_reason(e: BaseException) -> str:
    """torch's weights-only refusal in one line: its message is six lines of advice ("re-run with
    weights_only=False", which we never do) around the one that says what was refused."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    kept = [
        ln.removeprefix("WeightsUnpickler error: ")
        for ln in lines
        if not ln.startswith(_WEIGHTS_ONLY_BOILERPLATE)
    ]
    text = " ".join(kept) or type(e).__name__
    return text if len(text) <= 300 else f"{text[:297]}..."


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_caller(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the first frame outside safepoint: the user's ``mgr.restore(state)``.

    Python prints the attributed line under the warning. A fixed ``stacklevel`` landed on whatever internal
    line the call path happened to leave there (``tiers/resume.py: manifest = load()``), which reads as a
    failure inside the library; on a background thread the walk ends at the thread's own entry."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
