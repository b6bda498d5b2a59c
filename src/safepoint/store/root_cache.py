"""One :class:`~safepoint.store.rootfs.RootDir` per absolute root path, reused by the commit protocol's
functions (store/root_ops.py) and the save's links (store/links.py) instead of one made per call.

A ``RootDir`` holds no descriptor and nothing that changes: only its path and that path's absolute form
(each operation opens the root afresh, store/rootfs.py), so two made from the same absolute path behave
alike in every call, and reusing one changes nothing but the ~10 us each construction cost (``Path`` and
``abspath`` of its path: five per steady save of a small state, issue 27). A relative path is resolved
against the working directory when it is made, so it gets a new one each time, as before.
"""

from __future__ import annotations

import os

from safepoint.store.rootfs import RootDir

_MAX = 64  # distinct roots remembered (a process uses a handful); past it the map starts again
_ROOTS: dict[str, RootDir] = {}


def root_dir(path: str | os.PathLike[str]) -> RootDir:
    """A RootDir of ``path`` (the same one for the same absolute path)."""
    key = os.fspath(path)
    if not os.path.isabs(key):
        return RootDir(path)
    fs = _ROOTS.get(key)
    if fs is None:
        if len(_ROOTS) >= _MAX:
            _ROOTS.clear()
        fs = _ROOTS[key] = RootDir(key)
    return fs
