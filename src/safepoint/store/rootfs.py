"""The one guarded way to touch files under a checkpoint root (docs/architecture.md, "Touching the root").

A :class:`RootDir` opens its root once as a directory descriptor; every path under it is a relative one,
walked component by component with ``dir_fd`` and ``O_NOFOLLOW|O_DIRECTORY``: a symlink anywhere below the
root (``local_root/.peers`` pointing at a home directory, ``.pending`` at another job's root) is refused,
never followed, whatever its position in the path. On top of that walk:

- reads open regular files only (``O_NONBLOCK``, then ``fstat``: a FIFO never blocks, a device or directory
  is refused) and whole-file reads are bounded by a size cap;
- creates use ``O_CREAT|O_EXCL|O_NOFOLLOW`` in a walked directory (whatever stood at the name is unlinked
  first: a planted symlink is removed, not written through);
- renames are ``rename(src_dir_fd=, dst_dir_fd=)`` between two walked directories of the same root;
- deletes are ``shutil.rmtree(name, dir_fd=parent)``, which on Linux walks by descriptors and never follows
  a symlink (``rmtree.avoids_symlink_attacks``): nothing outside the root can be reached.

The root's *own* path is the user's to choose and is opened as given (a ``/ckpt`` that is a symlink to
``/mnt/nvme/ckpt`` is the user's decision); the trust boundary is everything below it, which other
processes and a previous, possibly hostile, owner may have written.

Only this module and :mod:`safepoint.store.guard` (the primitives it is built on) call ``open``/``os.open``,
``rename``, ``rmtree``, ``Path.is_dir`` and friends on paths under a root: tests/test_architecture.py fails
on any other module that does.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from safepoint.store import held_dirs
from safepoint.store.checksum import stream_crc32c
from safepoint.store.fsops import fsync_dir_fd, rename_exchange_at
from safepoint.store.guard import describe_mode, keep_if_regular, remove_flat

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# Modes as open() and mkdir() give them (0o666/0o777, less the umask): a group-writable shared root stays so.

Rel = str | Path
"""A place under the root: a ``str`` is a name relative to the root (``".pending/x"``, ``""`` the root
itself); a ``Path`` is a path as the OS sees it (absolute, or relative to the working directory) and must
lie under the root's path. The two never mix: a relative ``Path("ckpt/x")`` is never ``root/ckpt/x``."""


class OutsideRootError(OSError):
    """A path that names something outside the root (``..``, an absolute path elsewhere)."""


