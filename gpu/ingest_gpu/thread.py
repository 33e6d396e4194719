"""The dedicated device thread: the only thread that calls CUDA.

One ``threading.Thread`` owns the device's context, its non-blocking CUDA
stream, the staging arenas and the CUDA events (``ingest_gpu.transfer.CudaRunner``,
through the driver: ``ingest_gpu.driver``), or the NumPy
twin (``ingest_gpu.jobs.CpuRunner``) when CUDA is absent. Work reaches it through a
FIFO queue and comes back through ``concurrent.futures.Future``\\s, which the
asyncio side awaits with ``asyncio.wrap_future``: nothing here blocks a loop.

``submit`` resolves to one outcome per job, in job order: a ``ChunkResult`` or
the exception that failed that job alone. The future itself fails only when
the thread cannot run the batch at all. Each job's ``on_consumed`` is called
exactly once, on this thread, also for failed jobs and cancelled batches.
"""

from __future__ import annotations

import concurrent.futures
import functools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ingest_gpu.decode import JpegDecoder
from ingest_gpu.jobs import ChunkJob, ChunkResult, CpuRunner, Runner, consume, deliver
from ingest_gpu.memory import COUNTERS, HostBuffer, alloc_host

__all__ = ["ChunkJob", "ChunkResult", "DeviceThread", "cuda_unavailable_reason"]

Device = Literal["auto", "cuda", "cpu"]


def cuda_unavailable_reason() -> str | None:
    """None when the CUDA driver loads and sees a device, else why not.

    This probe is the one CUDA call made off the device thread; it initialises
    the driver, counts devices and creates no CUDA context. CuPy is not needed.
    """
    from ingest_gpu import driver

    try:
        count = driver.device_count()
    except OSError as exc:
        return f"the CUDA driver (libcuda.so.1) cannot be loaded ({exc})"
    except Exception as exc:  # CudaError: no device, a broken install
        return f"no usable CUDA driver ({type(exc).__name__}: {exc})"
    return None if count > 0 else "no CUDA device is visible"


@dataclass(slots=True)
class _Work:
    run: Callable[[], Any]
    future: concurrent.futures.Future[Any]
    on_cancel: Callable[[], None] | None = None


