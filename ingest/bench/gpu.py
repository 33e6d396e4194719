"""The GPU side of the benchmark: KvikIO readers, the naive path's copy, the pinned-copy reference.

Everything here is skipped, with the reason recorded, where CuPy sees no CUDA
device or KvikIO is not installed; nothing is imported at module import time.

- ``kvikio-raw`` (a ceiling): ``kvikio.RemoteFile.open_s3`` per object (size
  given, so no HEAD), ``pread`` straight into one device buffer that holds the
  workload, KvikIO's thread pool set to ``concurrency`` threads and
  ``part``-byte tasks.
- ``kvikio``: the same reads, then per object the header is parsed from a
  device-to-host copy of its prefix (``ingest.dicom.parse.parse_header``) and the
  Pixel Data is preprocessed on the device with ``ingest_gpu.preprocess.preprocess_cupy``
  (the same kernel as ours). Results stay on the device, as a user hook would
  take them.
- ``pinned_copy_rate``: a plain ``cudaMemcpyAsync`` from one pinned host buffer
  to the device, repeated on a non-blocking stream, timed with CUDA events.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any

import numpy as np

from ingest.bench.workloads import S3Target, Workload

MAX_READS_IN_FLIGHT = 64
HEADER_PREFIX = 64 * 1024  # grown while the parser asks for more


def gpu_name() -> str | None:
    """The first CUDA device's name, or None without a usable CUDA device."""
    from ingest_gpu.thread import cuda_unavailable_reason

    if cuda_unavailable_reason() is not None:
        return None
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props.get("name", b"")
    return name.decode() if isinstance(name, bytes) else str(name)


def cuda_missing() -> str | None:
    from ingest_gpu.thread import cuda_unavailable_reason

    return cuda_unavailable_reason()


def kvikio_missing() -> str | None:
    """None when KvikIO's RemoteFile can be used, else why not."""
    why = cuda_missing()
    if why is not None:
        return why
    try:
        import kvikio
        from kvikio.remote_file import is_remote_file_available
    except Exception as exc:  # ImportError, or a wheel that does not match the CUDA install
        return f"kvikio cannot be imported ({type(exc).__name__}: {exc})"
    if not is_remote_file_available():
        return f"kvikio {kvikio.__version__} was built without remote (libcurl) support"
    return None


def to_device(values: np.ndarray) -> None:
    """The naive path's last step: ``cupy.asarray`` (pageable copy), then wait for it."""
    import cupy

    device = cupy.asarray(values)
    cupy.cuda.get_current_stream().synchronize()
    del device


def configure_kvikio(part: int, threads: int) -> dict[str, Any]:
    """Thread pool size and task size, by the API this KvikIO version has."""
    os.environ.setdefault("KVIKIO_NTHREADS", str(threads))
    os.environ.setdefault("KVIKIO_TASK_SIZE", str(part))
    import kvikio
    import kvikio.defaults

    try:  # one key at a time: some keys may not be set together in a dict
        kvikio.defaults.set("num_threads", threads)
        kvikio.defaults.set("task_size", part)
    except (AttributeError, TypeError, ValueError):
        reset_threads = getattr(kvikio.defaults, "num_threads_reset", None)
        reset_task = getattr(kvikio.defaults, "task_size_reset", None)
        if reset_threads is not None and reset_task is not None:
            reset_threads(threads)
            reset_task(part)
    settings: dict[str, Any] = {"version": kvikio.__version__}
    for name in ("num_threads", "task_size", "compat_mode", "remote_io_backend"):
        try:
            settings[name] = str(kvikio.defaults.get(name))
        except Exception:  # older versions name these differently; informative only
            continue
    return settings


