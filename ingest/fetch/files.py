"""Reading files of a mounted file system (Lustre, GPFS, NFS, local NVMe) into ring slots.

The twin of ``s3.py`` for ``file://`` notifications, with the same three calls the
pipeline makes (``locate``, ``read_first_then``, ``read_into``), the same retries and
the same errors, so an object read from a file goes through the same header parse,
digests, device stage, outputs and audit as one read from S3.

Facts it relies on, and what it does with them:

- A notification names a file by its path under a configured root
  (``ingest/source/notifications.py`` checks the words of the path). Symbolic links
  are followed, but the file a read opens must lie inside its root's real path: the
  check reads where the open descriptor leads (``/proc/self/fd``), so a link swapped
  between a check and the open cannot lead a read outside. A path that leads outside
  is ``AccessDenied``; anything but a regular file is refused (opened with
  ``O_NONBLOCK``, so a FIFO cannot hang a read thread).
- A file has no ETag; its version is its inode, modification time (ns) and size,
  written as an ETag (``file_etag``). Each read checks it before and after reading,
  as S3's ``If-Match`` does, so a range never mixes two versions: a file replaced or
  rewritten while it is read is ``ObjectChanged``.
- Reads run on ``fetch_concurrency`` threads of their own with ``preadv`` straight
  into the slot (``posix``), or with KvikIO (``kvikio``: its thread pool, and
  GPUDirect Storage where the file system and the nvidia-fs driver allow it; else
  its POSIX mode). A cancelled read waits for its thread, so a slot is never written
  after it was given back.
- ``EIO``, ``ESTALE``, ``ETIMEDOUT`` and their kin (a parallel file system's server
  away for a moment) are retried by ``retry.py``'s policy; a missing file is
  ``ObjectNotFound`` and a refused one ``AccessDenied``, for good.
"""

from __future__ import annotations

import asyncio
import errno
import importlib.util
import os
import stat
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import anyio

from ingest import metrics
from ingest.errors import (
    AccessDenied,
    ConfigError,
    IngestError,
    ObjectChanged,
    ObjectNotFound,
    SourceError,
    SourceUnavailable,
)
from ingest.fetch.planning import ByteRange
from ingest.fetch.s3 import After, ObjectHead
from ingest.retry import with_retries
from ingest.settings import Settings

T = TypeVar("T")
_FD_LINKS = "/proc/self/fd"
_NOT_FOUND = {errno.ENOENT, errno.ENOTDIR}
_DENIED = {errno.EACCES, errno.EPERM, errno.EROFS}
_TRANSIENT = {
    errno.EIO,
    errno.ESTALE,
    errno.ETIMEDOUT,
    errno.EAGAIN,
    errno.EINTR,
    errno.EBUSY,
    errno.ENOLCK,
    errno.ENOMEM,
    errno.ENFILE,
    errno.EMFILE,
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.EHOSTUNREACH,
    errno.ENETDOWN,
    errno.ENETUNREACH,
}


@dataclass(frozen=True, slots=True)
class FileLocation:
    """A file to read: its path (the root's path and the key), and the real path of its
    root, inside which the opened file must lie."""

    path: str
    root: str


def file_etag(st: os.stat_result) -> str:
    """A file version's ETag: inode, modification time in ns and size, in hex."""
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"


def translate_file_error(exc: BaseException, what: str) -> IngestError:
    """Map an ``OSError`` (or KvikIO's ``RuntimeError``) to our tree (the one place)."""
    if isinstance(exc, IngestError):
        return exc
    if isinstance(exc, OSError):
        code = exc.errno
        if code in _NOT_FOUND:
            return ObjectNotFound(f"{what}: no such file")
        if code in _DENIED:
            return AccessDenied(f"{what}: permission denied")
        if code in _TRANSIENT or isinstance(exc, TimeoutError):
            return SourceUnavailable(f"{what}: {errno.errorcode.get(code or 0, 'OSError')}")
        return SourceError(f"{what}: {errno.errorcode.get(code or 0, type(exc).__name__)}")
    return SourceError(f"{what}: {type(exc).__name__}")  # not its message: it may hold the path


