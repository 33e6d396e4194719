"""The object sources a worker reads from, chosen by a notification's format: S3 objects
through ``S3Source``, files under ``file_roots`` through ``FileSource``.

The pipeline asks for an object with ``locate(ref)`` and reads it with what that
returned, as it would from one source: ``read_first_then`` and ``read_into`` go to the
source the location belongs to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ingest.errors import AccessDenied
from ingest.fetch.files import FileLocation, FileSource
from ingest.fetch.planning import ByteRange
from ingest.fetch.s3 import ObjectHead, Presigned, S3Source
from ingest.source.notifications import FILE_FORMAT, ObjectRef

T = TypeVar("T")
Location = Presigned | FileLocation


class Sources:
    """S3 and, with ``file_roots`` set, the file system; neither is closed here."""

    def __init__(self, s3: S3Source, files: FileSource | None = None) -> None:
        self.s3 = s3
        self.files = files

    @property
    def client(self) -> Any:
        """The S3 client (health checks)."""
        return self.s3.client

    @property
    def connections_opened(self) -> int:
        return self.s3.connections_opened

    async def locate(self, ref: ObjectRef) -> Location:
        """Where ``ref``'s bytes are: a presigned URL, or a file under a root.

        Raises:
            AccessDenied: a file while no file roots are configured.
            SourceError: the S3 URL could not be signed.
        """
        if ref.format == FILE_FORMAT:
            if self.files is None:
                raise AccessDenied("a file:// object, and no file roots are configured")
            return await self.files.locate(ref.bucket, ref.key, ref.version_id)
        return await self.s3.locate(ref.bucket, ref.key, ref.version_id)

    async def read_first_then(
        self, where: Location, into: memoryview, then: Callable[[memoryview], T] | None
    ) -> tuple[ObjectHead, int, T | None]:
        """``S3Source.read_first_then`` or ``FileSource.read_first_then``, by ``where``."""
        if isinstance(where, FileLocation):
            assert self.files is not None
            return await self.files.read_first_then(where, into, then)
        return await self.s3.read_first_then(where, into, then)

    async def read_into(
        self,
        where: Location,
        head: ObjectHead,
        byte_range: ByteRange,
        into: memoryview,
        then: Callable[[memoryview], None] | None = None,
    ) -> None:
        """``S3Source.read_into`` or ``FileSource.read_into``, by ``where``."""
        if isinstance(where, FileLocation):
            assert self.files is not None
            await self.files.read_into(where, head, byte_range, into, then)
            return
        await self.s3.read_into(where, head, byte_range, into, then)
