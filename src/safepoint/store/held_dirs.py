"""Directories held open for one save, so that its file operations start there, not from the root again.

Every guarded operation (store/rootfs.py) walks from the root: it opens the root by its path, then each
component with ``O_NOFOLLOW|O_DIRECTORY``, and closes them all again, ~25-30 us a walk. A small state's
save creates, links and checks a dozen files in its pending directory, one walk each (issue 27). While
``holding(paths)`` is active in a thread, the first walk of that thread that reaches one of ``paths`` keeps
a descriptor of it, and every later walk whose way passes through a held directory starts from a copy of
that descriptor (``os.dup``), walking only what lies below it.

Safe, because a held descriptor is one the guarded walk itself opened (no symlink followed on the way: a
walk whose own base lies below a held path, opened by that path, holds nothing, ``below_held``) and
a directory stays that directory while open: later operations reach the very directory the first walk
checked, even if a name on its way were swapped for a symlink meanwhile (they would have refused it then;
they now keep to the real one). Only what the save itself names is held (its root, ``.pending``, its own
pending directory), only for the save's file writes, in the saving thread only (a thread of DCP's
writer or the retention thread walks as before), and the commit that renames the pending directory runs
after the hold ended. Nothing outlives the ``with`` block: every descriptor is closed on the way out.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_tls = threading.local()

_UNOPENED = -1  # asked for, not reached by a walk yet


def current() -> dict[str, int] | None:
    """This thread's held directories (absolute path -> descriptor, or ``_UNOPENED``), or None."""
    return getattr(_tls, "dirs", None)


@contextmanager
def holding(*paths: str | os.PathLike[str]) -> Iterator[None]:
    """Hold ``paths`` (directories under a root) open for this thread's walks inside the block."""
    outer = current()
    dirs = dict(outer) if outer else {}  # nested: the outer block's descriptors stay the outer's to close
    for path in paths:
        dirs.setdefault(os.path.abspath(path), _UNOPENED)
    _tls.dirs = dirs
    try:
        yield
    finally:
        _tls.dirs = outer
        for path, fd in dirs.items():  # every descriptor this block opened, an outer one's path included
            if fd >= 0 and (outer is None or outer.get(path) != fd):
                os.close(fd)


def start(dirs: dict[str, int], base: str, parts: tuple[str, ...]) -> tuple[int, int]:
    """(a new descriptor of the deepest held directory on the way to ``base``/``parts``, the number of
    ``parts`` it stands for), or (-1, 0) where none is held: the walk then opens ``base`` itself."""
    prefix = base if base.endswith("/") else base + "/"
    for n in range(len(parts), 0, -1):
        fd = dirs.get(prefix + "/".join(parts[:n]), _UNOPENED)
        if fd >= 0:
            return os.dup(fd), n
    fd = dirs.get(base, _UNOPENED)
    return (os.dup(fd), 0) if fd >= 0 else (-1, 0)


def below_held(dirs: dict[str, int], base: str) -> bool:
    """Whether ``base`` lies strictly below a held path: a walk that opened ``base`` by its own path then
    holds nothing it reaches. That open follows symlinks (a root's own path is its user's: store/rootfs.py),
    so ``ROOT/.pending`` planted as a link out of ROOT and opened as a RootDir's base (``around``) would
    otherwise become the descriptor every later walk of ROOT's starts from, past the symlink they refuse."""
    for path in dirs:
        prefix = path if path.endswith("/") else path + "/"
        if base != path and base.startswith(prefix):
            return True
    return False


def reached(dirs: dict[str, int], path: str, fd: int) -> None:
    """A walk of this thread opened ``path`` as ``fd``: kept (a copy) if it is asked for and not held yet."""
    if dirs.get(path) == _UNOPENED:
        # Out of descriptors: not held, and the walk that got here does not fail for it.
        with contextlib.suppress(OSError):
            dirs[path] = os.dup(fd)
