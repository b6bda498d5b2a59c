"""safepoint: atomic, verified, resumable checkpoints for PyTorch training."""

from safepoint._version import __version__
from safepoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    LeaseError,
    SaveError,
    StateMismatchError,
    UnsafeCheckpointError,
)
from safepoint.layout import CheckpointInfo
from safepoint.manager import CheckpointManager
from safepoint.policy import EveryNSeconds, EveryNSteps, KeepBest, KeepEvery, KeepLast, Retention
from safepoint.restore import CheckpointWarning
from safepoint.state import TrainState

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointWarning",
    "CorruptCheckpointError",
    "EveryNSeconds",
    "EveryNSteps",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "LeaseError",
    "Retention",
    "SaveError",
    "StateMismatchError",
    "TrainState",
    "UnsafeCheckpointError",
    "__version__",
]
