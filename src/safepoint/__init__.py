"""safepoint: atomic, verified, resumable checkpoints for PyTorch training."""

from safepoint._version import __version__
from safepoint.dist import PeerTimeoutError, init_process_group
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
from safepoint.policy import (
    AdaptiveInterval,
    EveryNSeconds,
    EveryNSteps,
    KeepBest,
    KeepEvery,
    KeepLast,
    Retention,
)
from safepoint.preemption import Preempted
from safepoint.remote import RemoteLayout
from safepoint.restore import CheckpointWarning
from safepoint.sampler import ResumableSampler
from safepoint.state import TrainState
from safepoint.tiers import DurabilityLag
from safepoint.upload import TransferConfig, UploadError

__all__ = [
    "AdaptiveInterval",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointWarning",
    "CorruptCheckpointError",
    "DurabilityLag",
    "EveryNSeconds",
    "EveryNSteps",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "LeaseError",
    "PeerTimeoutError",
    "Preempted",
    "RemoteLayout",
    "ResumableSampler",
    "Retention",
    "SaveError",
    "StateMismatchError",
    "TrainState",
    "TransferConfig",
    "UnsafeCheckpointError",
    "UploadError",
    "__version__",
    "init_process_group",
]