class RootDir:
    """A checkpoint root (or any directory whose inside we own): see the module docstring.

    Nothing is held open between calls: each operation opens the root afresh (one ``open``), so a root
    removed and made again while a job runs (a node that lost its disk) is simply the new one."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._base = os.path.abspath(path)  # what parts() compares paths with, as strings
        self._prefix = self._base if self._base.endswith("/") else self._base + "/"

    # ---- the walk ------------------------------------------------------------------------------------

    def make(self) -> None:
        """Create the root itself, and its parents (the user's path: see the module docstring)."""
        os.makedirs(self.path, exist_ok=True)

    def parts(self, rel: Rel) -> tuple[str, ...]:
        """The components of ``rel`` below the root; OutsideRootError if it is not below the root."""
        # String operations, not pathlib: every guarded operation starts here (dozens per save), and
        # pathlib's parsing cost ~40 us a call, a tenth of a small save. Same answers: ``abspath`` normalises
        # as before (no ".", "..", or empty component is left in it), and a relative name splits on "/"
        # as PurePosixPath does (empty and "." components dropped, ".." kept and refused below).
        if isinstance(rel, Path):
            path = os.path.abspath(rel)
            if path == self._base:
                return ()
            if not path.startswith(self._prefix):
                raise OutsideRootError(errno.EXDEV, f"{rel} is not under {self.path}")
            out = tuple(path[len(self._prefix) :].split("/"))
            if "" in out:  # "//x" (POSIX keeps a leading "//") under the root "/": not the same root
                raise OutsideRootError(errno.EXDEV, f"{rel} is not under {self.path}")
        else:
            if rel.startswith("/"):
                raise OutsideRootError(errno.EXDEV, f"{rel!r}: a name under {self.path} is relative")
            out = tuple(c for c in rel.split("/") if c and c != ".")
        if ".." in out:
            raise OutsideRootError(errno.EXDEV, f"{'/'.join(out)} leaves {self.path} ('..')")
        return out

    def full(self, rel: Rel) -> Path:
        """The path ``rel`` stands for (for messages and for readers that take paths)."""
        return self.path.joinpath(*self.parts(rel))

    def holds(self, path: Path) -> bool:
        """Whether ``path`` lies under the root (by its path: nothing is opened)."""
        try:
            self.parts(path)
        except OutsideRootError:
            return False
        return True

    def name(self, rel: Rel) -> str:
        """``rel`` as a name relative to the root (the ``str`` form of :data:`Rel`)."""
        return "/".join(self.parts(rel))

    @contextlib.contextmanager
    def dir(self, rel: Rel = "", *, create: bool = False) -> Iterator[int]:
        """A descriptor of the real directory ``rel`` (each component opened with O_NOFOLLOW|O_DIRECTORY
        from the one before; ``create`` makes missing ones). ELOOP/ENOTDIR: a symlink or file on the way."""
        fd = self._walk(self.parts(rel), create)
        try:
            yield fd
        finally:
            os.close(fd)

    def _walk(self, parts: tuple[str, ...], create: bool) -> int:
        # Inside held_dirs.holding (one save's writes): from the deepest held directory on the way.
        fd, done = held_dirs.start(dirs, self._base, parts) if (dirs := held_dirs.current()) else (-1, 0)
        if fd < 0:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            if dirs and held_dirs.below_held(dirs, self._base):
                dirs = None  # its base opened by path, through any symlink: nothing reached from it is held
            elif dirs:
                held_dirs.reached(dirs, self._base, fd)
        try:
            for n in range(done, len(parts)):
                name = parts[n]
                try:
                    nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):  # made meanwhile: opened (and checked) below
                        os.mkdir(name, 0o777, dir_fd=fd)
                    nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = nxt
                if dirs:
                    held_dirs.reached(dirs, self._prefix + "/".join(parts[: n + 1]), fd)
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextlib.contextmanager
    def parent(self, rel: Rel, *, create: bool = False) -> Iterator[tuple[int, str]]:
        """(descriptor of the directory holding ``rel``, ``rel``'s last component)."""
        parts = self.parts(rel)
        if not parts:
            raise OutsideRootError(errno.EINVAL, f"{self.path}: the root itself has no parent here")
        fd = self._walk(parts[:-1], create)  # what dir() walks, without parsing the joined name again
        try:
            yield fd, parts[-1]
        finally:
            os.close(fd)

    # ---- looking -------------------------------------------------------------------------------------

    def lstat(self, rel: Rel) -> os.stat_result | None:
        """``rel``'s own stat (a symlink is not followed), or None when it, or a directory on its way, is
        missing, a symlink or not a directory."""
        parts = self.parts(rel)  # parsed once: parent() would parse it again, and dir() the rest again
        try:
            if not parts:
                return os.stat(self.path)
            fd = self._walk(parts[:-1], False)
            try:
                return os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
            finally:
                os.close(fd)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:  # a symlink on the way: nothing under it is ours
                return None
            raise

    def kind(self, rel: Rel) -> str | None:
        """ "a regular file", "a directory", "a symlink", ... (guard.describe_mode), None if missing."""
        st = self.lstat(rel)
        return None if st is None else describe_mode(st.st_mode)

    def isdir(self, rel: Rel) -> bool:
        """A real directory reached without a symlink (a symlink to one is not)."""
        st = self.lstat(rel)
        return st is not None and stat.S_ISDIR(st.st_mode)

    def isfile(self, rel: Rel) -> bool:
        """A regular file reached without a symlink (a FIFO, device or symlink is not)."""
        st = self.lstat(rel)
        return st is not None and stat.S_ISREG(st.st_mode)

    def lexists(self, rel: Rel) -> bool:
        return self.lstat(rel) is not None

    def listdir(self, rel: Rel = "") -> list[str]:
        """The names in the real directory ``rel``, sorted; [] if it is missing (OSError if it is a
        symlink or not a directory)."""
        try:
            with self.dir(rel) as fd:
                return sorted(os.listdir(fd))
        except FileNotFoundError:
            return []

    def dirs_holding(self, filename: str, wanted: Callable[[str], object]) -> list[str]:
        """The names in the root for which ``wanted`` is truthy that are real directories holding a
        regular file ``filename``, sorted: the answers of ``isdir(name) and isfile(f"{name}/{filename}")``
        for each listed name, from one descriptor of the root and one per candidate directory instead of
        two walks from the root per name (retention lists the root this way after every save). Safe: each
        candidate is opened O_NOFOLLOW|O_DIRECTORY from the root's descriptor (a symlink or a file is
        skipped, as ``isdir`` says False for it) and ``filename`` is lstat'ed inside it; only what makes
        ``lstat`` say None (missing, a symlink or not a directory on the way) is skipped, anything else
        (EACCES) is raised as the walks raised it."""
        found = []
        try:
            with self.dir() as fd:
                for name in os.listdir(fd):
                    if not wanted(name):
                        continue
                    try:
                        sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                        try:
                            mode = os.stat(filename, dir_fd=sub, follow_symlinks=False).st_mode
                        finally:
                            os.close(sub)
                    except (FileNotFoundError, NotADirectoryError):
                        continue
                    except OSError as e:
                        if e.errno == errno.ELOOP:  # a symlinked step-N is never a checkpoint
                            continue
                        raise
                    if stat.S_ISREG(mode):
                        found.append(name)
        except FileNotFoundError:
            return []
        return sorted(found)

    # ---- reading -------------------------------------------------------------------------------------

    def open_read(self, rel: Rel) -> int:
        """A read-only descriptor of the regular file ``rel`` (no symlink on the way, no FIFO, no device).
        The caller closes it. OSError (ELOOP, ENOENT, ...) or NotRegularFileError otherwise."""
        with self.parent(rel) as (dfd, name):
            fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
        return keep_if_regular(fd, lambda: self.full(rel))

    def read(self, rel: Rel, limit: int) -> bytes:
        """The whole regular file ``rel``, at most ``limit`` bytes: a larger one raises OSError (EFBIG)
        rather than being read without bound (one linked to /dev/zero cannot even be opened)."""
        fd = self.open_read(rel)
        try:
            chunks: list[bytes] = []
            size = 0
            while size <= limit and (chunk := os.read(fd, limit + 1 - size)):
                chunks.append(chunk)
                size += len(chunk)
        finally:
            os.close(fd)
        if size > limit:
            raise OSError(errno.EFBIG, f"{self.full(rel)} is larger than {limit} bytes")
        return b"".join(chunks)

    def crc32c(self, rel: Rel) -> tuple[int, str]:
        """(size, crc32c hex) of the regular file ``rel`` (:meth:`open_read`), read in bounded chunks."""
        with os.fdopen(self.open_read(rel), "rb", buffering=0) as f:
            return stream_crc32c(f)

    # ---- writing -------------------------------------------------------------------------------------

    def create(self, rel: Rel, *, parents: bool = False, exclusive: bool = False) -> int:
        """A new, empty regular file ``rel`` open for writing (the caller closes it). Whatever stood at the
        name (a stale file, a symlink planted there) is unlinked first, never followed or written through;
        O_EXCL|O_NOFOLLOW refuses anything put there meanwhile. A directory in the way is an error.
        ``exclusive``: nothing is unlinked; FileExistsError if anything stands there (a lease's create)."""
        with self.parent(rel, create=parents) as (dfd, name):
            if not exclusive:  # nothing there (every save's files): created at once, no stat to fail
                with contextlib.suppress(FileExistsError):
                    return os.open(name, _CREATE_FLAGS, 0o666, dir_fd=dfd)
            with contextlib.suppress(FileNotFoundError):
                if exclusive:
                    return os.open(name, _CREATE_FLAGS, 0o666, dir_fd=dfd)
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    raise IsADirectoryError(errno.EISDIR, f"{self.full(rel)} is a directory")
                os.unlink(name, dir_fd=dfd)
            return os.open(name, _CREATE_FLAGS, 0o666, dir_fd=dfd)

    def open_write(self, rel: Rel, *, append: bool = True) -> int:
        """A descriptor writing the regular file ``rel``, kept if it exists, created if not (never through
        a symlink; a FIFO or device is refused): ``O_APPEND`` when ``append``, else read-write (to map)."""
        flags = os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        flags |= os.O_WRONLY | os.O_APPEND if append else os.O_RDWR
        with self.parent(rel) as (dfd, name):
            fd = os.open(name, flags, 0o666, dir_fd=dfd)
        return keep_if_regular(fd, lambda: self.full(rel))

    def write(self, rel: Rel, data: bytes, *, durable: bool = True, parents: bool = False) -> None:
        """:meth:`create` ``rel`` holding ``data`` (fsync'd when ``durable``; its directories made with
        ``parents``)."""
        fd = self.create(rel, parents=parents)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)

    def makedirs(self, rel: Rel, *, parents: bool = True) -> None:
        """Make the real directory ``rel`` (and, with ``parents``, those on its way); an existing real
        directory is fine, a symlink or file anywhere on the way is an OSError."""
        parts = self.parts(rel)
        if not parents:
            with self.parent(rel) as (dfd, name), contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o777, dir_fd=dfd)
        with self.dir("/".join(parts), create=parents):
            pass  # opened: it is a real directory, reached without a symlink

    def move(self, src: Rel, dst: Rel, *, replace: bool = True) -> None:
        """Rename ``src`` to ``dst``, both under the root, through their walked parents (neither path can
        lead outside it). ``replace`` False refuses an existing ``dst`` (a non-empty directory is always
        refused by the kernel)."""
        with self.parent(src) as (sfd, sname), self.parent(dst) as (dfd, dname):
            if not replace:
                with contextlib.suppress(FileNotFoundError):
                    os.stat(dname, dir_fd=dfd, follow_symlinks=False)
                    raise FileExistsError(errno.EEXIST, f"{self.full(dst)} exists")
            os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)

    def exchange(self, a: Rel, b: Rel) -> bool:
        """Swap ``a`` and ``b`` atomically (renameat2 RENAME_EXCHANGE between their walked parents); False
        where the file system has no such call (NFS)."""
        with self.parent(a) as (afd, aname), self.parent(b) as (bfd, bname):
            return rename_exchange_at(afd, aname, bfd, bname, str(self.full(b)))

    def link(self, src: Rel, dst: Rel) -> None:
        """Hard-link ``src`` (itself, never a symlink's target) as ``dst``: atomic and exclusive like
        O_EXCL (FileExistsError if ``dst`` exists), both under the root."""
        with self.parent(src) as (sfd, sname), self.parent(dst) as (dfd, dname):
            os.link(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)

    def fsync_dir(self, rel: Rel = "") -> None:
        with self.dir(rel) as fd:
            fsync_dir_fd(fd, self.full(rel))

    # ---- deleting ------------------------------------------------------------------------------------

    def remove(self, rel: Rel) -> None:
        """Unlink the file (or symlink: the link, never its target) ``rel``; missing is fine."""
        with contextlib.suppress(FileNotFoundError, NotADirectoryError), self.parent(rel) as (dfd, name):
            os.unlink(name, dir_fd=dfd)

    def remove_empty_dir(self, rel: Rel) -> None:
        """Remove the directory ``rel`` if it is empty (never a symlink, never contents); else OSError."""
        with self.parent(rel) as (dfd, name):
            os.rmdir(name, dir_fd=dfd)

    def remove_tree_from(self, rel: Rel, first: str, expected: tuple[int, int] | None) -> bool:
        """Unlink ``rel``/``first`` through a descriptor of the directory ``rel`` checked to be ``expected``
        (device, inode), then (only if that worked) :meth:`remove_tree` it. False, having deleted nothing,
        if ``rel`` is no longer that directory; True otherwise (also when unlinking ``first`` failed and the
        directory was left intact)."""
        try:
            with self.dir(rel) as fd:
                st = os.fstat(fd)
                if expected is not None and (st.st_dev, st.st_ino) != expected:
                    return False
                try:
                    os.unlink(first, dir_fd=fd)
                except FileNotFoundError:
                    pass
                except OSError:
                    return True
        except OSError:
            return False
        now = self.lstat(rel)
        if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):  # else not ours now
            self.remove_tree(rel)
        return True

    def remove_tree(self, rel: Rel) -> str | None:
        """Delete ``rel`` and everything in it, never leaving the root: a symlink (at ``rel`` or inside) is
        unlinked, not followed; a path with a symlink *on the way* to it names nothing of ours and is left
        alone (nothing there is deleted). Returns what was left alone and why, or None."""
        if not shutil.rmtree.avoids_symlink_attacks:  # pragma: no cover - every Linux Python has it
            raise OSError(f"refusing to delete under {self.path}: this platform's rmtree can follow symlinks")
        try:
            with self.parent(rel) as (dfd, name):
                try:
                    mode = os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode
                except FileNotFoundError:
                    return None
                if stat.S_ISDIR(mode):
                    if not remove_flat(name, dfd):  # a subdirectory in it: rmtree's generic walk
                        shutil.rmtree(name, ignore_errors=True, dir_fd=dfd)
                elif stat.S_ISLNK(mode):
                    os.unlink(name, dir_fd=dfd)
                else:
                    return f"{self.full(rel)} is {describe_mode(mode)}; left alone"
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                return f"{self.full(rel)}: a symlink or file on the way ({e.strerror}); left alone"
            raise
        return None


def around(path: Path, fs: RootDir | None = None) -> RootDir:
    """``fs`` if ``path`` lies under it (walked from its root), else a RootDir of ``path``'s own directory:
    that directory's path is the caller's, like a root's (a step directory a layout named), and the name in
    it is still opened with O_NOFOLLOW, regular files only."""
    return fs if fs is not None and fs.holds(path) else RootDir(path.parent)
