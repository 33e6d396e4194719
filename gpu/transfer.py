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
- Copies and event records are issued through ``gpu.enqueue`` (the driver,
  keeping the GIL), so nothing else runs between an event and its copy.
- A chunk of pitched frames (Encapsulated Uncompressed: an item header between
  frames) goes over as one 2-D copy (``cuMemcpy2DAsync``: a row a frame, the
  host pitch the frame's, the device pitch the frame's bytes), so the device
  gets its samples contiguous with no gather on either side.
- A host slot may be reused only once the event recorded right after its H2D
  copy has completed: until then the DMA engine may still be reading it. That is
  when ``on_consumed`` is called (on this thread), before the kernel finishes.
- A CuPy memory-pool block freed while the stream still uses it is reused only
  by work on the same stream, which runs later: stream order keeps it safe.

Memory: device input, device output, pinned output staging and the parameter
buffers are grow-only arenas rounded up to a power of two, so a steady stream
of same-sized batches allocates nothing; ``stats()`` counts every growth. The
host result of each chunk is a fresh NumPy array copied out of the pinned
staging after the batch, so the staging is free again for the next batch and
callers own their results outright.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from gpu import kernel
from gpu.enqueue import Enqueue
from gpu.formats import pitched_frames
from gpu.jobs import ChunkJob, ChunkResult, consume, host_bytes
from gpu.memory import COUNTERS, pinned_memory
from gpu.preprocess import ChunkPlan, plan_chunk

_ALIGN = 512  # offsets of chunks inside the arenas (CuPy's own allocation granularity)
_MIN_ARENA = 1 << 20
_PINNED_CACHE = 4096  # addresses whose pinned-or-not answer is kept


def _round(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _Arena:
    """A grow-only buffer, device (``cupy.empty``) or pinned host (``pinned_memory``)."""

    def __init__(self, cupy: Any, *, pinned: bool, stats: dict[str, int | float]) -> None:
        self._cupy = cupy
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
            self.memory = pinned_memory(size)
            self.ptr = int(self.memory.ptr)
            COUNTERS.add(size, pinned=True)
            self._stats["pinned_staging_allocations"] += 1
        else:
            self.memory = self._cupy.empty(size, dtype=self._cupy.uint8)
            self.ptr = int(self.memory.data.ptr)
            self._stats["device_allocations"] += 1
            self._stats["device_bytes"] += size
        self.capacity = size

    def host_array(self, offset: int, nbytes: int) -> npt.NDArray[np.uint8]:
        whole = np.frombuffer(self.memory, dtype=np.uint8, count=self.capacity)
        return whole[offset : offset + nbytes]


class CudaRunner:
    """Owns the device, one non-blocking stream and the staging arenas (device thread only)."""

    backend = "cuda"

    def __init__(self, device_index: int = 0) -> None:
        import cupy

        self._cp = cupy
        self._rt = cupy.cuda.runtime
        cupy.cuda.Device(device_index).use()
        self.stream = cupy.cuda.Stream(non_blocking=True)
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
        self._dev_in = _Arena(cupy, pinned=False, stats=self._stats)
        self._dev_out = _Arena(cupy, pinned=False, stats=self._stats)
        self._dev_params = _Arena(cupy, pinned=False, stats=self._stats)
        self._host_out = _Arena(cupy, pinned=True, stats=self._stats)
        self._host_params = _Arena(cupy, pinned=True, stats=self._stats)
        self._events: list[Any] = []
        self._issue = Enqueue(cupy)  # copies and events issued without a GIL hand-over
        self._pinned_at: dict[int, bool] = {}
        kernel.compile_kernel()  # compile errors surface at start-up, not in the first batch

    def stats(self) -> dict[str, int | float]:
        return dict(self._stats)

    def close(self) -> None:
        self.stream.synchronize()
        for arena in (self._dev_in, self._dev_out, self._dev_params, self._host_out):
            arena.memory = None
        self._host_params.memory = None

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

    def _events_for(self, count: int) -> list[Any]:
        while len(self._events) < count:
            self._events.append(self._cp.cuda.Event())
        return self._events[:count]

    def _run(
        self,
        jobs: Sequence[ChunkJob],
        valid: list[tuple[int, ChunkPlan]],
        outcomes: list[ChunkResult | BaseException | None],
        consumed: list[bool],
    ) -> None:
        cp, stream, issue = self._cp, self.stream, self._issue
        in_at, out_at, host_at = [], [], []
        in_total = out_total = host_total = 0
        for i, plan in valid:
            in_at.append(in_total)
            in_total += _round(jobs[i].sample_nbytes)
            out_at.append(out_total)
            if not jobs[i].keep_on_device:
                out_total += _round(plan.out_nbytes)
            host_at.append(host_total)
            if jobs[i].want_host or not jobs[i].keep_on_device:
                host_total += _round(plan.out_nbytes)
        sources = [host_bytes(jobs[i].data) for i, _ in valid]  # alive until synchronised
        kept: dict[int, Any] = {}
        dst_ptrs = []
        with stream:  # CuPy allocations below belong to this stream's pool
            self._dev_in.ensure(in_total)
            self._dev_out.ensure(out_total)
            self._host_out.ensure(host_total)
            for k, (i, plan) in enumerate(valid):
                if jobs[i].keep_on_device:
                    kept[k] = cp.empty(plan.n, dtype=plan.out_dtype)
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
            params = self._dev_params.memory
            n_ints, n_floats = ints.nbytes, floats.nbytes
            kernel.launch(
                params[:n_ints].view(cp.int64),
                params[n_ints : n_ints + n_floats].view(cp.float64),
                params[n_ints + n_floats : packed.nbytes].view(cp.float64),
                len(plans),
                max(plan.n for plan in plans),
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
        ms = cp.cuda.get_elapsed_time
        kernel_s = ms(h2d[-1], launched) / 1000.0
        for k, (i, plan) in enumerate(valid):
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
            try:
                attrs = self._rt.pointerGetAttributes(address)
                pinned = int(attrs.type) == int(getattr(self._rt, "memoryTypeHost", 1))
            except Exception:  # older drivers raise on unregistered memory
                pinned = False
            if len(self._pinned_at) >= _PINNED_CACHE:
                self._pinned_at.clear()
            self._pinned_at[address] = pinned
        if not pinned:
            self._stats["pageable_h2d_jobs"] += 1
