"""Writing a file so that no reader ever sees half of it.

Every file the tool writes that another run (or a later step of this one) may
read goes through :func:`write_atomic`: the journal's entries, the facts
cached per base image, the notes of runs in progress, ``pins.txt``. The data
goes to a temporary file in the same folder (a rename is atomic only within
one file system), is flushed to disk, and only then takes the final name. A
write that fails, a full disk included, removes the temporary file and raises
one :class:`PipelineError` line naming the file, so nothing half-written is
left behind under any name.

A name that holds something other than a regular file is never renamed over:
a character device (``--report /dev/null``, the usual way to throw output
away) or a FIFO another process reads is written in place, anything else
(a folder, a block device, a socket) is refused.

Reading a file a user names (a key, an envelope, reference answers, a saved
log) goes through :func:`opened_regular`: opened without waiting on it, and
refused unless it is a regular file (a FIFO would be read until its writer
closes it).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from ..errors import NotRegular, PipelineError, StorageError

log = logging.getLogger(__name__)

# Out of space, or out of quota: to the person at the terminal the same fix.
_FULL = {errno.ENOSPC, errno.EDQUOT}


def write_atomic(
    path: Path,
    data: bytes | str,
    *,
    exclusive: bool = False,
    mode: int = 0o666,
    error: type[PipelineError] = StorageError,
) -> None:
    """Write ``data`` (str as UTF-8) to ``path``: the old content or all of the new, never part of it.

    ``exclusive`` gives the file its name with ``link()``, which fails when
    ``path`` already exists, for files that are written once and never
    replaced (the journal's entries); otherwise ``os.replace`` puts it over
    any old one. ``mode`` is the new file's mode before the umask. Any OSError
    becomes ``error`` naming ``path``; the temporary file never survives.
    """
    raw = data.encode("utf-8") if isinstance(data, str) else data
    if not exclusive and _special(path, error):
        _write_in_place(path, raw, error)
        return
    # Hidden and not ending in the final suffix, so that a reader listing
    # ``*.json`` never picks up a file still being written.
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{os.urandom(4).hex()}.tmp")
    created = False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        created = True
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        if exclusive:
            os.link(tmp, path)
        else:
            os.replace(tmp, path)
            created = False
    except OSError as exc:
        if exc.errno in _FULL:
            raise error(f"cannot write {path}: the disk is full ({exc.strerror})") from exc
        raise error(f"cannot write {path}: {exc.strerror or exc}") from exc
    finally:
        if created:
            try:
                tmp.unlink()
            except OSError as exc:  # the write's own error, if any, is the one to report
                log.debug("cannot remove %s: %s", tmp, exc)


def _special(path: Path, error: type[PipelineError]) -> bool:
    """True if ``path`` (its target, for a link) is a character device or FIFO, to be written in place.

    Raises ``error`` for any other kind of file that is not a regular one;
    False for a regular file or no file at all.
    """
    try:
        st = os.stat(path)
    except OSError:
        return False  # nothing there (or nothing reachable): the ordinary write makes it, or names the error
    if stat.S_ISREG(st.st_mode):
        return False
    if stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode):
        return True
    kind = ("a folder" if stat.S_ISDIR(st.st_mode) else "a block device" if stat.S_ISBLK(st.st_mode)
            else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
    raise error(f"cannot write {path}: it is {kind}; give the name of a regular file")


def _write_in_place(path: Path, raw: bytes, error: type[PipelineError]) -> None:
    """Write ``raw`` into the device or FIFO at ``path``, which stays what it is.

    A FIFO is opened without waiting: one that no process reads is an error
    now, not a run that hangs at its end.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise error(f"cannot write {path}: it is a FIFO that no process is reading") from exc
        raise error(f"cannot write {path}: {exc.strerror or exc}") from exc
    try:
        os.set_blocking(fd, True)
        view = memoryview(raw)
        while view:
            view = view[os.write(fd, view):]
    except OSError as exc:
        if exc.errno in _FULL:
            raise error(f"cannot write {path}: no space left on it ({exc.strerror})") from exc
        raise error(f"cannot write {path}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)


def claim(path: Path, *, mode: int = 0o600, error: type[PipelineError] = StorageError) -> bool:
    """Create ``path`` empty if no file has that name yet: True if this call made it, False if one was there.

    ``O_EXCL`` makes the test and the creation one step, so of any number of
    processes claiming the same name exactly one gets True (the journal hands
    out its sequence numbers this way). Any other OSError becomes ``error``
    naming ``path``.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno in _FULL:
            raise error(f"cannot create {path}: the disk is full ({exc.strerror})") from exc
        raise error(f"cannot create {path}: {exc.strerror or exc}") from exc
    os.close(fd)
    return True


@contextmanager
def one_writer(path: Path) -> Iterator[None]:
    """Hold ``path``.lock while the body makes ``path``: a second process making the same file waits for the
    first, then finds it made (two ``standin`` runs, or two test workers, sharing one cache)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextmanager
def opened_regular(path: str | Path) -> Iterator[tuple[BinaryIO, os.stat_result]]:
    """``path`` open for reading, with its stat, if it is a regular file: opened without blocking (a FIFO's
    open waits for a writer), then checked; :class:`NotRegular` otherwise, OSError where it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(errno.EINVAL, "not a regular file", str(path))
        with os.fdopen(os.dup(fd), "rb") as fh:
            yield fh, st
    finally:
        os.close(fd)
