"""``put-raw``: the outputs' ceiling, a raw parallel PUT of the bytes the S3 sink writes.

For each object of a workload it uploads, to the same server and output bucket as
``ours`` (under ``put-raw/``), what the worker's sink writes for it: the ``.npy``
(``ingest.sink.output.npy_header`` of the object's shape and ``output_dtype``, then
frames x rows x columns x samples values) and its JSON sidecar (``sidecar`` of the
object's parsed header: the real document, within the digits of its digests and
timings). Shapes come from each object's header, read and parsed in ``prepare``
(not timed). Then, as fast as plain threads can (``run``, timed):

- an ``.npy`` the sink uploads in parts (more than two of ``output_part_size``) goes up
  as a multipart upload with the sink's part size and at most ``sink_parts_in_flight``
  of its parts in flight, each part with the ``.npy``'s Content-Type (SeaweedFS gzips
  parts that have none: ``ingest.sink.output``); create and complete through botocore
  (the sink: aiobotocore);
- every other PUT (the other ``.npy``s, every sidecar) is one PUT, all of them at once
  on ``2 x fetch_concurrency`` threads, the number of PUT threads the worker has;
- with ``slide_layout=ome-zarr`` a slide's outputs are what the OME-Zarr writer sends
  (``ingest.sink.zarr_writer``): the three DELETEs of its metadata, then a PUT a tile
  of the chunk's size, at most ``chunks_in_flight`` of them at once as the writer
  bounds them, a sparse slide's empty cells, then the three metadata documents.

Why this is the raw ceiling: the data PUTs go through the sink's own transport,
``ingest.fetch.threaded_http.put_from`` on a ``ConnectionPool`` (keep-alive
``http.client`` connections; the body's pieces sent from memory, never joined;
SigV4 presigned URLs, ``ingest.fetch.sigv4``), from plain threads: no event loop, no
device, no Kafka, no retries, and no ordering between one object's ``.npy`` and
sidecar. botocore's ``put_object`` would be a lower ceiling: a default client spent
3.6-3.8 ms of CPU on a 1 MiB PUT against 0.9 ms here (one thread, SeaweedFS). The
same settings as ``ours`` (``--set``) decide the part size, parts in flight, PUT
threads, ``output_dtype`` and server-side encryption headers.

The values are the object's own: its first frames' output (at most ``SAMPLE_BYTES``),
computed in ``prepare`` by the worker's NumPy twin (``ingest_gpu.preprocess.preprocess_numpy``)
from its stored samples (a compressed object's, a slide's tiles, decoded first as
the worker's CPU path decodes them), and repeated over the rest of a larger array; past
``SAMPLE_BUDGET`` of them in all, objects reuse earlier objects' values. They matter:
SeaweedFS gzips a chunk (of a request naming no Content-Type) whose first 128 bytes
compress, so its cost per byte can depend on the values: a CT slice's values tiled
over the large object's output cost it more CPU per GB than the object's own values.
"""

from __future__ import annotations

import concurrent.futures
import json
import ssl
import struct
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
from botocore.utils import percent_encode
from pydicom.encaps import generate_frames

from ingest.bench.readers import ReaderSkipped
from ingest.bench.workloads import S3Target, Workload
from ingest.dicom.codec import decode_encapsulated
from ingest.dicom.header import DicomHeader
from ingest.dicom.parse import NeedMoreBytes, parse_header
from ingest.fetch.digest import Digests
from ingest.fetch.s3 import ObjectHead
from ingest.fetch.sigv4 import Address, Keys, presigned_url
from ingest.fetch.threaded_http import ConnectionPool, ca_bundle, put_from
from ingest.settings import Settings
from ingest.sink.ngff import CHUNK_TYPE, Origin, ZarrPlan, zarr_plan, zarr_root
from ingest.sink.output import (
    MIN_PART,
    NPY_TYPE,
    npy_header,
    output_dtype,
    output_part_size,
    sse,
    writes_zarr,
)
from ingest.sink.records import Processed, Timings, sidecar
from ingest.sink.zarr_writer import chunks_in_flight
from ingest.source.notifications import ObjectRef
from ingest_gpu.preprocess import preprocess_numpy

PREFIX = "put-raw/"
SAMPLE_BYTES = 64 * 1024 * 1024  # output values computed per object, at most
SAMPLE_BUDGET = 512 * 1024 * 1024  # ... and in all; past it objects reuse earlier ones'
HEADER_PROBE = 64 * 1024  # bytes of an object read first for its header; more if it says so
EXPIRES_S = 3600
JSON_TYPE = "application/json"


