"""Pinned host slot -> device copies, the batch kernel, copies back, CUDA events, slot hand-back.

Facts this module relies on:

- Only a copy from page-locked (pinned) host memory is truly asynchronous:
  the DMA engine reads the slot while the host carries on. From pageable memory
  the driver first stages the bytes through its own pinned buffer (slower, and
  ``cudaMemcpyAsync`` may block), which is still correct, so pageable slots work
  too; ``pageable_h2d_jobs`` counts them.
- Copies and kernels issued to one stream execute in issue order, each after
  the previous one completed. So the kernel sees every H2D copy issued before it,
  and a D2H copy issued after it sees its output, with no extra synchronisation.
- Every CUDA call goes to the driver (``ingest_gpu.driver``; copies, event records and
  the launch keep the GIL, so nothing else runs between an event and its
  copy). CuPy is imported only when a job keeps its output on the device for
  a hook: those arrays are CuPy's, from its memory pool, on this stream.
- A chunk of pitched frames (Encapsulated Uncompressed: an item header between
  frames) goes over as one 2-D copy (``cuMemcpy2DAsync``: a row a frame, the
  host pitch the frame's, the device pitch the frame's bytes), so the device
  gets its samples contiguous with no gather on either side.
- A host slot may be reused only once the event recorded right after its H2D
  copy has completed: until then the DMA engine may still be reading it. That is
  when ``on_consumed`` is called (on this thread), before the kernel finishes.
- A job of encoded frames copies nothing: nvImageCodec decodes its frames
  into the input arena on the same stream before the kernel (``ingest_gpu.decode``),
  and its outcome is that decode's failure when it fails.
- An arena grows by freeing its block (``cuMemFree`` waits for the device) after
  the last batch was synchronised. A CuPy memory-pool block (a hook's array)
  freed while the stream still uses it is reused only by work on the same
  stream, which runs later: stream order keeps it safe.

Memory: device input, device output, pinned output staging and the parameter
buffers are grow-only arenas rounded up to a power of two, so a steady stream
of same-sized batches allocates nothing; ``stats()`` counts every growth. The
host result of each chunk is a fresh NumPy array copied out of the pinned
staging after the batch, so the staging is free again for the next batch and
callers own their results outright.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ingest_gpu import driver, kernel
from ingest_gpu.decode import DeviceDecodeError, JpegDecoder, NvDecoder
from ingest_gpu.enqueue import Enqueue
from ingest_gpu.formats import pitched_frames
from ingest_gpu.jobs import ChunkJob, ChunkResult, arena_nbytes, consume, host_bytes
from ingest_gpu.memory import COUNTERS, pinned_memory
from ingest_gpu.preprocess import ChunkPlan, plan_chunk

_MIN_ARENA = 1 << 20
_PINNED_CACHE = 4096  # addresses whose pinned-or-not answer is kept


class _Arena:
    """A grow-only buffer, device (``cuMemAlloc``) or pinned host (``pinned_memory``)."""

    def __init__(
        self, context: driver.Context, *, pinned: bool, stats: dict[str, int | float]
    ) -> None:
        self._context = context
        self._pinned = pinned
        self._stats = stats
        self.memory: Any = None
        self.ptr = 0
        self.capacity = 0

    def ensure(self, nbytes: int) -> None:
        if nbytes <= self.capacity:
            return
        size = max(_MIN_ARENA, 1 << (nbytes - 1).bit_length())
        self.memory = None  # the caller synchronised the last batch: nothing uses it
        if self._pinned:
            self.memory = pinned_memory(size, self._context.device_index)
            self.ptr = ctypes.addressof(self.memory)
            COUNTERS.add(size, pinned=True)
            self._stats["pinned_staging_allocations"] += 1
        else:
            self.memory = driver.DeviceMemory(self._context, size)
            self.ptr = self.memory.ptr
            self._stats["device_allocations"] += 1
            self._stats["device_bytes"] += size
        self.capacity = size

    def host_array(self, offset: int, nbytes: int) -> npt.NDArray[np.uint8]:
        whole = np.frombuffer(self.memory, dtype=np.uint8, count=self.capacity)
        return whole[offset : offset + nbytes]


class CudaRunner:
    """Owns the device's context, one non-blocking stream and the staging arenas
    (device thread only); ``jpeg``: the JPEG decoder nvImageCodec tries first."""

    backend = "cuda"

    def __init__(self, device_index: int = 0, jpeg: JpegDecoder = "hardware") -> None:
        self._jpeg = jpeg
        self._context = driver.primary_context(device_index)  # current on this thread
        self.stream = driver.Stream(self._context)
        self._stats: dict[str, int | float] = dict.fromkeys(
            (
                "jobs",
                "failed_jobs",
                "bytes_h2d",
                "bytes_d2h",
                "kernel_launches",
                "device_allocations",
                "device_bytes",
                "device_result_arrays",
                "pinned_staging_allocations",
                "pageable_h2d_jobs",
            ),
            0,
        )
        arena = functools.partial(_Arena, self._context, stats=self._stats)
        self._dev_in = arena(pinned=False)
        self._dev_out = arena(pinned=False)
        self._dev_params = arena(pinned=False)
        self._host_out = arena(pinned=True)
        self._host_params = arena(pinned=True)
        self._events: list[driver.Event] = []
        self._issue = Enqueue()  # copies, events and the launch keep the GIL
        self._pinned_at: dict[int, bool] = {}
        self._arrays: _DeviceArrays | None = None
        self._decoder: NvDecoder | DeviceDecodeError | None = None
        kernel.compile_kernel(device_index)  # a missing kernel fails start-up, not a batch

    def enable_device_arrays(self) -> None:
        """Import CuPy now (a hook is set), not in the first batch that keeps its output.

        Raises:
            ImportError: CuPy is not installed.
        """
        self._device_arrays()

    def _device_arrays(self) -> _DeviceArrays:
        if self._arrays is None:
            self._arrays = _DeviceArrays(self._context.device_index, self.stream)
        return self._arrays

    def stats(self) -> dict[str, int | float]:
        return dict(self._stats)

    def _decode(
        self, jobs: Sequence[ChunkJob], encoded: list[tuple[int, int]]
    ) -> list[BaseException | None]:
        """Decode the encoded jobs ``(job index, arena pointer)`` on the stream
        (``ingest_gpu.decode``)."""
        if self._decoder is None:
            try:
                self._decoder = NvDecoder(self._context.device_index, self._stats, self._jpeg)
            except Exception as exc:  # not installed, or it cannot start: the CPU decodes
                failure = DeviceDecodeError(f"nvImageCodec is unavailable ({exc})")
                self._decoder = failure
        if isinstance(self._decoder, DeviceDecodeError):
            return [self._decoder] * len(encoded)
        work = []
        for i, ptr in encoded:
            frames = jobs[i].encoded
            assert frames is not None
            work.append((frames, jobs[i].fmt, ptr))
        return self._decoder.decode(work, self.stream.handle)

    def close(self) -> None:
        self._decoder = None
        self.stream.synchronize()
        for arena in (self._dev_in, self._dev_out, self._dev_params, self._host_out):
            arena.memory = None
        self._host_params.memory = None
        for event in self._events:
            event.close()
        self._events.clear()
        self.stream.close()

    def run(self, jobs: Sequence[ChunkJob]) -> list[ChunkResult | BaseException]:
        outcomes: list[ChunkResult | BaseException | None] = [None] * len(jobs)
        consumed = [False] * len(jobs)
        valid: list[tuple[int, ChunkPlan]] = []
        for i, job in enumerate(jobs):
            try:
                valid.append(
                    (i, plan_chunk(job.sample_nbytes, job.fmt, job.transform, job.first_element))
                )
            except Exception as exc:
                outcomes[i] = exc
        try:
            if valid:
                self._run(jobs, valid, outcomes, consumed)
        except Exception as exc:
            # The slots may be handed back only once no copy can still read them.
            with contextlib.suppress(Exception):
                self.stream.synchronize()
            for i, _ in valid:
                if outcomes[i] is None:
                    outcomes[i] = exc
        finally:
            for i, job in enumerate(jobs):
                if not consumed[i]:
                    failed = consume(job)
                    if failed is not None:
                        outcomes[i] = failed
        done: list[ChunkResult | BaseException] = []
        for outcome in outcomes:
            assert outcome is not None
            done.append(outcome)
        self._stats["jobs"] += len(jobs)
        self._stats["failed_jobs"] += sum(isinstance(o, BaseException) for o in done)
        return done

    def _events_for(self, count: int) -> list[driver.Event]:
        while len(self._events) < count:
            self._events.append(driver.Event(self._context))
        return self._events[:count]

    def _run(
        self,
        jobs: Sequence[ChunkJob],
        valid: list[tuple[int, ChunkPlan]],
        outcomes: list[ChunkResult | BaseException | None],
        consumed: list[bool],
    ) -> None:
        stream, issue = self.stream, self._issue
        in_at, out_at, host_at = [], [], []
        in_total = out_total = host_total = 0
        for i, plan in valid:
            in_at.append(in_total)
            in_total += arena_nbytes(jobs[i].sample_nbytes)
            out_at.append(out_total)
            if not jobs[i].keep_on_device:
                out_total += arena_nbytes(plan.out_nbytes)
            host_at.append(host_total)
            if jobs[i].want_host or not jobs[i].keep_on_device:
                host_total += arena_nbytes(plan.out_nbytes)
        sources = [host_bytes(jobs[i].data) for i, _ in valid]  # alive until synchronised
        kept: dict[int, Any] = {}
        dst_ptrs = []
        self._dev_in.ensure(in_total)
        self._dev_out.ensure(out_total)
        self._host_out.ensure(host_total)
        for k, (i, plan) in enumerate(valid):
            if jobs[i].keep_on_device:
                kept[k] = self._device_arrays().empty(plan.n, plan.out_dtype)
                self._stats["device_result_arrays"] += 1
                dst_ptrs.append(int(kept[k].data.ptr))
            else:
                dst_ptrs.append(self._dev_out.ptr + out_at[k])
        plans = [plan for _, plan in valid]
        src_ptrs = [self._dev_in.ptr + at for at in in_at]
        ints, floats, table = kernel.pack_params(plans, src_ptrs, dst_ptrs)
        packed = np.concatenate(
            [ints.view(np.uint8).ravel(), floats.view(np.uint8).ravel(), table.view(np.uint8)]
        )
        self._host_params.ensure(packed.nbytes)
        self._dev_params.ensure(packed.nbytes)
        self._host_params.host_array(0, packed.nbytes)[:] = packed
        issue.h2d(self._dev_params.ptr, self._host_params.ptr, packed.nbytes, stream)
        n = len(valid)
        events = self._events_for(3 * n + 1)
        launched, before, h2d, d2h = (
            events[0],
            events[1 : 1 + n],
            events[1 + n : 1 + 2 * n],
            events[1 + 2 * n :],
        )
        for source in sources:
            self._pageable_check(source)
        encoded = [(i, src_ptrs[k]) for k, (i, _) in enumerate(valid) if jobs[i].encoded]
        if encoded:  # decoded into the input arena, ahead of the kernel on the stream
            for (i, _), failure in zip(encoded, self._decode(jobs, encoded), strict=True):
                outcomes[i] = failure
        # An event on each side of each copy: the copy's own time on the DMA engine,
        # whatever gaps the host leaves between issuing them.
        for k, source in enumerate(sources):
            job = jobs[valid[k][0]]
            issue.record(before[k], stream)
            if job.pitch:  # the DMA engine leaves the bytes between frames behind
                frame, at = job.fmt.frame_bytes, source.ctypes.data
                rows = pitched_frames(source.nbytes, frame, job.pitch)
                issue.h2d_2d(src_ptrs[k], frame, at, job.pitch, frame, rows, stream)
            else:
                issue.h2d(src_ptrs[k], source.ctypes.data, source.nbytes, stream)
            issue.record(h2d[k], stream)
        params = self._dev_params.ptr
        n_ints, n_floats = ints.nbytes, floats.nbytes
        kernel.launch(
            params,
            params + n_ints,
            params + n_ints + n_floats,
            len(plans),
            max(plan.n for plan in plans),
            stream.handle,
            self._context.device_index,
        )
        issue.record(launched, stream)
        self._stats["kernel_launches"] += 1
        for k, (i, plan) in enumerate(valid):
            if jobs[i].want_host or not jobs[i].keep_on_device:
                issue.d2h(self._host_out.ptr + host_at[k], dst_ptrs[k], plan.out_nbytes, stream)
                self._stats["bytes_d2h"] += plan.out_nbytes
            issue.record(d2h[k], stream)
        for k, (i, _) in enumerate(valid):
            h2d[k].synchronize()
            consumed[i] = True
            failed = consume(jobs[i])
            if failed is not None:
                outcomes[i] = failed
        d2h[-1].synchronize()
        ms = driver.elapsed_ms
        kernel_s = ms(h2d[-1], launched) / 1000.0
        for k, (i, plan) in enumerate(valid):
            if jobs[i].encoded is None:
                self._stats["bytes_h2d"] += plan.n * jobs[i].fmt.itemsize
            if outcomes[i] is not None:
                continue
            host = None
            if jobs[i].want_host or not jobs[i].keep_on_device:
                host = np.empty(plan.n, dtype=plan.out_dtype)
                np.copyto(
                    host,
                    self._host_out.host_array(host_at[k], plan.out_nbytes).view(plan.out_dtype),
                )
            outcomes[i] = ChunkResult(
                host,
                kept.get(k),
                "cuda",
                ms(before[k], h2d[k]) / 1000.0,
                kernel_s,
                ms(d2h[k - 1] if k else launched, d2h[k]) / 1000.0,
            )

    def _pageable_check(self, source: npt.NDArray[np.uint8]) -> None:
        """Count copies from pageable memory; the answer per address is remembered (the
        ring's slots come back again and again, and each query is a call into CUDA)."""
        if not source.nbytes:
            return
        address = source.ctypes.data
        pinned = self._pinned_at.get(address)
        if pinned is None:
            pinned = driver.memory_type(address) == driver.MEMORYTYPE_HOST
            if len(self._pinned_at) >= _PINNED_CACHE:
                self._pinned_at.clear()
            self._pinned_at[address] = pinned
        if not pinned:
            self._stats["pageable_h2d_jobs"] += 1


class _DeviceArrays:
    """CuPy arrays for the outputs a hook gets, from CuPy's pool, on the runner's stream.

    Raises (constructor):
        ImportError: CuPy is not installed.
    """

    def __init__(self, device_index: int, stream: driver.Stream) -> None:
        import cupy

        self._cupy = cupy
        self._device = cupy.cuda.Device(device_index)
        from_external = getattr(cupy.cuda.Stream, "from_external", None)  # CuPy 14
        with self._device:
            self._stream = (
                from_external(stream)
                if from_external is not None
                else cupy.cuda.ExternalStream(stream.handle, device_index)
            )

    def empty(self, n: int, dtype: str) -> Any:
        with self._device, self._stream:  # a pool block of this stream
            return self._cupy.empty(n, dtype=dtype)
