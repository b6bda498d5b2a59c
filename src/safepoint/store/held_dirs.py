"""A save's own directory held open while the save writes into it (a primitive of store/rootfs.py).

Every guarded operation walks from the root, component by component (rootfs.py): a file created in
``ROOT/.pending/<save>/`` costs three ``open``s and three ``close``s before its own (~100 us at the load of
the shared machines, most of a small file's create; a small state's save makes a dozen such walks, issue 27).
While a save writes, the descriptor of its directory, walked once (``O_NOFOLLOW|O_DIRECTORY`` on every
component, as any walk), is held here, and a walk that goes through that directory starts from a
duplicate of it instead of from the root.

Why that is as safe as the walk from the root: the directory is the save's own, created by this save under
a unique name; the held descriptor is the directory that walk reached, so nothing at its path can redirect
it later (a symlink put in its place is never reached: the descriptor is not a path), and every name
inside it is still opened with ``O_NOFOLLOW`` by the operation as before. The one difference is the moment
the path is resolved: once, when the directory is made, rather than at each operation. Renaming the save's
own directory elsewhere meanwhile needs write access to ``.pending``, which can delete or replace it anyway;
new files created in it are still the save's own, made with ``O_EXCL``, never anything that was there.

Held from the directory's creation to the end of the writer's ``finish`` (store/storage.py), released by
path; a failed save's cleanup and the commit release it too (the commit renames the directory: a walk of
the old path must not reach it afterwards). At most :data:`MAX_HELD` at once (a sync save beside a
background one holds two): a save that died without releasing is the first let go.
"""

from __future__ import annotations

import os
import threading

MAX_HELD = 8
_lock = threading.Lock()
_held: dict[str, int] = {}  # absolute path of a held directory -> its descriptor (insertion order: age)


def hold(path: str, fd: int) -> None:
    """Hold ``fd``, the walked descriptor of the directory ``path`` (absolute, normalised); owned here."""
    with _lock:
        old = _held.pop(path, None)
        if old is not None:
            os.close(old)
        while len(_held) >= MAX_HELD:
            os.close(_held.pop(next(iter(_held))))
        _held[path] = fd


def release(path: str) -> None:
    """Close the held directory ``path``, if held; later walks go from the root again."""
    with _lock:
        fd = _held.pop(path, None)
        if fd is not None:
            os.close(fd)


def start(prefix: str, parts: tuple[str, ...]) -> tuple[int, int] | None:
    """(a new descriptor of the deepest held directory among ``prefix`` + the first k ``parts``, k), or None
    when none is held. ``prefix`` is the root's absolute path with a trailing "/"."""
    if not _held:
        return None
    with _lock:
        for k in range(len(parts), 0, -1):
            fd = _held.get(prefix + "/".join(parts[:k]))
            if fd is not None:
                return os.dup(fd), k
    return None