@dataclass(frozen=True, slots=True)
class Output:
    """What the sink writes for one source object: its keys, ``.npy`` header and size,
    how it goes up (parts of ``part_size`` or one PUT), and the sidecar's bytes."""

    npy_key: str
    json_key: str
    header: bytes
    total: int
    part_size: int
    multipart: bool
    sidecar: bytes
    values: memoryview  # the first of the array's values (bytes), repeated over the rest
    zarr: ZarrPlan | None = None  # a slide written as OME-Zarr: its chunks instead of the .npy

    def chunk_body(self, frame: int) -> list[memoryview]:
        """Tile ``frame``'s chunk: its size of values, from ``values`` (wrapping round)."""
        assert self.zarr is not None
        size = self.zarr.chunk_bytes
        return self.body(len(self.header) + frame * size, size)

    def parts(self) -> list[tuple[int, int, int]]:
        """(part number, offset, length) of each part of the ``.npy``."""
        return [
            (index + 1, start, min(self.part_size, self.total - start))
            for index, start in enumerate(range(0, self.total, self.part_size))
        ]

    def body(self, offset: int, length: int) -> list[memoryview]:
        """The ``.npy``'s bytes ``[offset, offset + length)`` as views: the header's, then
        values (from ``values``, wrapping round)."""
        pieces: list[memoryview] = []
        if offset < len(self.header):
            pieces.append(memoryview(self.header)[offset : offset + length])
            length -= len(pieces[0])
        at = max(0, offset - len(self.header)) % len(self.values)
        while length > 0:
            pieces.append(self.values[at : at + length])
            length -= len(pieces[-1])
            at = 0
        return pieces


