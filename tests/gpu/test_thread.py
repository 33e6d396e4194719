"""DeviceThread on the CPU backend, and host buffers: the contract the async side relies on."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from ingest_gpu.formats import PixelFormat, Transform
from ingest_gpu.jobs import ChunkJob, ChunkResult
from ingest_gpu.memory import ALIGNMENT, COUNTERS, alloc_host
from ingest_gpu.preprocess import preprocess_numpy
from ingest_gpu.thread import DeviceThread, cuda_unavailable_reason

CT = PixelFormat(8, 8, 3, 1, 16, 12, True, False)
RGB = PixelFormat(4, 4, 2, 3, 8, 8, False, True)


class Consumed:
    """Counts ``on_consumed`` calls per job and the thread they came from."""

    def __init__(self) -> None:
        self.calls: Counter[int] = Counter()
        self.threads: set[str] = set()

    def __call__(self, index: int) -> Any:
        def release() -> None:
            self.calls[index] += 1
            self.threads.add(threading.current_thread().name)

        return release


def chunk_jobs(consumed: Consumed) -> tuple[list[ChunkJob], list[npt.NDArray[Any]]]:
    """A mixed batch: whole CT, a CT chunk from mid-frame, planar RGB float16."""
    rng = np.random.default_rng(7)
    ct = rng.bytes(CT.total_bytes)
    rgb = rng.bytes(RGB.total_bytes)
    hu = Transform((1.0, 2.0, 0.5), (-1024.0,), True, (40.0, 400.0))
    specs = [
        (ct, CT, hu, 0),
        (ct[2 * 70 : 2 * 150], CT, Transform((1.0,), (-1024.0,), True), 70),
        (rgb, RGB, Transform(out_dtype="float16"), 0),
    ]
    jobs, expected = [], []
    for i, (data, fmt, transform, first) in enumerate(specs):
        jobs.append(ChunkJob(memoryview(data), fmt, transform, first, consumed(i)))
        expected.append(preprocess_numpy(np.frombuffer(data, np.uint8), fmt, transform, first))
    return jobs, expected


def test_cpu_batch_matches_numpy_and_consumes_each_job_once() -> None:
    consumed = Consumed()
    jobs, expected = chunk_jobs(consumed)
    with DeviceThread("cpu") as device:
        assert device.backend == "cpu"
        outcomes = device.submit(jobs).result(timeout=30)
        stats = device.stats()
    assert len(outcomes) == len(jobs)
    for outcome, want in zip(outcomes, expected, strict=True):
        assert isinstance(outcome, ChunkResult)
        assert outcome.backend == "cpu"
        assert outcome.device is None
        assert outcome.host is not None
        assert outcome.host.dtype == want.dtype
        assert outcome.host.tobytes() == want.tobytes()
    assert consumed.calls == Counter({0: 1, 1: 1, 2: 1})
    assert consumed.threads == {"dicom-ingest-device"}
    assert stats["batches"] == 1
    assert stats["jobs"] == 3


def test_a_bad_job_fails_alone_and_is_still_consumed() -> None:
    consumed = Consumed()
    jobs, expected = chunk_jobs(consumed)
    bad = ChunkJob(memoryview(b"\x00" * 3), CT, Transform(), 0, consumed(9))
    with DeviceThread("cpu") as device:
        outcomes = device.submit([jobs[0], bad, jobs[2]]).result(timeout=30)
    assert isinstance(outcomes[1], ValueError)
    assert isinstance(outcomes[0], ChunkResult)
    assert isinstance(outcomes[2], ChunkResult)
    assert outcomes[2].host is not None
    assert outcomes[2].host.tobytes() == expected[2].tobytes()
    assert consumed.calls == Counter({0: 1, 9: 1, 2: 1})


def test_a_failing_release_fails_its_job() -> None:
    def boom() -> None:
        raise RuntimeError("slot bookkeeping broke")

    job = ChunkJob(memoryview(bytes(CT.total_bytes)), CT, Transform(), 0, boom)
    with DeviceThread("cpu") as device:
        (outcome,) = device.submit([job]).result(timeout=30)
    assert isinstance(outcome, RuntimeError)


def test_slot_may_be_overwritten_once_consumed() -> None:
    """on_consumed means the bytes were read: scribbling over them must not change the result."""
    slot = bytearray(np.random.default_rng(3).bytes(CT.total_bytes))
    want = preprocess_numpy(np.frombuffer(bytes(slot), np.uint8), CT, Transform(), 0)

    def scribble() -> None:
        slot[:] = b"\xff" * len(slot)

    with DeviceThread("cpu") as device:
        (outcome,) = device.submit(
            [ChunkJob(memoryview(slot), CT, Transform(), 0, scribble)]
        ).result(timeout=30)
    assert isinstance(outcome, ChunkResult)
    assert outcome.host is not None
    assert outcome.host.tobytes() == want.tobytes()


def test_close_is_idempotent_and_finishes_queued_work() -> None:
    consumed = Consumed()
    device = DeviceThread("cpu")
    device.start()
    futures = [device.submit(chunk_jobs(consumed)[0]) for _ in range(5)]
    device.close()
    device.close()
    assert all(f.done() for f in futures)
    assert sum(consumed.calls.values()) == 15
    with pytest.raises(RuntimeError, match="closed"):
        device.submit([])
    with pytest.raises(RuntimeError, match="closed"):
        device.start()


def test_cancelled_batch_is_still_consumed() -> None:
    consumed = Consumed()
    gate = threading.Event()

    def hold() -> None:
        gate.wait(10)

    with DeviceThread("cpu") as device:
        first = device.submit([ChunkJob(memoryview(bytes(2)), CT, Transform(), 0, hold)])
        second = device.submit(chunk_jobs(consumed)[0])
        assert second.cancel()
        gate.set()
        first.result(timeout=30)
    assert consumed.calls == Counter({0: 1, 1: 1, 2: 1})


def test_empty_batch() -> None:
    with DeviceThread("cpu") as device:
        assert device.submit([]).result(timeout=30) == []


def test_bad_device_name() -> None:
    with pytest.raises(ValueError, match="auto, cuda or cpu"):
        DeviceThread("tpu")  # type: ignore[arg-type]


def test_cuda_without_cuda_is_a_clear_error() -> None:
    why = cuda_unavailable_reason()
    if why is None:
        pytest.skip("CUDA is usable here")
    with pytest.raises(RuntimeError, match="device 'cuda' was asked for, but") as raised:
        DeviceThread("cuda")
    assert why in str(raised.value)
    assert DeviceThread("auto").backend == "cpu"


def test_no_driver_library_is_named_as_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    from ingest_gpu import driver

    def missing() -> int:
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(driver, "device_count", missing)
    assert cuda_unavailable_reason() == (
        "the CUDA driver (libcuda.so.1) cannot be loaded "
        "(libcuda.so.1: cannot open shared object file)"
    )


@pytest.mark.parametrize("nbytes", [0, 1, 4096, 3 * ALIGNMENT + 5])
def test_alloc_host_on_the_thread_is_aligned_and_sized(nbytes: int) -> None:
    before = COUNTERS.snapshot()
    with DeviceThread("cpu") as device:
        buffer = device.alloc_host(nbytes)
        assert device.stats()["host_allocations"] == 1
    assert buffer.address % ALIGNMENT == 0
    assert len(buffer.view) == nbytes
    assert not buffer.view.readonly
    assert not buffer.pinned
    if nbytes:
        buffer.view[0] = 7
        buffer.view[-1] = 9
        assert bytes(buffer.view[-1:]) == b"\x09"
    assert COUNTERS.snapshot()["pageable_allocations"] == before["pageable_allocations"] + 1
    buffer.close()
    buffer.close()
    with pytest.raises(ValueError, match="closed"):
        _ = buffer.view


def test_alloc_host_views_outlive_close() -> None:
    buffer = alloc_host(ALIGNMENT, pinned=False)
    part = buffer.view[10:20]
    buffer.close()
    part[:] = b"x" * 10  # still backed by the mapping, which closes when the last view goes
    assert bytes(part) == b"x" * 10
    part.release()


def test_an_allocation_queued_before_the_set_up_comes_after_it() -> None:
    """The worker launches the device and queues the ring's memory without waiting, then
    starts its clients."""
    device = DeviceThread("cpu")
    try:
        ready = device.launch()
        assert device.launch() is ready  # idempotent
        buffer = device.alloc_host_soon(3 * ALIGNMENT).result(timeout=10)
        assert ready.done()
        assert ready.exception() is None
        assert len(buffer.view) == 3 * ALIGNMENT
        assert device.stats()["host_allocations"] == 1
        buffer.close()
    finally:
        device.close()
    with pytest.raises(RuntimeError, match="closed"):
        device.alloc_host_soon(ALIGNMENT)


def test_a_failed_set_up_fails_what_was_queued_behind_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise OSError("no device here")

    monkeypatch.setattr("ingest_gpu.thread.CpuRunner", broken)
    device = DeviceThread("cpu")
    try:
        ready = device.launch()
        queued = device.alloc_host_soon(ALIGNMENT)
        with pytest.raises(OSError, match="no device here"):
            ready.result(timeout=10)
        with pytest.raises(RuntimeError, match="device setup failed"):
            queued.result(timeout=10)
        with pytest.raises(OSError, match="no device here"):
            device.start()  # the blocking form raises the set-up's own error
    finally:
        device.close()


def test_call_runs_on_the_device_thread_after_queued_work() -> None:
    with DeviceThread("cpu") as thread:
        names: list[str] = []
        first = thread.call(lambda: names.append("first"))
        where = thread.call(lambda: threading.current_thread().name)
        assert where.result(timeout=10) == "dicom-ingest-device"
        assert first.done()
        assert names == ["first"]
        failing = thread.call(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failing.result(timeout=10)
    with pytest.raises(RuntimeError, match="closed"):
        thread.call(lambda: None)
