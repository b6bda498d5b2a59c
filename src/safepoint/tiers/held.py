"""held: the roots this process holds through an open ``CheckpointManager``.

The root's lease keeps other processes out, but inside one process it cannot tell a second manager from the
first: both run under the same pid, and the lease's refusal named the process's own pid as "the other job".
A second manager on a root this process already holds (a notebook cell run twice, an evaluation opened
beside the trainer, a manager never closed) is refused here first, saying exactly that, before any process
group or lease is touched. Every rank of a job registers its own managers, so ranks decide alike.
"""

from __future__ import annotations

import os
import threading

from safepoint.errors import LeaseError
from safepoint.remote.object_layout import RemoteLayout
from safepoint.store.posix_layout import Layout

_lock = threading.Lock()
_held: dict[str, str] = {}  # root key -> the root as its manager was given it


def root_key(layout: Layout | RemoteLayout) -> str:
    """One spelling per root: a directory by its real path (symlinks, ``..`` and ``file://`` resolved), an
    object store by its URL without a trailing slash."""
    if isinstance(layout, Layout):
        return "file://" + os.path.realpath(layout.root)
    root = str(layout.root).rstrip("/")
    return "file://" + os.path.realpath(root[len("file://") :]) if root.startswith("file://") else root


class HeldRoots:
    """The roots one manager holds in this process (its root, and its durable root with ``local_root``)."""

    def __init__(self, *layouts: Layout | RemoteLayout | None) -> None:
        """Claims every root, or none: LeaseError naming the root if this process holds one already."""
        keys = {root_key(layout): str(layout.root) for layout in layouts if layout is not None}
        with _lock:
            for key, shown in keys.items():
                if key in _held:
                    raise LeaseError(
                        f"checkpoint root {shown} is already held by another open CheckpointManager in this "
                        f"process (pid {os.getpid()}): use that manager, or close() it first (a `with` block "
                        "closes it); two managers on one root would overwrite each other's checkpoints"
                    )
            _held.update(keys)
        self._keys = list(keys)

    def release(self) -> None:
        """Give the roots back (close(), or a start that failed); a second call does nothing."""
        with _lock:
            for key in self._keys:
                _held.pop(key, None)
        self._keys = []