class KvikioReader:
    """KvikIO ``RemoteFile`` into GPU memory; with ``preprocess`` also our kernel."""

    def __init__(self, target: S3Target, part: int, concurrency: int, preprocess: bool) -> None:
        self.name = "kvikio" if preprocess else "kvikio-raw"
        self._target, self._part, self._threads = target, part, concurrency
        self._preprocess = preprocess
        self._device: Any = None
        self._settings: dict[str, Any] = {}

    def prepare(self, workload: Workload) -> None:
        import cupy

        self._settings = configure_kvikio(self._part, self._threads)
        self._device = cupy.zeros(workload.bytes, dtype=cupy.uint8)
        cupy.cuda.get_current_stream().synchronize()

    def _open(self, key: str, size: int) -> Any:
        from kvikio import RemoteFile

        t = self._target
        try:
            return RemoteFile.open_s3(
                t.source_bucket,
                key,
                size,
                aws_region_name=t.region,
                aws_access_key_id=t.access_key,
                aws_secret_access_key=t.secret_key,
                aws_endpoint_url=t.endpoint_url,
            )
        except TypeError:
            # An older KvikIO: credentials and endpoint only from the environment.
            os.environ.update(
                AWS_DEFAULT_REGION=t.region,
                AWS_ACCESS_KEY_ID=t.access_key,
                AWS_SECRET_ACCESS_KEY=t.secret_key,
                AWS_ENDPOINT_URL=t.endpoint_url,
            )
            return RemoteFile.open_s3(t.source_bucket, key, size)

    def run(self, workload: Workload) -> dict[str, Any]:
        import cupy

        pending: deque[tuple[Any, Any, int, int]] = deque()
        offset = 0
        output_bytes = 0
        for obj in workload.objects:
            handle = self._open(obj.key, obj.size)
            target = self._device[offset : offset + obj.size]
            pending.append((handle, handle.pread(target, obj.size, 0), offset, obj.size))
            offset += obj.size
            if len(pending) >= MAX_READS_IN_FLIGHT:
                output_bytes += self._finish(*pending.popleft())
        while pending:
            output_bytes += self._finish(*pending.popleft())
        cupy.cuda.get_current_stream().synchronize()
        return {"kvikio": self._settings, "output_bytes": output_bytes}

    def _finish(self, handle: Any, future: Any, offset: int, size: int) -> int:
        got = int(future.get())
        handle.close()
        if got != size:
            raise RuntimeError(f"kvikio read {got} of {size} bytes")
        return self._process(offset, size) if self._preprocess else 0

    def _process(self, offset: int, size: int) -> int:
        import cupy

        from ingest.dicom.parse import DicomHeader, parse_header
        from ingest_gpu.preprocess import preprocess_cupy

        view = self._device[offset : offset + size]
        length = min(size, HEADER_PREFIX)
        while True:
            prefix = cupy.asnumpy(view[:length])
            parsed = parse_header(memoryview(prefix), size, max_header_bytes=1 << 30)
            if isinstance(parsed, DicomHeader):
                break
            if length >= size:
                raise RuntimeError("the header does not end inside the object")
            length = min(size, max(parsed.at_least, length * 2))
        fmt, at, pitch = parsed.pixel, parsed.pixel_offset, parsed.frame_pitch
        if pitch:  # Encapsulated Uncompressed: gather the frames on the device
            base = view[at : at + (fmt.frames - 1) * pitch + fmt.frame_bytes]
            rows = cupy.lib.stride_tricks.as_strided(
                base, (fmt.frames, fmt.frame_bytes), (pitch, 1)
            )
            raw = cupy.ascontiguousarray(rows).ravel()
        else:
            raw = view[at : at + parsed.pixel_length]
        out = preprocess_cupy(raw, fmt, parsed.transform(None, "float32"), 0)
        return int(out.nbytes)

    def close(self) -> None:
        self._device = None


def pinned_copy_rate(nbytes: int, total_bytes: int = 4 << 30) -> dict[str, float]:
    """GB/s of a plain pinned host-to-device ``cudaMemcpyAsync`` of ``nbytes``, repeated."""
    import cupy

    rt = cupy.cuda.runtime
    host = cupy.cuda.alloc_pinned_memory(nbytes)
    device = cupy.empty(nbytes, dtype=cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    copies = max(8, min(4096, total_bytes // max(1, nbytes)))
    for _ in range(3):  # warm-up, discarded
        rt.memcpyAsync(device.data.ptr, host.ptr, nbytes, rt.memcpyHostToDevice, stream.ptr)
    stream.synchronize()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    for _ in range(copies):
        rt.memcpyAsync(device.data.ptr, host.ptr, nbytes, rt.memcpyHostToDevice, stream.ptr)
    end.record(stream)
    end.synchronize()
    seconds = cupy.cuda.get_elapsed_time(start, end) / 1000.0
    return {
        "bytes_per_copy": float(nbytes),
        "copies": float(copies),
        "seconds": seconds,
        "gb_per_s": nbytes * copies / seconds / 1e9 if seconds else 0.0,
    }
