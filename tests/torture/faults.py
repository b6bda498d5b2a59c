"""A fault-injecting layer under every storage operation of this process: install it in a CHILD only.

It patches the entry points that safepoint *and* DCP use (DCP calls ``os.fsync``, ``open(..., "wb")``,
``Path.mkdir`` and ``Path.rename`` directly), so nothing reaches the file system around it:

    open      open for writing/creating: builtins.open, io.open (Path.open/write_*, os.fdopen), os.open
    write     write() on a file object opened for writing; os.write on a descriptor
    fsync     os.fsync, os.fdatasync (files and directories), os.sync
    rename    os.rename, os.replace (Path.rename/replace, DCP's FileSystem.rename)
    exchange  safepoint.store.posix_layout._rename_exchange (renameat2 RENAME_EXCHANGE, through ctypes)
    unlink    os.unlink, os.remove (Path.unlink, shutil.rmtree)
    rmdir     os.rmdir (Path.rmdir, shutil.rmtree)
    mkdir     os.mkdir (Path.mkdir, os.makedirs)

Only operations on paths under ``scope`` are counted. Every counted operation gets a number, in the order
the process issues them. Modes:

    count     journal only
    crash     SIGKILL this process just before operation ``at`` (a real signal; nothing is cleaned up)
    fail      operation ``at`` raises OSError(errno); a failed write first writes half its bytes, as a
              disk filling up mid-write does. ``sticky`` kinds keep failing until ``disarm()``.
              ``in_thread``: instead of ``at``, the first write issued by a thread other than the main
              one (DCP's extra writer thread) fails.

``no_exchange`` simulates a file system without renameat2 (the exchange fails with EINVAL).
``dir_fsync_errno`` one whose directories cannot be fsynced: every fsync of a directory in ``scope`` fails
with that errno (CIFS/SMB and some FUSE mounts answer EINVAL), journalled as the operation's error.

The journal (JSON lines, written with the unpatched ``os.write`` to a descriptor outside ``scope``):

    {"ev": "op", "i": n, "op": kind, "path": p, "dst": p2}   before operation n
    {"ev": "done", "i": n} / {"ev": "err", "i": n, "errno": e}   after it
    {"ev": "crash" | "fail", "i": n}                           the injected fault
    {"ev": "new", "ino": i, "gen": g, "path": p}             an inode created (gen: inode numbers get reused)
    {"ev": "dir", "ino": i, "gen": g, "entries": [...]}      a directory's entries when it was fsynced
    {"ev": "file", "ino": i, "gen": g, "blob": b}            a file's contents when it was fsynced (copied)
    {"ev": "mark", ...}                                      the workload's own progress markers

The baseline (everything under ``scope`` at install time) is journalled as durable: that is the model's
starting assumption, no real sync is needed. ``durable.py`` rebuilds, in the parent, what a power loss at
the crash point could leave.
"""

from __future__ import annotations

import builtins
import errno as errno_mod
import io
import json
import os
import signal
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safepoint.store.posix_layout

