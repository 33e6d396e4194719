"""What the device thread is given and gives back, and its CPU runner (the NumPy twin).

A runner turns one batch of ``ChunkJob``\\s into one outcome per job, in job
order: a ``ChunkResult``, or the exception that failed that job alone, so one
bad chunk never fails its neighbours. Every runner calls each job's
``on_consumed`` exactly once, on the device thread, as soon as the job's host
bytes may be reused, whether the job succeeded or not.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from ingest_gpu.decode import DeviceDecodeError, EncodedFrames
from ingest_gpu.formats import PixelFormat, Transform, pitched_frames
from ingest_gpu.preprocess import preprocess_numpy

# Offsets of chunks inside the device arenas: CuPy's allocation granularity.
ARENA_ALIGN = 512


def arena_nbytes(nbytes: int) -> int:
    """What ``nbytes`` of a chunk take in a device arena: rounded up to ``ARENA_ALIGN``."""
    return -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN


@dataclass(frozen=True, slots=True)
class ChunkJob:
    """One chunk of raw samples to preprocess.

    ``data`` is read-only for the device thread and must stay untouched until
    ``on_consumed`` is called. ``keep_on_device`` returns the output as a CuPy array too
    (for a user hook; ignored on the CPU backend); ``want_host=False`` then
    skips the copy back to the host. ``on_result`` (a user hook) is called on
    the device thread with the finished result, before the batch's future
    resolves, so it may use CuPy on the thread that owns the device; what it
    raises fails that job alone. ``pitch`` > 0: ``data`` holds whole frames, one
    every ``pitch`` bytes (``ingest_gpu.formats.pitched_frames``), which the device copy
    (or the twin) gathers; 0: its samples are contiguous. ``encoded``: the job's
    frames as codestreams, decoded on the device (``ingest_gpu.decode``; CUDA only) to
    ``fmt``'s samples, and ``data`` is empty.
    """

    data: memoryview
    fmt: PixelFormat
    transform: Transform
    first_element: int
    on_consumed: Callable[[], None]
    keep_on_device: bool = False
    want_host: bool = True
    on_result: Callable[[ChunkResult], None] | None = None
    pitch: int = 0
    encoded: EncodedFrames | None = None

    @property
    def sample_nbytes(self) -> int:
        """The bytes of samples in ``data`` (without what lies between pitched frames), or
        that ``encoded``'s frames decode to.

        Raises:
            ValueError: ``data`` is not whole frames at ``pitch``.
        """
        if self.encoded is not None:
            return len(self.encoded.frames) * self.fmt.frame_bytes
        if not self.pitch:
            return self.data.nbytes
        return pitched_frames(self.data.nbytes, self.fmt.frame_bytes, self.pitch) * (
            self.fmt.frame_bytes
        )


@dataclass(slots=True)
class ChunkResult:
    """One chunk's output: ``host`` is 1-D ``out_dtype`` in output order.

    ``host`` is a fresh array owned by the caller (None only for
    ``keep_on_device`` jobs with ``want_host=False``); ``device`` is the CuPy
    array of ``keep_on_device`` jobs on CUDA. Timings come from CUDA events on
    the GPU (``kernel_seconds`` is the whole batch's launch, the same in every
    result of a batch) and from ``perf_counter`` on the CPU.
    """

    host: npt.NDArray[Any] | None
    device: Any | None
    backend: str
    h2d_seconds: float = 0.0
    kernel_seconds: float = 0.0
    d2h_seconds: float = 0.0


class Runner(Protocol):
    """Runs batches on the device thread; created and used only there."""

    backend: str

    def run(self, jobs: Sequence[ChunkJob]) -> list[ChunkResult | BaseException]: ...

    def stats(self) -> dict[str, int | float]: ...

    def enable_device_arrays(self) -> None: ...

    def close(self) -> None: ...


def deliver(
    jobs: Sequence[ChunkJob], outcomes: list[ChunkResult | BaseException]
) -> list[ChunkResult | BaseException]:
    """Run each job's ``on_result`` on its result (device thread); a raise fails that job."""
    for i, (job, outcome) in enumerate(zip(jobs, outcomes, strict=True)):
        if job.on_result is not None and isinstance(outcome, ChunkResult):
            try:
                job.on_result(outcome)
            except Exception as exc:
                outcomes[i] = exc
    return outcomes


def consume(job: ChunkJob) -> BaseException | None:
    """Call ``job.on_consumed``; returns what it raised instead of raising it."""
    try:
        job.on_consumed()
    except Exception as exc:
        return exc
    return None


def host_bytes(data: memoryview) -> npt.NDArray[np.uint8]:
    """A 1-D uint8 array over ``data`` without copying (any contiguous format)."""
    return np.frombuffer(data, dtype=np.uint8)


def job_samples(job: ChunkJob) -> npt.NDArray[np.uint8]:
    """``job``'s samples as one contiguous 1-D uint8 array: a view of ``data``, or for
    pitched frames a gathered copy (the NumPy twin's stand-in for the 2-D device copy).

    Raises:
        ValueError: ``data`` is not whole frames at ``pitch``.
        DeviceDecodeError: the job's frames are codestreams.
    """
    if job.encoded is not None:
        raise DeviceDecodeError("the CPU backend decodes no codestreams")
    raw = host_bytes(job.data)
    if not job.pitch:
        return raw
    frame = job.fmt.frame_bytes
    frames = pitched_frames(raw.nbytes, frame, job.pitch)
    rows = np.lib.stride_tricks.as_strided(raw, (frames, frame), (job.pitch, 1), writeable=False)
    return rows.reshape(-1)  # a copy: the rows are not contiguous


class CpuRunner:
    """The NumPy twin of ``ingest_gpu.transfer.CudaRunner``."""

    backend = "cpu"

    def __init__(self) -> None:
        self._stats: dict[str, int | float] = {"jobs": 0, "failed_jobs": 0, "bytes_in": 0}

    def run(self, jobs: Sequence[ChunkJob]) -> list[ChunkResult | BaseException]:
        outcomes: list[ChunkResult | BaseException] = []
        for job in jobs:
            outcome: ChunkResult | BaseException
            started = time.perf_counter()
            try:
                raw = job_samples(job)
                values = preprocess_numpy(raw, job.fmt, job.transform, job.first_element)
                outcome = ChunkResult(values, None, "cpu", 0.0, time.perf_counter() - started)
                self._stats["bytes_in"] += raw.nbytes
            except Exception as exc:
                outcome = exc
            failed = consume(job)
            outcome = failed if failed is not None else outcome
            self._stats["jobs"] += 1
            self._stats["failed_jobs"] += isinstance(outcome, BaseException)
            outcomes.append(outcome)
        return outcomes

    def stats(self) -> dict[str, int | float]:
        return dict(self._stats)

    def enable_device_arrays(self) -> None:
        pass  # a hook gets NumPy arrays here

    def close(self) -> None:
        pass