def output_of(
    settings: Settings,
    target: S3Target,
    key: str,
    size: int,
    etag: str,
    header: DicomHeader,
    values: memoryview,
) -> Output:
    """The outputs of source object ``key`` with ``header``, as the sink writes them, its
    array's values taken from ``values`` (repeated)."""
    dtype = output_dtype(settings, header)
    head = npy_header(header.pixel.shape, dtype)
    total = len(head) + int(np.prod(header.pixel.shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    part = output_part_size(total)
    base = f"{PREFIX}{target.source_bucket}/{key}"
    ref = ObjectRef(target.source_bucket, key, size, None, None, None, "ObjectCreated:Put", None)
    done = Processed(
        ref,
        ObjectHead(size, etag, None),
        header,
        Digests(),
        "cpu",
        base + ".npy",
        base + ".json",
        Timings(0.001234, 0.001234, 0.012345, 0.023456),
    )
    plan = None
    if writes_zarr(settings, header):
        origin = Origin(header, target.source_bucket, key, None, etag, size)
        plan = zarr_plan(zarr_root(base + ".npy"), origin, dtype, settings.window)
        done.output_key, done.layout = plan.root, "ome-zarr"
    document = sidecar(done, settings.window, dtype)
    body = json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
    multipart = total > 2 * part and plan is None
    return Output(base + ".npy", base + ".json", head, total, part, multipart, body, values, plan)


class PutRawReader:
    """The raw PUT ceiling of ``ours`` (the S3 sink) on a workload's objects."""

    name = "put-raw"

    def __init__(self, target: S3Target, settings: Settings) -> None:
        self._target, self._settings = target, settings
        self._threads = 2 * settings.fetch_concurrency  # the worker's PUT threads
        self._keys = Keys(target.access_key, target.secret_key)
        self._sse_params, self._sse_headers = sse(settings)
        self._pool = ConnectionPool(10.0, 120.0, ssl.create_default_context(cafile=ca_bundle(None)))
        self._client: Any = None
        self._puts: concurrent.futures.ThreadPoolExecutor | None = None
        self._outputs: list[Output] = []

    def prepare(self, workload: Workload) -> None:
        """Read each object's header (its output's shape) and first frames (its values).

        Raises:
            ReaderSkipped: a compressed object (its values would need decoding).
            botocore.exceptions.ClientError: a GET failed.
            IngestError: an object's header cannot be parsed as the worker parses it.
        """
        self._client = self._target.client(pool=self._threads)
        self._outputs = []
        samples: list[memoryview] = []
        spent = 0
        for obj in workload.objects:
            header, etag = self._header(obj.key, obj.size)
            if spent < SAMPLE_BUDGET or not samples:
                if header.codec is not None:
                    samples.append(self._decoded_values(obj.key, obj.size, header))
                else:
                    samples.append(self._values(obj.key, header))
                spent += len(samples[-1])
            values = samples[len(self._outputs) % len(samples)]
            out = output_of(self._settings, self._target, obj.key, obj.size, etag, header, values)
            self._outputs.append(out)
        self._puts = concurrent.futures.ThreadPoolExecutor(self._threads, "put-raw")

    def _get(self, key: str, start: int, length: int) -> tuple[bytes, str]:
        answer = self._client.get_object(
            Bucket=self._target.source_bucket, Key=key, Range=f"bytes={start}-{start + length - 1}"
        )
        return answer["Body"].read(), str(answer.get("ETag", "")).strip('"')

    def _header(self, key: str, size: int) -> tuple[DicomHeader, str]:
        want = min(size, HEADER_PROBE)
        while True:
            data, etag = self._get(key, 0, want)
            parsed = parse_header(data, size, max_header_bytes=self._settings.max_header_bytes)
            if not isinstance(parsed, NeedMoreBytes):
                return parsed, etag
            want = min(size, max(parsed.at_least, 2 * want))

    def _values(self, key: str, header: DicomHeader) -> memoryview:
        """The output values of the object's first frames (``SAMPLE_BYTES`` at most), as
        the worker's CPU twin computes them."""
        fmt = header.pixel
        dtype = output_dtype(self._settings, header)
        out_frame = fmt.frame_elements * np.dtype(dtype).itemsize
        frames = max(1, min(fmt.frames, SAMPLE_BYTES // out_frame))
        pitch = header.frame_pitch or fmt.frame_bytes  # encapsulated: an item header a frame
        data, _ = self._get(key, header.pixel_offset, (frames - 1) * pitch + fmt.frame_bytes)
        stored = np.frombuffer(data + bytes(pitch - fmt.frame_bytes), np.uint8)
        raw = stored.reshape(frames, pitch)[:, : fmt.frame_bytes].reshape(-1)
        transform = header.transform(self._settings.window, dtype)
        return preprocess_numpy(raw, fmt, transform, 0).view(np.uint8).data

    def _decoded_values(self, key: str, size: int, header: DicomHeader) -> memoryview:
        """The output values of a compressed object's first frames (a slide's tiles), decoded
        as the worker's CPU path decodes them: the frames in the first ``SAMPLE_BYTES`` of
        its Pixel Data (at least one)."""
        codec = header.codec
        assert codec is not None
        fmt = header.pixel
        dtype = output_dtype(self._settings, header)
        length = min(size - header.pixel_offset, max(SAMPLE_BYTES // 8, HEADER_PROBE))
        data, _ = self._get(key, header.pixel_offset, length)
        frames: list[bytes] = []
        try:
            for frame in generate_frames(data, number_of_frames=fmt.frames):
                frames.append(frame)
                if (len(frames) + 1) * fmt.frame_elements * np.dtype(dtype).itemsize > SAMPLE_BYTES:
                    break
        except (ValueError, IndexError, struct.error):  # the prefix ends inside a fragment
            pass
        if not frames:
            raise ReaderSkipped(f"{key}: no whole frame in its first {length} bytes", "frames")
        decoded = decode_encapsulated(codec, frames)
        raw = np.ascontiguousarray(decoded).reshape(-1).view(np.uint8)
        transform = header.transform(self._settings.window, dtype)
        return preprocess_numpy(raw, fmt, transform, 0).view(np.uint8).data

    def _url(self, key: str, query: list[tuple[str, str]], headers: dict[str, str]) -> str:
        t = self._target
        quoted = percent_encode(key, safe="/~")
        address = Address.of(f"{t.endpoint_url.rstrip('/')}/{t.output_bucket}/{quoted}")
        now = datetime.now(UTC)
        return presigned_url(
            "PUT", address, query, headers, self._keys, t.region, "s3", EXPIRES_S, now
        )

    def _put(self, key: str, body: list[memoryview], content_type: str) -> int:
        headers = {"Content-Type": content_type, **self._sse_headers}
        put_from(self._pool, self._url(key, [], headers), headers, body)
        return sum(map(len, body))

    def _part(self, key: str, upload_id: str, number: int, body: list[memoryview]) -> str:
        query = [("partNumber", str(number)), ("uploadId", upload_id)]
        return put_from(self._pool, self._url(key, query, {}), {"Content-Type": NPY_TYPE}, body)

    def _multipart(self, out: Output) -> int:
        """One ``.npy`` in parts, ``sink_parts_in_flight`` at a time on the PUT threads."""
        assert self._puts is not None
        bucket = self._target.output_bucket
        created = self._client.create_multipart_upload(
            Bucket=bucket, Key=out.npy_key, ContentType=NPY_TYPE, **self._sse_params
        )
        upload_id = created["UploadId"]
        room = threading.Semaphore(self._settings.sink_parts_in_flight)
        sent: list[tuple[int, concurrent.futures.Future[str]]] = []
        try:
            for number, offset, length in out.parts():
                room.acquire()
                body = out.body(offset, length)
                future = self._puts.submit(self._part, out.npy_key, upload_id, number, body)
                future.add_done_callback(lambda _: room.release())
                sent.append((number, future))
            parts = [{"PartNumber": n, "ETag": f.result()} for n, f in sent]
            self._client.complete_multipart_upload(
                Bucket=bucket,
                Key=out.npy_key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
        except BaseException:
            concurrent.futures.wait([f for _, f in sent])
            self._client.abort_multipart_upload(Bucket=bucket, Key=out.npy_key, UploadId=upload_id)
            raise
        return out.total

    def _zarr(self, out: Output) -> int:
        """One slide's OME-Zarr image, as ``ingest.sink.zarr_writer`` sends it."""
        puts, plan = self._puts, out.zarr
        assert puts is not None
        assert plan is not None
        for key in plan.metadata_keys_to_clear():
            self._client.delete_object(Bucket=self._target.output_bucket, Key=key)
        room = threading.Semaphore(
            chunks_in_flight(self._settings.sink_parts_in_flight, MIN_PART, plan.chunk_bytes)
        )
        sent: list[concurrent.futures.Future[int]] = []

        def start(key: str, body: list[memoryview]) -> None:
            room.acquire()
            future = puts.submit(self._put, key, body, CHUNK_TYPE)
            future.add_done_callback(lambda _: room.release())
            sent.append(future)

        for frame in range(plan.frames):
            start(plan.chunk_key(plan.cell(frame)), out.chunk_body(frame))
        fill = [memoryview(plan.fill_chunk())]
        for cell in plan.empty_cells():
            start(plan.chunk_key(cell), fill)
        total = sum(f.result() for f in sent)
        for key, document in plan.metadata():
            body = json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
            total += self._put(key, [memoryview(body)], JSON_TYPE)
        return total

    def run(self, workload: Workload) -> dict[str, Any]:
        """Every output PUT once; returns the bytes and requests sent.

        Raises:
            HttpStatusError, OSError: a PUT failed.
            botocore.exceptions.ClientError: a multipart create or complete failed.
        """
        assert self._puts is not None
        large = [o for o in self._outputs if o.multipart]
        images = [o for o in self._outputs if o.zarr is not None]
        futures: list[concurrent.futures.Future[int]] = []
        drivers_count = max(1, len(large) + len(images))
        with concurrent.futures.ThreadPoolExecutor(drivers_count, "put-raw-mp") as drivers:
            futures += [drivers.submit(self._multipart, o) for o in large]
            futures += [drivers.submit(self._zarr, o) for o in images]
            for out in self._outputs:
                if not out.multipart and out.zarr is None:
                    body = out.body(0, out.total)
                    futures.append(self._puts.submit(self._put, out.npy_key, body, NPY_TYPE))
                body = [memoryview(out.sidecar)]
                futures.append(self._puts.submit(self._put, out.json_key, body, JSON_TYPE))
            sent = sum(f.result() for f in futures)
        parts = sum(len(o.parts()) for o in large)
        chunks = sum(o.zarr.frames + len(list(o.zarr.empty_cells())) for o in images if o.zarr)
        return {
            "zarr_images": len(images),
            "zarr_chunks": chunks,
            "output_bytes": sent,
            "npy_bytes": sum(o.total for o in self._outputs),
            "single_puts": 2 * len(self._outputs) - len(large),
            "multipart_objects": len(large),
            "parts": parts,
            "part_size": max((o.part_size for o in large), default=0),
            "parts_in_flight": self._settings.sink_parts_in_flight,
            "put_threads": self._threads,
            "connections_opened": self._pool.opened,
        }

    def close(self) -> None:
        if self._puts is not None:
            self._puts.shutdown()
        self._pool.close()
        if self._client is not None:
            self._client.close()
