"""Writing outputs: the ``.npy`` array (streamed, multipart when large) and its JSON sidecar.

For a source ``s3://B/K`` the outputs are ``OUTPUT_URL + B + "/" + K + ".npy"``
and ``... + ".json"`` (docs/output.md); a slide with ``SLIDE_LAYOUT=ome-zarr`` goes
to ``... + ".zarr"`` instead of the ``.npy`` (``ingest.sink.zarr_writer``). The array
arrives as output chunks in order; small arrays are written with one PUT, larger
ones with a multipart upload whose parts (8 MiB, S3 wants at least 5 MiB; larger
only when an output would need more than S3's 10,000 parts) are uploaded while
later chunks are still being processed, ``SINK_PARTS_IN_FLIGHT`` at a time, so the
sink holds at most that many parts plus one of memory per object whatever
its size. The bytes depend only on the source version and the settings, so
writing the same object twice gives the same keys with the same bytes
(idempotent outputs).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

import anyio
import numpy as np

from ingest.dicom.header import DicomHeader
from ingest.errors import ObjectNotFound, SinkError
from ingest.fetch.s3 import S3Source, translate_s3_error
from ingest.retry import with_retries
from ingest.settings import Settings
from ingest.sink.background import BackgroundPuts
from ingest.sink.listing import Page, parse_listing
from ingest.sink.ngff import Origin, zarr_plan, zarr_root
from ingest.sink.zarr_writer import ZarrWriter
from ingest_gpu.formats import OutDtype
from ingest_gpu.preprocess import narrowest_exact

MIN_PART = 8 * 1024 * 1024
S3_MIN_PART = 5 * 1024 * 1024  # S3's smallest part but an upload's last
MAX_PARTS = 10_000  # S3's limit per multipart upload
_MIB = 1024 * 1024
NPY_TYPE = "application/octet-stream"
# Every part says what it holds too, though S3 takes the object's type from the create
# and ignores a part's: SeaweedFS sniffs a request that has none and gzips each chunk
# whose first 128 bytes compress, as CT values do, which cost it more CPU per byte of a
# part (docs/benchmarks.md, "Outputs to S3"). Sent unsigned, as S3 allows.
_PART_HEADERS = {"Content-Type": NPY_TYPE}


def output_part_size(total: int) -> int:
    """Bytes per multipart part for an output of ``total`` bytes: 8 MiB, or the
    smallest whole MiB that keeps the upload within ``MAX_PARTS`` parts."""
    return max(MIN_PART, -(-total // (MAX_PARTS * _MIB)) * _MIB)


def output_dtype(settings: Settings, header: DicomHeader) -> OutDtype:
    """The dtype of one object's output: ``OUTPUT_DTYPE``, or with ``exact`` the narrowest
    that holds this object's values exactly (``ingest_gpu.preprocess.narrowest_exact``).

    Raises:
        RuntimeError: ``exact`` for a header whose per-frame rescale values are not
            read yet (a caller bug: parse it in full first).
    """
    if settings.output_dtype != "exact":
        return settings.output_dtype
    return narrowest_exact(header.pixel, header.transform(settings.window, "float32"))


def writes_zarr(settings: Settings, header: DicomHeader) -> bool:
    """Whether this object's array goes to an OME-Zarr image (a slide, with
    ``SLIDE_LAYOUT=ome-zarr`` and the S3 sink) rather than a ``.npy``."""
    zarr = settings.slide_layout == "ome-zarr" and settings.sink == "s3"
    return zarr and header.slide is not None


def output_key(settings: Settings, header: DicomHeader, npy_key: str) -> str:
    """The key of the object's array output: ``npy_key``, or its image's root."""
    return zarr_root(npy_key) if writes_zarr(settings, header) else npy_key


def output_keys(settings: Settings, bucket: str, key: str) -> tuple[str, str]:
    """The ``.npy`` and ``.json`` keys (in the output bucket) for a source object."""
    base = f"{settings.output_prefix}{bucket}/{key}"
    return base + ".npy", base + ".json"


def sse(settings: Settings) -> tuple[dict[str, str], dict[str, str]]:
    """Server-side encryption of outputs (``output_sse``): the request parameters and the
    headers of every PUT and multipart create (parts inherit it: S3 wants them only
    for SSE-C, which is not offered)."""
    if settings.output_sse == "none":
        return {}, {}
    mode: str = settings.output_sse
    params = {"ServerSideEncryption": mode}
    headers = {"x-amz-server-side-encryption": mode}
    if settings.output_sse_kms_key_id:
        params["SSEKMSKeyId"] = settings.output_sse_kms_key_id
        headers["x-amz-server-side-encryption-aws-kms-key-id"] = settings.output_sse_kms_key_id
    return params, headers


def npy_header(shape: tuple[int, ...], dtype: str) -> bytes:
    """The header of a C-order ``.npy`` file (format 1.0 or 2.0 as NumPy picks)."""
    out = io.BytesIO()
    header: dict[str, Any] = {
        "descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
        "fortran_order": False,
        "shape": shape,
    }
    try:
        np.lib.format.write_array_header_1_0(out, header)
    except ValueError:  # header over 64 KiB: only absurd shapes; v2 lifts the limit
        out = io.BytesIO()
        np.lib.format.write_array_header_2_0(out, header)
    return out.getvalue()


@dataclass(slots=True)
class _Upload:
    upload_id: str | None = None
    parts: list[dict[str, Any]] = field(default_factory=list)


class ArrayWriter:
    """Streams one ``.npy`` object. Use as ``async with sink.array(...) as w: await w.write(..)``.

    On an exception inside the block the multipart upload is aborted, so no
    partial object is ever visible under the output key.
    """

    def __init__(self, sink: OutputSink, key: str, shape: tuple[int, ...], dtype: str) -> None:
        self._sink = sink
        self._key = key
        header = npy_header(shape, dtype)
        self.payload = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        self.total = len(header) + self.payload
        self._pieces: list[memoryview] = [memoryview(header)]  # sent as they are, never joined
        self._buffered = len(header)
        self._written = 0
        self._upload = _Upload()
        self._part_size = output_part_size(self.total)
        self._multipart = self.total > 2 * self._part_size
        self._puts = BackgroundPuts(sink.parts_in_flight)  # the parts: memory in flight

    async def __aenter__(self) -> ArrayWriter:
        if self._multipart:
            await self._puts.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if self._multipart:
            try:
                await self._puts.__aexit__(exc_type, exc, tb)
            except BaseException:
                await self._abort()
                raise
        try:
            if exc is None:
                self._puts.raise_failed()
                await self._finish()
        except BaseException:
            await self._abort()
            raise
        if exc is not None:
            await self._abort()
        return None

    async def write(self, values: np.ndarray | None) -> None:
        """Append output values (any shape, C order, the writer's dtype).

        The writer keeps views of the arrays and sends them as they are (the
        kernel's copy into the socket is the only one); the caller must not
        modify ``values`` afterwards.
        """
        if values is None:
            raise _PermanentSinkError("no host values to write (the device kept them)")
        self._puts.raise_failed()
        data = np.ascontiguousarray(values).reshape(-1).view(np.uint8).data
        if self._written + len(data) > self.payload:
            raise _PermanentSinkError("more output values than the array's shape holds")
        self._pieces.append(data)
        self._buffered += len(data)
        self._written += len(data)
        if self._multipart:
            while self._buffered >= self._part_size:
                await self._start_part(self._take(self._part_size))

    def _take(self, size: int) -> list[memoryview]:
        """The next ``size`` buffered bytes (all of them with ``size=-1``), as views (no copy)."""
        size = self._buffered if size < 0 else size
        views: list[memoryview] = []
        taken = 0
        while taken < size:
            piece = self._pieces[0]
            n = min(len(piece), size - taken)
            views.append(piece[:n])
            taken += n
            if n == len(piece):
                self._pieces.pop(0)
            else:
                self._pieces[0] = piece[n:]
        self._buffered -= size
        return views

    async def _start_part(self, body: list[memoryview]) -> None:
        if self._upload.upload_id is None:
            self._upload.upload_id = await self._sink._create_upload(self._key)
        number = len(self._upload.parts) + 1
        self._upload.parts.append({"PartNumber": number})
        await self._puts.start(functools.partial(self._put_part, number, body))

    async def _put_part(self, number: int, body: list[memoryview]) -> None:
        etag = await self._sink._upload_part(self._key, self._upload.upload_id, number, body)
        self._upload.parts[number - 1]["ETag"] = etag

    async def _finish(self) -> None:
        if self._written != self.payload:
            raise _PermanentSinkError(f"output has {self._written} bytes, expected {self.payload}")
        if not self._multipart:
            await self._sink.put(self._key, self._take(-1), NPY_TYPE)
            return
        if self._buffered:  # the last part may be smaller than the rest
            if self._upload.upload_id is None:
                self._upload.upload_id = await self._sink._create_upload(self._key)
            number = len(self._upload.parts) + 1
            etag = await self._sink._upload_part(
                self._key, self._upload.upload_id, number, self._take(-1)
            )
            self._upload.parts.append({"PartNumber": number, "ETag": etag})
        await self._sink._complete_upload(self._key, self._upload.upload_id, self._upload.parts)

    async def _abort(self) -> None:
        if self._upload.upload_id is not None:
            with anyio.CancelScope(shield=True):
                await self._sink._abort_upload(self._key, self._upload.upload_id)


class PartUpload:
    """One multipart upload of a ``.npy`` whose parts the caller numbers and sends in any
    order (a series volume streamed as its slices arrive, ``ingest.pipeline.series``).
    Nothing is visible under ``key`` until ``complete``; ``abort`` drops the parts."""

    def __init__(self, sink: OutputSink, key: str) -> None:
        self._sink = sink
        self.key = key
        self._upload_id: str | None = None
        self._creating = anyio.Lock()  # parts sent at once create one upload
        self._etags: dict[int, str] = {}

    @property
    def numbers(self) -> list[int]:
        """The parts uploaded so far."""
        return sorted(self._etags)

    async def put(self, number: int, body: list[memoryview]) -> None:
        """Upload part ``number`` (the upload is created with the first part).

        Raises:
            SinkError: the part could not be uploaded.
        """
        async with self._creating:
            if self._upload_id is None:
                self._upload_id = await self._sink._create_upload(self.key)
        etag = await self._sink._upload_part(self.key, self._upload_id, number, body)
        self._etags[number] = etag

    async def complete(self) -> None:
        """Make the object of every part uploaded, in the order of their numbers.

        Raises:
            SinkError: the completion failed.
        """
        parts = [{"PartNumber": n, "ETag": e} for n, e in sorted(self._etags.items())]
        await self._sink._complete_upload(self.key, self._upload_id, parts)

    async def abort(self) -> None:
        """Drop the parts uploaded (none are, or ever were: nothing to do)."""
        if self._upload_id is not None:
            with anyio.CancelScope(shield=True):
                await self._sink._abort_upload(self.key, self._upload_id)


class Writer(Protocol):
    """What ``OutputSink.array`` gives: ``async with`` it, ``write`` the values in order."""

    async def __aenter__(self) -> Writer: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None: ...

    async def write(self, values: np.ndarray | None) -> None: ...


# Given a one-frame output's key, shape and dtype, a writer that keeps its values too
# (series volumes, ``ingest/pipeline/series.py``), or None for the plain writer.
Keeper = Callable[[str, tuple[int, ...], str], Writer | None]


class DiscardWriter:
    """The writer of ``DICOM_INGEST_SINK=none``: arrays stay where they are (a hook has them)."""

    async def __aenter__(self) -> DiscardWriter:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        return None

    async def write(self, values: np.ndarray | None) -> None:
        return None


class OutputSink:
    """Writes outputs to the output bucket: data PUTs through ``S3Source.put_from``
    (threads, presigned, bodies never joined), reads, listings and deletes through
    ``S3Source.request_whole`` (the same threads); the multipart bookkeeping through
    the aiobotocore client."""

    def __init__(self, source: S3Source, settings: Settings) -> None:
        self._source = source
        self._client = source.client
        self.settings = settings
        self.parts_in_flight = settings.sink_parts_in_flight
        self.keep: Keeper | None = None

    def array(
        self, key: str, shape: tuple[int, ...], dtype: str, origin: Origin | None = None
    ) -> Writer:
        """The writer of one object's output values: its ``.npy`` at ``key``, or with
        ``origin`` a slide's OME-Zarr image when ``writes_zarr`` says so; a one-frame
        output's values are also kept when ``keep`` (series volumes) asks for them.

        Raises:
            LayoutRefused: the slide cannot be one OME-Zarr array (the message says why).
        """
        if self.settings.sink == "none":
            return DiscardWriter()
        if origin is not None and writes_zarr(self.settings, origin.header):
            plan = zarr_plan(zarr_root(key), origin, dtype, self.settings.window)
            return ZarrWriter(self, plan, shape, dtype, MIN_PART)
        if self.keep is not None and shape and shape[0] == 1:
            kept = self.keep(key, shape, dtype)
            if kept is not None:
                return kept
        return ArrayWriter(self, key, shape, dtype)

    async def put(self, key: str, body: list[memoryview], content_type: str) -> None:
        """One PUT, retried on transient failures.

        Raises:
            SinkError: the write failed for good.
        """
        params, sse_headers = sse(self.settings)
        url = await self._presign("put_object", Key=key, ContentType=content_type, **params)
        headers = {"Content-Type": content_type, **sse_headers}

        async def call() -> None:
            await self._put(url, headers, body, "put_object")

        await with_retries(self.settings, call)

    async def put_json(self, key: str, document: Mapping[str, Any]) -> None:
        body = json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
        await self.put(key, [memoryview(body)], "application/json")

    async def get(self, key: str, start: int = 0, length: int | None = None) -> bytes | None:
        """An output object's bytes (``length`` of them from ``start``; all by default), or
        None when there is none (series assembly reads its member records and slices back).

        Raises:
            SinkError: the read failed for good.
        """
        url = await self._presign("get_object", Key=key)
        ranged = {"Range": f"bytes={start}-{start + length - 1}"} if length is not None else {}

        async def call() -> bytes | None:
            try:
                return await self._source.request_whole("GET", url, ranged, (200, 206), bytes)
            except Exception as exc:
                if isinstance(translate_s3_error(exc, "get_object"), ObjectNotFound):
                    return None
                raise self._translate(exc, "get_object") from exc

        return await with_retries(self.settings, call)

    async def keys(self, prefix: str) -> list[str]:
        """The output bucket's keys under ``prefix``, in S3's (lexical) order
        (``ingest.sink.listing`` says why the answers are read there).

        Raises:
            SinkError: the listing failed for good, or an answer was not a listing.
        """
        found: list[str] = []
        token: str | None = None
        while True:
            params = {"Prefix": prefix, "EncodingType": "url"}
            if token:
                params["ContinuationToken"] = token
            url = await self._presign("list_objects_v2", **params)

            async def call(url: str = url) -> Page:
                try:
                    return await self._source.request_whole("GET", url, {}, (200,), parse_listing)
                except ValueError as exc:
                    raise _PermanentSinkError(f"list_objects_v2: {exc}") from exc
                except Exception as exc:
                    raise self._translate(exc, "list_objects_v2") from exc

            page = await with_retries(self.settings, call)
            found.extend(page.keys)
            token = page.next_token
            if token is None:
                return found

    async def delete(self, key: str) -> None:
        """Remove an output object (a series' pending marker once its volume is written).

        Raises:
            SinkError: the delete failed for good.
        """
        url = await self._presign("delete_object", Key=key)

        async def call() -> None:
            try:
                await self._source.request_whole("DELETE", url, {}, (200, 204), bytes)
            except Exception as exc:
                raise self._translate(exc, "delete_object") from exc

        await with_retries(self.settings, call)

    async def _create_upload(self, key: str) -> str:
        async def call() -> str:
            resp = await self._call(
                "create_multipart_upload",
                Key=key,
                ContentType=NPY_TYPE,
                **sse(self.settings)[0],
            )
            return str(resp["UploadId"])

        return await with_retries(self.settings, call)

    async def _upload_part(
        self, key: str, upload_id: str | None, number: int, body: list[memoryview]
    ) -> str:
        url = await self._presign("upload_part", Key=key, UploadId=upload_id, PartNumber=number)

        async def call() -> str:
            return await self._put(url, _PART_HEADERS, body, "upload_part")

        return await with_retries(self.settings, call)

    async def _presign(self, operation: str, **params: Any) -> str:
        try:
            return await self._source.presign(
                operation, Bucket=self.settings.output_bucket, **params
            )
        except Exception as exc:
            raise _PermanentSinkError(f"{operation}: {exc}") from exc

    async def _put(
        self, url: str, headers: dict[str, str], body: list[memoryview], operation: str
    ) -> str:
        try:
            etag = await self._source.put_from(url, headers, body)
        except Exception as exc:
            raise self._translate(exc, operation) from exc
        if not etag:
            raise SinkError(f"{operation}: the answer had no ETag")
        return etag

    async def _complete_upload(
        self, key: str, upload_id: str | None, parts: list[dict[str, Any]]
    ) -> None:
        async def call() -> None:
            await self._call(
                "complete_multipart_upload",
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )

        await with_retries(self.settings, call)

    async def _abort_upload(self, key: str, upload_id: str) -> None:
        # What we could not abort, the bucket's lifecycle rule for incomplete uploads reaps.
        with contextlib.suppress(SinkError):
            await self._call("abort_multipart_upload", Key=key, UploadId=upload_id)

    async def _call(self, operation: str, **kwargs: Any) -> Any:
        try:
            with anyio.fail_after(self.settings.read_timeout_s):
                return await getattr(self._client, operation)(
                    Bucket=self.settings.output_bucket, **kwargs
                )
        except Exception as exc:
            raise self._translate(exc, operation) from exc

    @staticmethod
    def _translate(exc: Exception, operation: str) -> SinkError:
        error = translate_s3_error(exc, operation)  # its message names the operation
        if not error.retriable:
            return _PermanentSinkError(str(error))
        return SinkError(str(error))


class _PermanentSinkError(SinkError):
    retriable = False
