"""A bounded local spool for audit messages the audit topic did not take in time.

When the broker does not acknowledge an audit message within
``audit_ack_timeout_s``, the message is written here instead (one file per
message, written to a temporary name, fsynced, renamed: a crash leaves either
the whole message or none) and the record counts as acknowledged, so its
offset may be committed. While the spool holds anything, later messages are
spooled behind it, and a forwarder sends them to the topic oldest first and
deletes each once the broker has acknowledged it, so the topic gets every
trail in order. A worker restarted on the same spool directory forwards what
its predecessor left before anything of its own.

What is spooled is what the topic would get: sealed (AES-256-GCM) records and
digests that hold only hashes, so the spool holds no readable patient data.
Its size is bounded by ``audit_spool_max_bytes``: past ``PAUSE_FRACTION`` of it
the worker stops taking new notifications (``paused``), and a record that does
not fit waits for room (its object's offset stays uncommitted meanwhile).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import anyio

PAUSE_FRACTION = 0.75
_NAME = re.compile(r"^(\d{20})\.msg$")


class Spool:
    """Audit messages waiting for the topic, oldest first, in a directory of their own."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._dir = directory
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
