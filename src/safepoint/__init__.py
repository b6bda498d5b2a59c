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
from safepoint.events import CheckpointEvent, JsonlSink, TensorBoardSink, when_committed
from safepoint.manager import CheckpointManager
from safepoint.options import ClusterOptions, PreemptionOptions, WarmStart, WriterOptions
from safepoint.policy.keep import Keep
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
from safepoint.remote.upload import TransferOptions, UploadError
from safepoint.restore.partial import RestoreReport
from safepoint.restore.restorer import CheckpointWarning
from safepoint.state import TrainState
from safepoint.store.posix_layout import CheckpointInfo
from safepoint.tiers.base import DurabilityLag

__all__ = [
    "AdaptiveInterval",
    "CheckpointError",
    "CheckpointEvent",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointWarning",
    "ClusterOptions",
    "CorruptCheckpointError",
    "DurabilityLag",
    "EveryNSeconds",
    "EveryNSteps",
    "JsonlSink",
    "Keep",
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
    "TensorBoardSink",
    "TrainState",
    "TransferOptions",
    "UnsafeCheckpointError",
    "UploadError",
    "WarmStart",
    "WriterOptions",
    "__version__",
    "init_process_group",
    "shield_worker_init",
    "when_committed",
]

RENAMED = {"TransferConfig": "TransferOptions"}
"""Public names that were renamed: the old one fails with the new one named (option objects end in
``Options``)."""


def __getattr__(name: str) -> object:
    if name in RENAMED:
        # ImportError, not AttributeError: `from safepoint import TransferConfig` would turn an AttributeError
        # into its own "cannot import name" message and lose the new name.
        raise ImportError(f"safepoint.{name} was renamed: use safepoint.{RENAMED[name]}", name=name)
    raise AttributeError(f"module 'safepoint' has no attribute {name!r}")