class DeviceThread:
    """Owns the device; use as a context manager or ``start()`` / ``close()``. ``jpeg``:
    the JPEG decoder nvImageCodec tries first (``ingest_gpu.decode.BACKENDS``).

    Raises (constructor):
        ValueError: ``device`` is not auto, cuda or cpu.
        RuntimeError: ``device="cuda"`` where CUDA is not usable.
    """

    def __init__(
        self, device: Device = "auto", *, device_index: int = 0, jpeg: JpegDecoder = "hardware"
    ) -> None:
        if device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be auto, cuda or cpu, not {device!r}")
        backend = "cpu"
        if device != "cpu":
            why = cuda_unavailable_reason()
            if why is None:
                backend = "cuda"
            elif device == "cuda":
                raise RuntimeError(f"device 'cuda' was asked for, but {why}")
        self.backend: str = backend
        self._device_index, self._jpeg = device_index, jpeg
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ready: concurrent.futures.Future[None] | None = None
        self._closed = False
        self._runner: Runner | None = None
        self._counts = {"batches": 0, "host_allocations": 0}
        self._busy_since: float | None = None  # when the work item running now began

    def start(self) -> None:
        """Start the thread and set up the device, waiting for it; idempotent.

        Raises:
            RuntimeError: the thread was closed.
            Exception: whatever setting up the device raised (CUDA errors, NVRTC).
        """
        try:
            self.launch().result()
        except BaseException:
            self.close()
            raise

    def launch(self) -> concurrent.futures.Future[None]:
        """Start the thread without waiting: the device is set up on it, and the future
        resolves when it is (or to what setting it up raised). Idempotent.

        Raises:
            RuntimeError: the thread was closed.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("device thread is closed")
            if self._ready is None:
                self._ready = concurrent.futures.Future()
                self._thread = threading.Thread(
                    target=self._main, args=(self._ready,), name="dicom-ingest-device", daemon=True
                )
                self._thread.start()
            return self._ready

    def close(self) -> None:
        """Finish the queued work, free the device's buffers and join; idempotent."""
        with self._lock:
            thread, self._closed = self._thread, True
            if thread is not None and thread.is_alive():
                self._queue.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def __enter__(self) -> DeviceThread:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def submit(
        self, jobs: Sequence[ChunkJob]
    ) -> concurrent.futures.Future[list[ChunkResult | BaseException]]:
        """Queue one batch; the future resolves to one outcome per job, in order.

        Raises:
            RuntimeError: the thread is closed (``on_consumed`` is not called then).
        """
        batch = list(jobs)

        def run() -> list[ChunkResult | BaseException]:
            assert self._runner is not None
            self._counts["batches"] += 1
            return deliver(batch, self._runner.run(batch))

        def cancelled() -> None:
            for job in batch:
                consume(job)

        return self._put(_Work(run, concurrent.futures.Future(), cancelled))

    def alloc_host(self, nbytes: int) -> HostBuffer:
        """Allocate a host buffer on the device thread (pinned on CUDA); waits for it.

        Raises:
            RuntimeError: the thread is closed.
            MemoryError: the allocation failed.
        """
        if self._thread is threading.current_thread():
            return self._alloc(nbytes)
        result: HostBuffer = self._put(self._alloc_work(nbytes)).result()
        return result

    def alloc_host_soon(self, nbytes: int) -> concurrent.futures.Future[HostBuffer]:
        """``alloc_host`` without waiting, not even for the device's set-up (``launch``):
        the allocation is queued behind it, and fails with ``RuntimeError`` if it failed.

        Raises:
            RuntimeError: the thread is closed.
        """
        self.launch()
        future: concurrent.futures.Future[HostBuffer] = self._enqueue(self._alloc_work(nbytes))
        return future

    def _alloc_work(self, nbytes: int) -> _Work:
        return _Work(functools.partial(self._alloc, nbytes), concurrent.futures.Future())

    def _alloc(self, nbytes: int) -> HostBuffer:
        self._counts["host_allocations"] += 1
        return alloc_host(nbytes, pinned=self.backend == "cuda", device_index=self._device_index)

    def enable_device_arrays(self) -> None:
        """Load what hands a hook its outputs on the device now (CuPy, on CUDA), so that
        a missing CuPy fails start-up, not the first object; waits for it.

        Raises:
            ImportError: the backend is CUDA and CuPy is not installed.
            RuntimeError: the thread is closed.
        """

        def run() -> None:
            assert self._runner is not None
            self._runner.enable_device_arrays()

        self._put(_Work(run, concurrent.futures.Future())).result()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn`` on the device thread, after the work queued before it (the device's
        context current there; CuPy usable once ``enable_device_arrays`` ran): how a
        series hook gets its volume's slabs on the device.

        Raises:
            RuntimeError: the thread is closed.
        """
        return self._put(_Work(fn, concurrent.futures.Future()))

    def stats(self) -> dict[str, int | float]:
        """Counters of the thread, its runner and host allocations (a snapshot)."""
        runner = self._runner
        merged: dict[str, int | float] = {**COUNTERS.snapshot(), **self._counts}
        if runner is not None:
            merged.update(runner.stats())
        return merged

    def busy_s(self) -> float:
        """How long the work item running on the thread now has run; 0.0 when it waits
        for work. A value that keeps growing is a thread stuck in one call (a hung
        kernel, a driver wait): what the worker's liveness probe looks for."""
        since = self._busy_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def _put(self, work: _Work) -> concurrent.futures.Future[Any]:
        self.start()
        return self._enqueue(work)

    def _enqueue(self, work: _Work) -> concurrent.futures.Future[Any]:
        with self._lock:
            if self._closed:
                raise RuntimeError("device thread is closed")
            self._queue.put(work)
        return work.future

    def _main(self, ready: concurrent.futures.Future[None]) -> None:
        failure: BaseException | None = None
        try:
            if self.backend == "cuda":
                from ingest_gpu.transfer import CudaRunner

                self._runner = CudaRunner(self._device_index, self._jpeg)
            else:
                self._runner = CpuRunner()
        except BaseException as exc:
            failure = exc
            ready.set_exception(exc)
        else:
            ready.set_result(None)
        try:
            while (work := self._queue.get()) is not None:
                if failure is not None or not work.future.set_running_or_notify_cancel():
                    if work.on_cancel is not None:
                        work.on_cancel()
                    if failure is not None and not work.future.cancelled():
                        work.future.set_exception(RuntimeError("device setup failed"))
                    continue
                self._busy_since = time.monotonic()
                try:
                    work.future.set_result(work.run())
                except BaseException as exc:
                    work.future.set_exception(exc)
                finally:
                    self._busy_since = None
        finally:
            if self._runner is not None:
                self._runner.close()
