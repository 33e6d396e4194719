"""A bounded local spool for audit messages the audit topic did not take in time.

When the broker does not acknowledge an audit message within
``audit_ack_timeout_s``, the message is written here instead (one file per
message, written to a temporary name, fsynced, renamed: a crash leaves either
the whole message or none) and the record counts as acknowledged, so its
offset may be committed. While the spool holds anything, later messages are
spooled behind it, and a forwarder sends them to the topic oldest first and
deletes each once the broker has acknowledged it, so the topic gets every
trail in order. A worker restarted with the same worker id forwards what its
predecessor left before anything of its own; and every worker forwards the
spools under ``AUDIT_SPOOL_DIR`` that no running process holds (``orphans``:
those of a worker id that is gone, such as a former ``host-PID`` one), oldest
first, so no acknowledged record stays behind whatever the worker id. A running
spool is held with an exclusive ``flock`` on its ``.lock`` file, so a second
process with the same worker id is refused at start, and spools held by
running workers are left alone.

The spool directory and its parent are the worker's own, mode 700 (a looser mode
found there is tightened; one owned by another user is refused), and each file
is mode 600. The spool of a worker id also keeps ``trail.json``, where its
current trail got to (``TrailState``): the next trail of the worker id names it
as its predecessor (``digest.Previous``).

What is spooled is what the topic would get: sealed (AES-256-GCM) records and
digests that hold only hashes, so the spool holds no readable patient data.
Its size is bounded by ``audit_spool_max_bytes``: past ``PAUSE_FRACTION`` of it
the worker stops taking new notifications (``paused``), and a record that does
not fit waits for room (its object's offset stays uncommitted meanwhile).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import stat
from pathlib import Path

import anyio
import structlog

from ingest.audit.digest import Previous
from ingest.errors import ConfigError

log = structlog.get_logger("dicom_ingest.audit")
PAUSE_FRACTION = 0.75
_NAME = re.compile(r"^(\d{20})\.msg$")


class Spool:
    """Audit messages waiting for the topic, oldest first, in a directory of their own."""

    def __init__(self, directory: Path, max_bytes: int, *, lock: bool = True) -> None:
        private_dir(directory.parent)
        private_dir(directory)
        self._dir = directory
        self._lock: int | None = hold(directory) if lock else None  # a descriptor
        self._max = max_bytes
        self._files: list[tuple[int, int]] = []  # (number, size), oldest first
        for entry in sorted(directory.iterdir()):
            match = _NAME.match(entry.name)
            if match:
                self._files.append((int(match.group(1)), entry.stat().st_size))
            elif entry.name.endswith(".tmp"):
                # A write a crash cut short: its record was never acknowledged.
                entry.unlink()
        self._next = self._files[-1][0] + 1 if self._files else 0
        self._bytes = sum(size for _, size in self._files)
        self._room = anyio.Event()  # set by drop_oldest: an append that waits may fit now
        self._added = anyio.Event()  # set by append: the forwarder has something to send

    def __len__(self) -> int:
        return len(self._files)

    @property
    def name(self) -> str:
        """The worker id whose spool this is (its directory's name)."""
        return self._dir.name

    def let_go(self) -> None:
        """Let another process take this spool (its lock is dropped)."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    @property
    def size(self) -> int:
        return self._bytes

    @property
    def paused(self) -> bool:
        """Intake should stop: the spool is past ``PAUSE_FRACTION`` of its bound."""
        return self._bytes >= PAUSE_FRACTION * self._max

    async def append(self, message: bytes) -> None:
        """Store ``message`` durably behind the others; waits while it does not fit.

        Raises:
            OSError: the disk refused (full, read-only): the record is not acknowledged.
        """
        while self._files and self._bytes + len(message) > self._max:
            if self._room.is_set():  # a new one only once set: a waiter never misses a drop
                self._room = anyio.Event()
            await self._room.wait()
        number = self._next
        self._next += 1
        await anyio.to_thread.run_sync(self._write, number, message)
        self._files.append((number, len(message)))
        self._bytes += len(message)
        self._added.set()

    def _write(self, number: int, message: bytes) -> None:
        final = self._dir / f"{number:020d}.msg"
        tmp = final.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, message)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        dir_fd = os.open(self._dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a power cut
        finally:
            os.close(dir_fd)

    def oldest(self) -> bytes | None:
        """The message to forward next (None when the spool is empty)."""
        if not self._files:
            return None
        return (self._dir / f"{self._files[0][0]:020d}.msg").read_bytes()

    async def next_to_forward(self) -> bytes:
        """The oldest message, once there is one. Every ``append`` wakes this itself: an
        append that began while the spool held messages may end after the forwarder
        emptied it, and a wake-up left to the appender's caller was lost there (the
        forwarder slept while the spool filled up and the worker paused for good)."""
        while not self._files:
            if self._added.is_set():
                self._added = anyio.Event()
            await self._added.wait()
        message = self.oldest()
        assert message is not None
        return message

    def drop_oldest(self) -> None:
        """The oldest message was acknowledged by the topic: forget it."""
        number, size = self._files.pop(0)
        (self._dir / f"{number:020d}.msg").unlink(missing_ok=True)
        self._bytes -= size
        self._room.set()


def private_dir(path: Path) -> None:
    """Create ``path`` mode 700, or tighten it to 700 when it is ours and looser.

    Raises:
        ConfigError: it belongs to another user, or is no directory.
    """
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise ConfigError(f"DICOM_INGEST_AUDIT_SPOOL_DIR: {path} is no directory of this user")
    if st.st_mode & 0o077:
        path.chmod(0o700)


def hold(directory: Path) -> int:
    """An exclusive lock on the spool ``directory`` until ``Spool.let_go`` or the process
    ends (the kernel drops it then, however the process ended): its file descriptor.

    Raises:
        ConfigError: another running process holds it (the same worker id twice).
    """
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(
            f"DICOM_INGEST_WORKER_ID: the spool {directory} is held by a running process "
            "(two workers with one worker id)"
        ) from None
    return fd


def orphans(root: Path, mine: str, max_bytes: int) -> list[Spool]:
    """The spools under ``root`` other than ``mine`` that hold messages and no running
    process holds, oldest message first (each is then held by this process)."""
    found: list[tuple[float, Spool]] = []
    for entry in sorted(root.iterdir()) if root.is_dir() else ():
        if entry.name == mine or not entry.is_dir() or entry.is_symlink():
            continue
        files = sorted(f for f in entry.iterdir() if _NAME.match(f.name))
        if not files:
            continue
        try:
            spool = Spool(entry, max_bytes)
        except ConfigError:
            continue  # a running worker's
        found.append((files[0].stat().st_mtime, spool))
    return [spool for _, spool in sorted(found, key=lambda pair: pair[0])]


class TrailState:
    """``trail.json`` of a worker id's spool: how far its current trail was acknowledged."""

    def __init__(self, directory: Path) -> None:
        self._path = directory / "trail.json"

    def previous(self) -> Previous:
        """What the last trail of this worker id left (an empty ``Previous`` for none, or
        for a file a crash left unreadable: the trail then starts a new chain, which
        ``audit verify`` reports, rather than the worker not starting)."""
        try:
            data = json.loads(self._path.read_text())
            return Previous(
                str(data["trail"]), str(data["digest"]), int(data["seq"]), str(data["head"])
            )
        except FileNotFoundError:
            return Previous()
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("audit trail state unreadable; a new chain", error=type(exc).__name__)
            return Previous()

    def save(self, now: Previous) -> None:
        """Record where the current trail got to (written aside, then renamed)."""
        tmp = self._path.with_name(f".trail.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(
                {"trail": now.trail, "digest": now.digest, "seq": now.seq, "head": now.head}, out
            )
        os.replace(tmp, self._path)