def inside(path: str, root: str) -> bool:
    """Whether the real path ``path`` is ``root`` or below it (both real paths)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def reader_name(settings: Settings) -> str:
    """``posix`` or ``kvikio``: what ``file_reader`` means on this machine."""
    if settings.file_reader != "auto":
        return settings.file_reader
    if settings.device == "cpu" or importlib.util.find_spec("kvikio") is None:
        return "posix"
    from ingest_gpu.thread import cuda_unavailable_reason

    return "posix" if cuda_unavailable_reason() is not None else "kvikio"


class _Open:
    """One open, checked file: its descriptor and the version it had when opened."""

    def __init__(self, where: FileLocation) -> None:
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
        self.fd = os.open(where.path, flags)
        try:
            self.stat = _checked(self.fd, where)
        except BaseException:
            os.close(self.fd)
            raise
        self.etag = file_etag(self.stat)

    def close(self) -> None:
        os.close(self.fd)

    def check_unchanged(self, etag: str) -> None:
        """Raises ``ObjectChanged`` when the file is not (or no longer) version ``etag``."""
        if file_etag(os.fstat(self.fd)) != etag:
            raise ObjectChanged("the file changed while it was read")


def _checked(fd: int, where: FileLocation) -> os.stat_result:
    """The open file's status, once it is known to be a regular file inside its root.

    Raises:
        AccessDenied: it lies outside its root (a symbolic link led there).
        SourceError: not a regular file.
    """
    if os.path.isdir(_FD_LINKS):  # where the descriptor leads, whatever the links did
        real = os.readlink(f"{_FD_LINKS}/{fd}")
    else:  # no procfs: the path's own resolution (a window between it and the open)
        real = os.path.realpath(where.path)
    if not inside(real, where.root):
        raise AccessDenied("the path leads outside its file root")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise SourceError("not a regular file")
    return st


@metrics.timed("fetch", metrics.RANGES_IN_FLIGHT)
def _preadv_full(fd: int, into: memoryview, offset: int) -> int:
    """``preadv`` until ``into`` is full or the file ends; the bytes read."""
    done = 0
    while done < len(into):
        n = os.preadv(fd, [into[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


@metrics.timed("fetch", metrics.RANGES_IN_FLIGHT)
def _kvikio_read(fd: int, into: memoryview, offset: int) -> int:
    """KvikIO's read of the open file into host memory (reopened through its descriptor's
    link, so it reads the file the checks were made on)."""
    import kvikio
    import numpy as np

    target = np.frombuffer(into, dtype=np.uint8)
    with kvikio.CuFile(f"{_FD_LINKS}/{fd}", "r") as f:
        return int(f.pread(target, len(into), offset).get())


def _kvikio_threads(threads: int) -> None:
    """Size KvikIO's thread pool, which runs every read's tasks, to the reads in flight
    (its own default is one thread), unless ``KVIKIO_NTHREADS`` sets it."""
    if "KVIKIO_NTHREADS" in os.environ:
        return
    import kvikio.defaults

    try:
        kvikio.defaults.set("num_threads", threads)
    except (AttributeError, TypeError, ValueError):  # before KvikIO 25.04: a reset function
        kvikio.defaults.num_threads_reset(threads)


class FileSource:
    """Reads files under ``file_roots`` into ring slots, in threads of its own; an async
    context manager (``aclose`` ends the threads)."""

    def __init__(self, settings: Settings) -> None:
        """Check the roots (their real paths are taken now) and choose the reader.

        Raises:
            ConfigError: a root is not a folder this process can see, or ``kvikio`` is
                asked for and not installed.
        """
        self._settings = settings
        self._roots: dict[str, tuple[str, str]] = {}  # name -> (path, real path)
        for name, path in settings.file_roots:
            if not os.path.isdir(path):
                raise ConfigError(f"DICOM_INGEST_FILE_ROOTS: root {name} is not a folder")
            self._roots[name] = (path, os.path.realpath(path))
        self.reader = reader_name(settings)
        if self.reader == "kvikio" and importlib.util.find_spec("kvikio") is None:
            raise ConfigError("DICOM_INGEST_FILE_READER: kvikio, and KvikIO is not installed")
        if self.reader == "kvikio":
            _kvikio_threads(settings.fetch_concurrency)
        self._read = _kvikio_read if self.reader == "kvikio" else _preadv_full
        self._threads = ThreadPoolExecutor(settings.fetch_concurrency, "file-read")

    async def __aenter__(self) -> FileSource:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._threads.shutdown()  # reads under way end first (none: see _in_thread)

    async def locate(self, bucket: str, key: str, version_id: str | None) -> FileLocation:
        """The file of root ``bucket`` at ``key`` (a version id means nothing to a file).

        Raises:
            AccessDenied: no root of that name, or ``key`` is not a plain relative path.
        """
        root = self._roots.get(bucket)
        parts = key.split("/")
        if root is None or any(p in ("", ".", "..") for p in parts) or "\x00" in key:
            raise AccessDenied("not a file under a configured root")
        return FileLocation(f"{root[0]}/{key}", root[1])

    async def read_first_then(
        self, where: FileLocation, into: memoryview, then: Callable[[memoryview], T] | None
    ) -> tuple[ObjectHead, int, T | None]:
        """Read the file's first ``len(into)`` bytes (or all of a smaller file) into ``into``,
        and if the whole file came, ``then(its bytes)`` in the same thread (raised as it is,
        never retried).

        Raises:
            ObjectNotFound, AccessDenied, ObjectChanged, SourceUnavailable, SourceError,
            and what ``then`` raises.
        """

        def work() -> tuple[ObjectHead, int, After[T] | None]:
            opened = _Open(where)
            try:
                size = opened.stat.st_size
                filled = self._read(opened.fd, into[: min(len(into), size)], 0)
                if filled != min(len(into), size):
                    raise ObjectChanged("the file ended early: it shrank while it was read")
                opened.check_unchanged(opened.etag)
            finally:
                opened.close()
            head = ObjectHead(size, opened.etag, None)
            if then is None or filled != size:
                return head, filled, None
            return head, filled, After.of(then, into[:filled])

        head, filled, after = await self._retried(work, "read")
        return head, filled, after.value() if after is not None else None

    async def read_into(
        self,
        where: FileLocation,
        head: ObjectHead,
        byte_range: ByteRange,
        into: memoryview,
        then: Callable[[memoryview], None] | None = None,
    ) -> None:
        """Read ``byte_range`` of version ``head.etag`` into ``into[:length]``, retried;
        ``then(the bytes)`` right after, on the read's thread.

        Raises:
            ObjectChanged: the file is no longer that version (never retried).
            ObjectNotFound, AccessDenied, SourceUnavailable, SourceError
        """
        target = into[: byte_range.length]

        def work() -> After[None] | None:
            opened = _Open(where)
            try:
                opened.check_unchanged(head.etag)
                filled = self._read(opened.fd, target, byte_range.start)
                opened.check_unchanged(head.etag)
            finally:
                opened.close()
            if filled != byte_range.length:
                raise ObjectChanged("the file ended early: it shrank while it was read")
            return After.of(then, target) if then is not None else None

        after = await self._retried(work, f"read {byte_range.http_range}")
        if after is not None:
            after.value()  # what ``then`` raised

    async def _retried(self, work: Callable[[], T], what: str) -> T:
        async def call() -> T:
            try:
                return await self._in_thread(work)
            except Exception as exc:
                raise translate_file_error(exc, what) from exc

        return await with_retries(self._settings, call)

    async def _in_thread(self, work: Callable[[], T]) -> T:
        """Run ``work`` on the read threads; a cancelled read waits for its thread (a read
        cannot be interrupted), so it never writes a slot after this returns."""
        started = self._threads.submit(work)
        try:
            return await asyncio.wrap_future(started)
        except anyio.get_cancelled_exc_class():
            if not started.cancel():  # under way: let it finish first
                with anyio.CancelScope(shield=True):
                    ending = asyncio.wrap_future(started)
                    await asyncio.wait([ending])
                if not ending.cancelled():
                    ending.exception()  # taken: the cancellation is what this raises
            raise
