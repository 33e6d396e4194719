"""The reference readers the worker is compared with, all on the same objects.

Ceilings (raw reads, no processing):

- ``curl``: a process per byte range (``curl -r A-B -o /dev/null`` signed with
  ``--aws-sigv4``), ``concurrency`` at a time. Credentials reach curl on its
  standard input (``-K -``), never on its command line.
- ``threads``: ``concurrency`` Python threads, each with its own keep-alive
  ``http.client`` connection, reading ranges with ``readinto`` straight into
  one preallocated buffer (SigV4 headers from botocore's ``S3SigV4Auth``).
- ``kvikio-raw`` (GPU machine): ``gpu``-side, see ``gpu``.

The naive path (what users write today): for each object, download it to a
file with botocore, ``pydicom.dcmread`` the file, ``pixel_array``, the Modality
LUT in NumPy (per frame where the functional groups say so), cast to float32,
and on the GPU machine ``cupy.asarray``. Objects go ``concurrency`` at a time
in threads; one object is one stream (no ranged parallelism).

Every reader has ``prepare`` (not timed: buffers, pools), ``run`` (timed, may
be repeated; returns extra figures) and ``close``.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol
from urllib.parse import urlparse

import numpy as np

from ingest.bench.measure import MiB
from ingest.bench.workloads import S3Target, Workload
from ingest.dicom.fragments import ENCAPSULATED_UNCOMPRESSED


class ReaderSkipped(Exception):
    """Raised by ``prepare``: the reader cannot run on this workload here (no decoder for
    its syntax); the run is reported as skipped with the message and ``short``."""

    def __init__(self, message: str, short: str) -> None:
        super().__init__(message)
        self.short = short


class Reader(Protocol):
    name: str

    def prepare(self, workload: Workload) -> None: ...

    def run(self, workload: Workload) -> dict[str, Any]: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class RangeJob:
    key: str
    start: int
    length: int
    dest: int  # offset in the one buffer that holds the whole workload


def plan_ranges(workload: Workload, part: int) -> list[RangeJob]:
    """Every object cut into ``part``-byte ranges, with its place in one workload buffer."""
    jobs: list[RangeJob] = []
    dest = 0
    for obj in workload.objects:
        for start in range(0, obj.size, part):
            jobs.append(RangeJob(obj.key, start, min(part, obj.size - start), dest + start))
        dest += obj.size
    return jobs


def curl_missing() -> str | None:
    return None if shutil.which("curl") else "curl is not on PATH"


class CurlReader:
    """Ceiling (a): a curl process per range, ``concurrency`` at a time, body to /dev/null."""

    name = "curl"

    def __init__(self, target: S3Target, part: int, concurrency: int) -> None:
        self._target, self._part, self._concurrency = target, part, concurrency
        self._config = f'user = "{target.access_key}:{target.secret_key}"\n'

    def prepare(self, workload: Workload) -> None:
        pass

    def _one(self, job: RangeJob) -> None:
        argv = [
            "curl",
            "-s",
            "-S",
            "-f",
            "-r",
            f"{job.start}-{job.start + job.length - 1}",
            "-o",
            os.devnull,
            "-w",
            "%{size_download}",
            "--aws-sigv4",
            f"aws:amz:{self._target.region}:s3",
            "-K",
            "-",
            self._target.url(job.key),
        ]
        done = subprocess.run(argv, input=self._config, capture_output=True, text=True, check=False)
        if done.returncode != 0 or int(float(done.stdout or 0)) != job.length:
            raise RuntimeError(
                f"curl range of {job.key}: exit {done.returncode}, got {done.stdout!r} bytes "
                f"of {job.length}: {done.stderr.strip()[:200]}"
            )

    def run(self, workload: Workload) -> dict[str, Any]:
        jobs = plan_ranges(workload, self._part)
        with concurrent.futures.ThreadPoolExecutor(self._concurrency) as pool:
            list(pool.map(self._one, jobs))
        return {"requests": len(jobs)}

    def close(self) -> None:
        pass


class ThreadsReader:
    """Ceiling (b): threads with ``http.client`` ``readinto`` straight into one buffer."""

    name = "threads"

    def __init__(self, target: S3Target, part: int, concurrency: int) -> None:
        from botocore.auth import S3SigV4Auth
        from botocore.credentials import Credentials

        self._target, self._part, self._concurrency = target, part, concurrency
        credentials = Credentials(target.access_key, target.secret_key)
        self._auth = S3SigV4Auth(credentials, "s3", target.region)
        url = urlparse(target.endpoint_url)
        self._host, self._port = url.hostname or "127.0.0.1", url.port or 80
        self._local = threading.local()
        self._connections: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._buffer: np.ndarray | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def prepare(self, workload: Workload) -> None:
        self._buffer = np.zeros(workload.bytes, dtype=np.uint8)  # touched: no faults when timed
        self._pool = concurrent.futures.ThreadPoolExecutor(self._concurrency)

    def _connection(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=120)
            self._local.conn = conn
            with self._lock:
                self._connections.append(conn)
        return conn

    def _headers(self, key: str, start: int, length: int) -> dict[str, str]:
        from botocore.awsrequest import AWSRequest

        request = AWSRequest(
            method="GET",
            url=self._target.url(key),
            headers={"Range": f"bytes={start}-{start + length - 1}"},
        )
        self._auth.add_auth(request)
        return dict(request.headers.items())

    def _one(self, job: RangeJob) -> None:
        assert self._buffer is not None
        headers = self._headers(job.key, job.start, job.length)
        path = urlparse(self._target.url(job.key)).path
        conn = self._connection()
        try:
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException):
            conn.close()  # a stale keep-alive connection: one fresh try
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
        if resp.status not in (200, 206):
            body = resp.read()[:200]
            raise RuntimeError(f"GET {job.key} range: HTTP {resp.status}: {body!r}")
        view = self._buffer[job.dest : job.dest + job.length].data
        filled = 0
        while filled < job.length:
            got = resp.readinto(view[filled:])
            if not got:
                raise RuntimeError(f"GET {job.key}: body ended at {filled} of {job.length}")
            filled += got
        if resp.read(1):
            raise RuntimeError(f"GET {job.key}: body longer than the range")

    def run(self, workload: Workload) -> dict[str, Any]:
        assert self._pool is not None
        jobs = plan_ranges(workload, self._part)
        list(self._pool.map(self._one, jobs))
        return {"requests": len(jobs)}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        for conn in self._connections:
            conn.close()
        self._buffer = None


def frame_rescale(ds: Any) -> list[tuple[float, float]] | None:
    """(slope, intercept) per frame from the functional groups, or None (use pydicom's LUT)."""
    shared_groups = ds.get("SharedFunctionalGroupsSequence") or []
    shared = None
    if shared_groups and shared_groups[0].get("PixelValueTransformationSequence"):
        shared = shared_groups[0].PixelValueTransformationSequence[0]
    own = [
        g.PixelValueTransformationSequence[0] if g.get("PixelValueTransformationSequence") else None
        for g in ds.get("PerFrameFunctionalGroupsSequence") or []
    ]
    if any(item is not None for item in own):
        items = [item if item is not None else shared for item in own]
    elif shared is not None:
        items = [shared] * int(ds.get("NumberOfFrames") or 1)
    else:
        return None
    if any(item is None for item in items):
        raise ValueError("a frame has no Pixel Value Transformation")
    return [(float(i.RescaleSlope), float(i.RescaleIntercept)) for i in items if i is not None]


def _as_native(ds: Any) -> None:
    """Encapsulated Uncompressed frames (one fragment each) as native Pixel Data."""
    from pydicom.encaps import generate_frames
    from pydicom.uid import ExplicitVRLittleEndian

    frames = int(ds.get("NumberOfFrames") or 1)
    samples = int(ds.Rows) * int(ds.Columns) * int(ds.SamplesPerPixel)
    frame_bytes = samples * int(ds.BitsAllocated) // 8
    offsets = None
    if ds.get("ExtendedOffsetTable") is not None:
        offsets = (
            list(np.frombuffer(ds.ExtendedOffsetTable, "<u8")),
            list(np.frombuffer(ds.ExtendedOffsetTableLengths, "<u8")),
        )
    pieces = generate_frames(ds.PixelData, number_of_frames=frames, extended_offsets=offsets)
    ds.PixelData = b"".join(piece[:frame_bytes] for piece in pieces)
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian


def naive_values(source: str | BinaryIO) -> np.ndarray:
    """dcmread, pixel_array, Modality LUT (float64), cast to float32: the plain way.

    Colour has no Modality LUT: RGB (pydicom converts YCbCr) is cast as it is, and
    PALETTE COLOR goes through its palette first.
    """
    from pydicom import dcmread
    from pydicom.pixels.processing import apply_color_lut, apply_modality_lut

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # odd-but-readable objects; not the point here
        ds = dcmread(source)
        if ds.file_meta.TransferSyntaxUID == ENCAPSULATED_UNCOMPRESSED:
            _as_native(ds)  # pydicom 3.0 has no decoder for it
        arr = ds.pixel_array
    if ds.get("PhotometricInterpretation") == "PALETTE COLOR":
        return np.asarray(apply_color_lut(arr, ds), dtype=np.float32)
    if int(ds.get("SamplesPerPixel") or 1) > 1:
        return arr.astype(np.float32)
    arr = arr.reshape(-1, int(ds.Rows), int(ds.Columns))
    per_frame = frame_rescale(ds)
    if per_frame is None:
        values: np.ndarray = apply_modality_lut(arr, ds)
    else:
        values = np.empty(arr.shape, dtype=np.float64)
        for index, (slope, intercept) in enumerate(per_frame):
            values[index] = arr[index] * slope
            values[index] += intercept
    return values.astype(np.float32)


class NaiveReader:
    """Download to a file, dcmread, NumPy, (cupy.asarray): ``concurrency`` objects at a time."""

    name = "naive"

    def __init__(
        self,
        target: S3Target,
        concurrency: int,
        to_device: Callable[[np.ndarray], None] | None,
    ) -> None:
        self._target, self._concurrency, self._to_device = target, concurrency, to_device
        self._client: Any = None
        self._dir: Path | None = None

    def prepare(self, workload: Workload) -> None:
        self._client = self._target.client(pool=self._concurrency)
        self._dir = Path(tempfile.mkdtemp(prefix="dicom-ingest-bench-naive-"))

    def _one(self, key: str) -> int:
        assert self._dir is not None
        fd, path = tempfile.mkstemp(dir=self._dir, suffix=".dcm")
        try:
            with os.fdopen(fd, "wb") as file:
                body = self._client.get_object(Bucket=self._target.source_bucket, Key=key)["Body"]
                for chunk in body.iter_chunks(MiB):
                    file.write(chunk)
                body.close()
            values = naive_values(path)
            if self._to_device is not None:
                self._to_device(values)
            return int(values.nbytes)
        finally:
            os.unlink(path)

    def run(self, workload: Workload) -> dict[str, Any]:
        keys = [o.key for o in workload.objects]
        threads = min(self._concurrency, len(keys))
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            out = sum(pool.map(self._one, keys))
        return {"output_bytes": out, "threads": threads, "device": self._to_device is not None}

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