KINDS = ("open", "write", "fsync", "rename", "exchange", "unlink", "rmdir", "mkdir")
# The run journal's files (policy/journal.py) are left out of the layer: not counted, never crashed at, not
# in the modelled tree. They are advisory, and written by whichever thread emits an event (the deleter
# thread's "deleted" beside the saving thread's "committed"), so their operations interleave with
# retention's differently on each run, and the trace check needs one order. The campaigns check
# checkpoints; a torn or hostile journal line is tests/goodput/test_journal.py's.
ADVISORY = frozenset({".journal.jsonl", ".journal.jsonl.tmp", ".progress"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

# The real functions, taken when this module is imported (in the zygote, before any child patches them).
_open = builtins.open
_io_open = io.open
_os = {
    name: getattr(os, name)
    for name in (
        "open",
        "write",
        "fsync",
        "fdatasync",
        "sync",
        "rename",
        "replace",
        "unlink",
        "remove",
        "rmdir",
        "mkdir",
    )
}
_exchange = safepoint.store.posix_layout._rename_exchange

_active: Layer | None = None


def active() -> Layer | None:
    return _active


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"<fd {fd}>"


def _path(path: Any, dir_fd: int | None = None) -> str:
    if isinstance(path, int):
        return _fd_path(path)
    p = os.fsdecode(os.fspath(path))
    if dir_fd is not None and not os.path.isabs(p):
        return os.path.join(_fd_path(dir_fd), p)
    return os.path.abspath(p)


class _File:
    """A file object opened for writing: every write() is a counted operation."""

    def __init__(self, layer: Layer, f: Any, path: str) -> None:
        self._f = f
        self._layer = layer
        self._path = path

    def write(self, data: Any) -> Any:
        i = self._layer.begin("write", self._path)
        if i < 0:
            # Injected failure: a disk filling up mid-write gets half the bytes out first.
            err = -i
            if err == errno_mod.ENOSPC and len(data) > 1:
                self._f.write(data[: len(data) // 2])
                self._f.flush()
            self._layer.raise_fault(err, self._path)
        n = self._f.write(data)
        self._layer.end(i)
        return n

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __enter__(self) -> _File:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()

    def __iter__(self) -> Any:
        return iter(self._f)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


class Layer:
    def __init__(
        self,
        scope: str | os.PathLike[str],
        journal: str | os.PathLike[str],
        *,
        mode: str = "count",
        at: int = 0,
        err: int = errno_mod.EIO,
        sticky: tuple[str, ...] = (),
        no_exchange: bool = False,
        dir_fsync_errno: int | None = None,
        in_thread: bool = False,
    ) -> None:
        assert mode in ("count", "crash", "fail"), mode
        self.scope = os.path.realpath(scope)
        self.journal = Path(journal)
        self.blobs = self.journal / "blobs"
        _os["mkdir"](self.journal)
        _os["mkdir"](self.blobs)
        self.log_fd = _os["open"](
            self.journal / "journal.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
        )
        self.mode, self.at, self.err, self.sticky = mode, at, err, sticky
        self.no_exchange = no_exchange
        self.dir_fsync_errno = dir_fsync_errno
        # in_thread: fail the first write issued by a thread other than the main one (``at`` unused), and
        # hold the main thread at its first data-file open until then, so that a second writer thread
        # surely takes a file (DCP starts its extra threads before the main one joins in).
        self.in_thread = in_thread
        self._other_wrote = threading.Event()
        self.count = 0
        self.faults = 0
        self.armed = True
        self.tripped = False
        self._lock = threading.RLock()
        self._gen: dict[int, int] = {}
        self._next_gen = 1
        self._blob = 0

    # ---- journal -------------------------------------------------------------------------------------

    def log(self, **record: Any) -> None:
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        with self._lock:
            _os["write"](self.log_fd, line)

    def mark(self, **fields: Any) -> None:
        self.log(ev="mark", t=round(time.monotonic(), 4), **fields)

    def in_scope(self, path: str | None) -> bool:
        if path is None or os.path.basename(path) in ADVISORY:
            return False
        return path == self.scope or path.startswith(self.scope + os.sep)

    def _new_inode(self, ino: int, path: str) -> None:
        with self._lock:
            gen = self._gen[ino] = self._next_gen
            self._next_gen += 1
        self.log(ev="new", ino=ino, gen=gen, path=path)

    def _snapshot_dir(self, fd_or_path: int | str, ino: int) -> None:
        entries = []
        with os.scandir(fd_or_path) as it:
            for e in it:
                if e.name in ADVISORY:
                    continue
                entries.append(
                    [e.name, e.inode(), self._gen.get(e.inode(), -1), e.is_dir(follow_symlinks=False)]
                )
        self.log(ev="dir", ino=ino, gen=self._gen.get(ino, -1), entries=sorted(entries))

    def _snapshot_file(self, source: str, ino: int) -> None:
        with self._lock:
            self._blob += 1
            blob = self._blob
        with _open(source, "rb") as src, _open(self.blobs / str(blob), "wb") as dst:
            data = src.read()
            dst.write(data)
        self.log(ev="file", ino=ino, gen=self._gen.get(ino, -1), blob=blob, size=len(data))

    def _snapshot_tree(self) -> None:
        """Everything under scope as it is now (after a real sync): the durable baseline."""
        for dirpath, dirnames, filenames in os.walk(self.scope):
            for name in filenames:
                if name in ADVISORY:
                    continue
                p = os.path.join(dirpath, name)
                ino = os.lstat(p).st_ino
                self._gen.setdefault(ino, 0)
                self._snapshot_file(p, ino)
            for name in dirnames:
                self._gen.setdefault(os.lstat(os.path.join(dirpath, name)).st_ino, 0)
            self._gen.setdefault(os.lstat(dirpath).st_ino, 0)
            self._snapshot_dir(dirpath, os.lstat(dirpath).st_ino)

    def baseline(self) -> None:
        self.log(ev="scope", path=self.scope, ino=os.lstat(self.scope).st_ino)
        self._snapshot_tree()

    # ---- operations ------------------------------------------------------------------------------------

    def begin(self, kind: str, path: str, dst: str | None = None) -> int:
        """Count an operation (0 if out of scope). Returns -errno when this one must fail."""
        if not (self.in_scope(path) or self.in_scope(dst)):
            return 0
        with self._lock:
            self.count += 1
            i = self.count
        self.log(ev="op", i=i, op=kind, path=path, dst=dst)
        if not self.armed:
            return i
        if self.mode == "crash" and i == self.at:
            # Under the lock: another thread's create is never half journalled when the signal lands.
            self._lock.acquire()
            self.log(ev="crash", i=i)
            os.kill(os.getpid(), signal.SIGKILL)
            while True:  # pragma: no cover - the signal is on its way
                time.sleep(1)
        if self.in_thread:
            main = threading.current_thread() is threading.main_thread()
            hit = not main and kind == "write" and not self.tripped
            if hit:
                self._other_wrote.set()
        else:
            hit = i == self.at
        if self.mode == "fail" and (hit or (self.tripped and kind in self.sticky)):
            self.tripped = True
            self.faults += 1
            self.log(ev="fail", i=i, errno=self.err)
            return -self.err
        return i

    def raise_fault(self, err: int, path: str) -> None:
        raise OSError(err, os.strerror(err) + " (injected)", path)

    def end(self, i: int, error: BaseException | None = None) -> None:
        if i > 0:
            if error is None:
                self.log(ev="done", i=i)
            else:
                self.log(ev="err", i=i, errno=getattr(error, "errno", None), error=type(error).__name__)

    def run(self, kind: str, path: str, fn: Callable[[], Any], dst: str | None = None) -> Any:
        i = self.begin(kind, path, dst)
        if i < 0:
            self.raise_fault(-i, path)
        try:
            out = fn()
        except BaseException as e:
            self.end(i, e)
            raise
        self.end(i)
        return out

    def disarm(self) -> None:
        self.armed = False
        self.tripped = False

    # ---- patched entry points --------------------------------------------------------------------------

    def open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if not any(c in mode for c in "wax+"):
            return _open(file, mode, *args, **kwargs)
        path = _path(file)
        if not self.in_scope(path):
            return _open(file, mode, *args, **kwargs)
        if isinstance(file, int):  # os.fdopen: the descriptor was opened (and counted) by os.open
            return _File(self, _open(file, mode, *args, **kwargs), path)
        if (
            self.in_thread
            and path.endswith(".distcp")
            and threading.current_thread() is threading.main_thread()
        ):
            self._other_wrote.wait(5)  # let DCP's extra writer thread take a file first (see __init__)
        with self._lock:  # the file and its journal entry appear together (see begin)
            existed = os.path.lexists(path)
            f = self.run("open", path, lambda: _open(file, mode, *args, **kwargs))
            if not existed:
                self._new_inode(os.fstat(f.fileno()).st_ino, path)
        return _File(self, f, path)

    def os_open(self, path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if not flags & _WRITE_FLAGS:
            return int(_os["open"](path, flags, mode, dir_fd=dir_fd))
        p = _path(path, dir_fd)
        if self.in_thread and p.endswith(".distcp") and threading.current_thread() is threading.main_thread():
            self._other_wrote.wait(5)  # as in open(): safepoint creates DCP's files with os.open (rootfs)
        with self._lock:
            existed = self.in_scope(p) and os.path.lexists(p)
            fd = int(self.run("open", p, lambda: _os["open"](path, flags, mode, dir_fd=dir_fd)))
            if self.in_scope(p) and not existed:
                self._new_inode(os.fstat(fd).st_ino, p)
        return fd

    def os_write(self, fd: int, data: Any) -> int:
        return int(self.run("write", _fd_path(fd), lambda: _os["write"](fd, data)))

    def fsync(self, fd: Any, *, which: str = "fsync") -> None:
        fileno = fd if isinstance(fd, int) else fd.fileno()
        path = _fd_path(fileno)
        if self.dir_fsync_errno and self.in_scope(path) and stat.S_ISDIR(os.fstat(fileno).st_mode):
            i = self.begin("fsync", path)
            if i < 0:
                self.raise_fault(-i, path)
            err = OSError(self.dir_fsync_errno, os.strerror(self.dir_fsync_errno) + " (simulated)", path)
            self.end(i, err)
            raise err
        self.run("fsync", path, lambda: _os[which](fileno))
        if self.in_scope(path.removesuffix(" (deleted)")):
            st = os.fstat(fileno)
            if stat.S_ISDIR(st.st_mode):
                self._snapshot_dir(fileno, st.st_ino)
            else:
                self._snapshot_file(f"/proc/self/fd/{fileno}", st.st_ino)

    def sync(self) -> None:
        self.run("fsync", self.scope, _os["sync"])
        self._snapshot_tree()

    def rename(
        self,
        src: Any,
        dst: Any,
        *,
        src_dir_fd: int | None = None,
        dst_dir_fd: int | None = None,
        which: str = "rename",
    ) -> None:
        s, d = _path(src, src_dir_fd), _path(dst, dst_dir_fd)
        self.run(
            "rename", s, lambda: _os[which](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd), dst=d
        )

    def unlink(self, path: Any, *, dir_fd: int | None = None) -> None:
        self.run("unlink", _path(path, dir_fd), lambda: _os["unlink"](path, dir_fd=dir_fd))

    def rmdir(self, path: Any, *, dir_fd: int | None = None) -> None:
        self.run("rmdir", _path(path, dir_fd), lambda: _os["rmdir"](path, dir_fd=dir_fd))

    def mkdir(self, path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        p = _path(path, dir_fd)
        with self._lock:
            self.run("mkdir", p, lambda: _os["mkdir"](path, mode, dir_fd=dir_fd))
            if self.in_scope(p):
                self._new_inode(os.lstat(p).st_ino, p)

    def exchange(self, a: Path, b: Path) -> bool:
        if self.no_exchange:
            # A file system without renameat2 (e.g. NFS): the call fails with EINVAL, _rename_exchange
            # returns False and safepoint parks the old copy instead.
            i = self.begin("exchange", _path(a), _path(b))
            if i < 0:
                self.raise_fault(-i, _path(a))
            self.end(i, OSError(errno_mod.EINVAL, "renameat2 RENAME_EXCHANGE not supported (simulated)"))
            return False
        return bool(self.run("exchange", _path(a), lambda: _exchange(a, b), dst=_path(b)))


def install(layer: Layer) -> Layer:
    """Patch every entry point for the rest of this process's life (a child's: it never un-patches)."""
    global _active
    _active = layer
    layer.baseline()
    builtins.open = layer.open
    io.open = layer.open
    os.open = layer.os_open
    os.write = layer.os_write
    os.fsync = layer.fsync
    os.fdatasync = lambda fd: layer.fsync(fd, which="fdatasync")
    os.sync = layer.sync
    os.rename = layer.rename
    os.replace = lambda s, d, **kw: layer.rename(s, d, which="replace", **kw)
    os.unlink = layer.unlink
    os.remove = layer.unlink
    os.rmdir = layer.rmdir
    os.mkdir = layer.mkdir
    safepoint.store.posix_layout._rename_exchange = layer.exchange
    for fn in (os.open, os.unlink, os.rmdir, os.mkdir, os.rename, os.replace):
        os.supports_dir_fd.add(fn)
    return layer
