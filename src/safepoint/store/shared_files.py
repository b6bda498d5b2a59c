"""Which committed steps share a file (a hard link: one inode) with another: retention keeps a step that
shares none with the newest, and ``safepoint verify`` names every step a damaged file also damages
(store/incremental.py links unchanged files between steps)."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from safepoint.errors import CheckpointError


def file_identities(layout: Any, step: int, names: Iterable[str] | None = None) -> set[tuple[int, int]]:
    """(st_dev, st_ino) of every file ``step``'s manifest lists in a local ``layout`` (``names``: that list,
    known already); files missing or not regular are left out; empty if the manifest is unreadable."""
    if names is None:
        try:
            names = layout.read_manifest(step).files
        except CheckpointError:
            return set()
    # Joined as strings (retention asks this of two steps' files after every save: a Path per file cost
    # more than its stat); the names are a manifest's bare file names, so the paths are the same.
    base, found = os.fspath(layout.step_path(step)) + "/", set()
    for name in names:
        with contextlib.suppress(OSError):
            st = os.stat(base + name, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode):
                found.add((st.st_dev, st.st_ino))
    return found


def steps_sharing(layout: Any, step: int, name: str) -> list[int]:
    """The other committed steps of a local ``layout`` holding ``step``'s file ``name`` itself (a hard link
    to the same inode): damage to it is damage to them (``safepoint verify`` names them)."""
    try:
        st = os.stat(Path(layout.step_path(step)) / name, follow_symlinks=False)
    except (OSError, ValueError):
        return []
    if not stat.S_ISREG(st.st_mode) or st.st_nlink < 2:
        return []
    mine = (st.st_dev, st.st_ino)
    return [s for s in layout.committed_steps() if s != step and mine in file_identities(layout, s)]
