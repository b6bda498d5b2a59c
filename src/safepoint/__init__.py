"""safepoint: atomic, verified, resumable checkpoints for PyTorch training."""

from safepoint._version import __version__
from safepoint.data.plain import PlainState
from safepoint.data.sampler import ResumableSampler
from safepoint.dist import PeerTimeoutError, init_process_group
from safepoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    LeaseError,
    SaveError,
    StateMismatchError,
    UnsafeCheckpointError,
)
from safepoint.manager import CheckpointManager
from safepoint.options import ClusterOptions, PreemptionOptions, WarmStart, WriterOptions
from safepoint.policy.rules import (
    AdaptiveInterval,
    EveryNSeconds,
    EveryNSteps,
    KeepBest,
    KeepEvery,
    KeepLast,
    Retention,
)
from safepoint.preempt.preemption import Preempted
from safepoint.preempt.shield import ShieldedWorkerInit, shield_worker_init
from safepoint.remote.object_layout import RemoteLayout
from safepoint.remote.upload import TransferConfig, UploadError
from safepoint.restore.partial import RestoreReport
from safepoint.restore.restorer import CheckpointWarning
from safepoint.state import TrainState
from safepoint.store.posix_layout import CheckpointInfo
from safepoint.tiers.base import DurabilityLag

__all__ = [
    "AdaptiveInterval",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointWarning",
    "ClusterOptions",
    "CorruptCheckpointError",
    "DurabilityLag",
    "EveryNSeconds",
    "EveryNSteps",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "LeaseError",
    "PeerTimeoutError",
    "PlainState",
    "Preempted",
    "PreemptionOptions",
    "RemoteLayout",
    "RestoreReport",
    "ResumableSampler",
    "Retention",
    "SaveError",
    "ShieldedWorkerInit",
    "StateMismatchError",
    "TrainState",
    "TransferConfig",
    "UnsafeCheckpointError",
    "UploadError",
    "WarmStart",
    "WriterOptions",
    "__version__",
    "init_process_group",
    "shield_worker_init",
]
