"""The CUDA twin against the NumPy twin, bit for bit, and the device thread on a real GPU.

Marked ``gpu``; skipped where CuPy is missing or sees no CUDA device. Run on
the device machine with ``python3 -m pytest -m gpu tests/gpu/test_gpu.py -s``
(``-s`` shows the H2D throughput lines).
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import subprocess
import sys
import threading
import time
from typing import Any
from unittest import mock

import numpy as np
import numpy.typing as npt
import pytest

from ingest_gpu import kernel
from ingest_gpu.formats import PixelFormat, Transform
from ingest_gpu.jobs import ChunkJob, ChunkResult
from ingest_gpu.memory import ALIGNMENT, COUNTERS
from ingest_gpu.preprocess import narrowest_exact, preprocess_cupy, preprocess_numpy
from ingest_gpu.thread import DeviceThread

pytestmark = pytest.mark.gpu


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        pytest.skip(f"cupy is not installed ({exc})", allow_module_level=True)
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        pytest.skip(f"no CUDA driver ({exc})", allow_module_level=True)
    if count == 0:
        pytest.skip("no CUDA device", allow_module_level=True)
    return cupy


cp = _cupy()

FORMATS = [
    PixelFormat(37, 41, 3, 1, 8, 8, False, False),
    PixelFormat(37, 41, 3, 1, 8, 5, True, False),
    PixelFormat(37, 41, 3, 1, 16, 12, True, False),
    PixelFormat(37, 41, 3, 1, 16, 10, False, False),
    PixelFormat(37, 41, 3, 1, 16, 16, True, False),
    PixelFormat(37, 41, 3, 1, 32, 32, False, False),
    PixelFormat(37, 41, 3, 1, 32, 20, True, False),
    PixelFormat(37, 41, 3, 1, 32, 31, False, False),
    PixelFormat(19, 23, 3, 3, 8, 8, False, True),
    PixelFormat(19, 23, 3, 3, 8, 8, False, False),
    PixelFormat(19, 23, 3, 3, 16, 12, True, True),
]
TRANSFORMS = [
    Transform(),
    Transform(out_dtype="float16"),
    Transform((1.0,), (-1024.0,), True),
    Transform((0.5, 1 / 3, 3.0), (-1024.0, 0.1, 7.25), True, out_dtype="float16"),
    Transform((1 + 2**-11 + 2**-40,), (0.0,), True, out_dtype="float16"),
    Transform((1.0,), (-1024.0,), True, (40.0, 400.0)),
    Transform((1e-3,), (-0.5,), True, (0.5, 2.0), "float16"),
    Transform(window=(100.0, 1.0)),
    Transform((1e4,), (-1e4,), True, out_dtype="float16"),  # overflows to inf
]


def bits(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
    return a.view(np.uint16 if a.dtype == np.float16 else np.uint32)


def assert_identical(got: npt.NDArray[Any], want: npt.NDArray[Any]) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    mismatch = np.flatnonzero(bits(got) != bits(want))
    assert mismatch.size == 0, f"{mismatch.size} differ, first at {mismatch[:5]}"


def on_gpu(raw: bytes, fmt: PixelFormat, transform: Transform, first: int) -> npt.NDArray[Any]:
    out = preprocess_cupy(cp.asarray(np.frombuffer(raw, np.uint8)), fmt, transform, first)
    return cp.asnumpy(out)  # type: ignore[no-any-return]


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("transform", TRANSFORMS, ids=str)
def test_cupy_matches_numpy(fmt: PixelFormat, transform: Transform) -> None:
    if transform.rescale and len(transform.slopes) not in (1, fmt.frames):
        pytest.skip("per-frame values for another frame count")
    raw = np.random.default_rng(fmt.total_bytes).bytes(fmt.total_bytes)
    whole = preprocess_numpy(np.frombuffer(raw, np.uint8), fmt, transform, 0)
    assert_identical(on_gpu(raw, fmt, transform, 0), whole)
    # a chunk from mid-object (whole frames for planar colour)
    unit = fmt.frame_elements if fmt.planar and fmt.samples == 3 else 1
    first, stop = unit * (fmt.total_elements // unit // 3), fmt.total_elements - unit
    part = raw[first * fmt.itemsize : stop * fmt.itemsize]
    assert_identical(on_gpu(part, fmt, transform, first), whole[first:stop])


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("transform", TRANSFORMS, ids=str)
def test_cupy_matches_numpy_in_the_narrowest_exact_type(
    fmt: PixelFormat, transform: Transform
) -> None:
    """``OUTPUT_DTYPE=exact``: integer, float32 and float64 outputs, the same bytes."""
    if transform.rescale and len(transform.slopes) not in (1, fmt.frames):
        pytest.skip("per-frame values for another frame count")
    exact = dataclasses.replace(transform, out_dtype=narrowest_exact(fmt, transform))
    raw = np.random.default_rng(fmt.total_bytes).bytes(fmt.total_bytes)
    want = preprocess_numpy(np.frombuffer(raw, np.uint8), fmt, exact, 0)
    got = on_gpu(raw, fmt, exact, 0)
    assert got.dtype == want.dtype
    assert got.tobytes() == want.tobytes()


def test_random_formats_and_transforms() -> None:
    rng = np.random.default_rng(2024)
    for _ in range(300):
        allocated = int(rng.choice([8, 16, 32]))
        frames = int(rng.integers(1, 5))
        fmt = PixelFormat(
            int(rng.integers(1, 40)),
            int(rng.integers(1, 40)),
            frames,
            int(rng.choice([1, 3])),
            allocated,
            int(rng.integers(1, allocated + 1)),
            bool(rng.integers(2)),
            bool(rng.integers(2)),
        )
        scale = float(10 ** rng.uniform(-6, 4))
        transform = Transform(
            tuple(rng.normal(0, scale, size=int(rng.choice([1, frames]))).tolist()),
            tuple(rng.normal(0, 1000, size=int(rng.choice([1, frames]))).tolist()),
            bool(rng.integers(2)),
            None if rng.integers(2) else (float(rng.normal(0, 500)), float(rng.uniform(1, 3000))),
            "float16" if rng.integers(2) else "float32",
        )
        raw = rng.bytes(fmt.total_bytes)
        want = preprocess_numpy(np.frombuffer(raw, np.uint8), fmt, transform, 0)
        assert_identical(on_gpu(raw, fmt, transform, 0), want)


def _near_ties(dtype: Any, narrow: Any, count: int) -> npt.NDArray[np.float64]:
    """float64 values on, just above and just below the midpoints between ``narrow`` values."""
    rng = np.random.default_rng(5)
    info = np.iinfo(narrow)
    patterns = rng.integers(0, info.max, size=count, dtype=narrow)
    low, high = patterns.view(dtype), (patterns + 1).view(dtype)
    finite = np.isfinite(low) & np.isfinite(high)
    low, high = low[finite].astype(np.float64), high[finite].astype(np.float64)
    mids = low + (high - low) / 2  # exact in float64
    return np.concatenate([mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf)])


@pytest.mark.parametrize(
    ("out_dtype", "dtype", "narrow"),
    [("float16", np.float16, np.uint16), ("float32", np.float32, np.uint32)],
)
def test_rounding_near_ties_is_single_and_correct(out_dtype: Any, dtype: Any, narrow: Any) -> None:
    values = _near_ties(dtype, narrow, 60_000)
    frames = values.size
    # one sample per frame, stored value 1, per-frame slope = the value: y is exactly the value
    fmt = PixelFormat(1, 1, frames, 1, 8, 8, False, False)
    raw = bytes([1]) * frames
    transform = Transform(tuple(values.tolist()), (0.0,), True, out_dtype=out_dtype)
    want = preprocess_numpy(np.frombuffer(raw, np.uint8), fmt, transform, 0)
    with np.errstate(over="ignore"):
        assert_identical(want, values.astype(dtype))
    assert_identical(on_gpu(raw, fmt, transform, 0), want)


def test_rescale_is_not_contracted_into_an_fma() -> None:
    """intercept = -round(x * slope): separately rounded ops give exactly 0, an FMA would not."""
    rng = np.random.default_rng(17)
    stored = rng.integers(1, 2**31, size=20_000).astype("<i4")
    slopes = rng.uniform(0.001, 1000, size=stored.size)
    intercepts = -(stored.astype(np.float64) * slopes)
    fmt = PixelFormat(1, 1, stored.size, 1, 32, 32, True, False)
    transform = Transform(tuple(slopes.tolist()), tuple(intercepts.tolist()), True)
    want = preprocess_numpy(np.frombuffer(stored.tobytes(), np.uint8), fmt, transform, 0)
    assert not want.any()
    assert_identical(on_gpu(stored.tobytes(), fmt, transform, 0), want)


def test_window_edges_exact() -> None:
    fmt = PixelFormat(1, 1001, 1, 1, 16, 16, True, False)
    raw = np.arange(-500, 501, dtype="<i2").tobytes()
    for window in [(40.0, 400.0), (0.5, 2.0), (0.0, 1.0), (-0.5, 3.0), (100.25, 7.5)]:
        for out_dtype in ("float32", "float16"):
            transform = Transform(window=window, out_dtype=out_dtype)
            want = preprocess_numpy(np.frombuffer(raw, np.uint8), fmt, transform, 0)
            assert_identical(on_gpu(raw, fmt, transform, 0), want)
            assert want.min() == 0.0
            assert want.max() == 1.0


def test_cupy_out_and_stream() -> None:
    fmt = FORMATS[2]
    raw = np.random.default_rng(1).bytes(fmt.total_bytes)
    transform = TRANSFORMS[5]
    stream = cp.cuda.Stream(non_blocking=True)
    out = cp.empty(fmt.total_elements, dtype=np.float32)
    got = preprocess_cupy(cp.asarray(np.frombuffer(raw, np.uint8)), fmt, transform, 0, out, stream)
    stream.synchronize()
    assert got is out
    want = preprocess_numpy(np.frombuffer(raw, np.uint8), fmt, transform, 0)
    assert_identical(cp.asnumpy(out), want)


def _note(consumed: list[int], index: int) -> Any:
    return lambda: consumed.append(index)


def _batch(consumed: list[int]) -> tuple[list[ChunkJob], list[npt.NDArray[Any]]]:
    rng = np.random.default_rng(11)
    jobs, expected = [], []
    for i, (fmt, transform) in enumerate(itertools.product(FORMATS[::2], TRANSFORMS[::3])):
        raw = rng.bytes(fmt.total_bytes)
        jobs.append(ChunkJob(memoryview(raw), fmt, transform, 0, _note(consumed, i), i % 3 == 1))
        expected.append(preprocess_numpy(np.frombuffer(raw, np.uint8), fmt, transform, 0))
    return jobs, expected


def test_cuda_thread_batch_equals_cpu_thread() -> None:
    consumed: list[int] = []
    jobs, expected = _batch(consumed)
    with DeviceThread("cuda") as gpu, DeviceThread("cpu") as cpu:
        assert gpu.backend == "cuda"
        on_gpu_results = gpu.submit(jobs).result(timeout=60)
        on_cpu_results = cpu.submit(jobs).result(timeout=60)
    assert sorted(consumed) == sorted(list(range(len(jobs))) * 2)
    for job, g, c, want in zip(jobs, on_gpu_results, on_cpu_results, expected, strict=True):
        assert isinstance(g, ChunkResult)
        assert isinstance(c, ChunkResult)
        assert g.backend == "cuda"
        assert g.host is not None
        assert c.host is not None
        assert_identical(g.host, c.host)
        assert_identical(g.host, want)
        if job.keep_on_device:
            assert_identical(cp.asnumpy(g.device), want)
        else:
            assert g.device is None


def test_pitched_frames_go_over_as_one_2d_copy_and_equal_the_twin() -> None:
    """Frames one every ``pitch`` bytes of a pinned slot (Encapsulated Uncompressed: an
    item header between frames) in one batch with contiguous jobs: the 2-D copy leaves
    the bytes between frames behind, on the device and in the twin alike."""
    rng = np.random.default_rng(21)
    jobs, expected = [], []
    with DeviceThread("cuda") as device, DeviceThread("cpu") as cpu:
        slots = []
        for i, fmt in enumerate(FORMATS):
            pitch = fmt.frame_bytes + 8 + fmt.frame_bytes % 2
            span = (fmt.frames - 1) * pitch + fmt.frame_bytes
            slot = device.alloc_host(span)
            slots.append(slot)
            host = np.frombuffer(slot.view, np.uint8)
            host[:] = np.frombuffer(rng.bytes(span), np.uint8)
            rows = np.lib.stride_tricks.as_strided(host, (fmt.frames, fmt.frame_bytes), (pitch, 1))
            samples = np.ascontiguousarray(rows).ravel()
            transform = TRANSFORMS[i % len(TRANSFORMS)]
            keep = i % 2 == 1
            jobs.append(ChunkJob(slot.view, fmt, transform, 0, lambda: None, keep, pitch=pitch))
            jobs.append(ChunkJob(memoryview(samples.tobytes()), fmt, transform, 0, lambda: None))
            want = preprocess_numpy(samples, fmt, transform, 0)
            expected += [want, want]
        on_gpu = device.submit(jobs).result(timeout=60)
        on_cpu = cpu.submit(jobs).result(timeout=60)
        stats = device.stats()
    for job, g, c, want in zip(jobs, on_gpu, on_cpu, expected, strict=True):
        assert isinstance(g, ChunkResult)
        assert isinstance(c, ChunkResult)
        assert g.host is not None
        assert c.host is not None
        assert_identical(g.host, want)
        assert_identical(c.host, want)
        if job.keep_on_device:
            assert_identical(cp.asnumpy(g.device), want)
    assert stats["bytes_h2d"] == sum(2 * fmt.total_bytes for fmt in FORMATS)
    assert stats["pageable_h2d_jobs"] == len(FORMATS)  # the contiguous copies' bytes


def test_keep_on_device_without_host_copy_and_a_bad_job() -> None:
    fmt, transform = FORMATS[2], TRANSFORMS[5]
    raw = np.random.default_rng(4).bytes(fmt.total_bytes)
    want = preprocess_numpy(np.frombuffer(raw, np.uint8), fmt, transform, 0)
    calls: list[str] = []
    good = ChunkJob(memoryview(raw), fmt, transform, 0, lambda: calls.append("good"), True, False)
    bad = ChunkJob(memoryview(raw[:3]), fmt, transform, 0, lambda: calls.append("bad"))
    with DeviceThread("cuda") as device:
        result, error = device.submit([good, bad]).result(timeout=60)
    assert isinstance(result, ChunkResult)
    assert result.host is None
    assert_identical(cp.asnumpy(result.device), want)
    assert isinstance(error, ValueError)
    assert sorted(calls) == ["bad", "good"]


def test_many_chunks_split_into_several_launches() -> None:
    consumed: list[int] = []
    jobs, expected = _batch(consumed)
    with mock.patch.object(kernel, "MAX_GRID_Y", 3), DeviceThread("cuda") as device:
        results = device.submit(jobs).result(timeout=60)
    for result, want in zip(results, expected, strict=True):
        assert isinstance(result, ChunkResult)
        assert result.host is not None
        assert_identical(result.host, want)


def test_the_kernel_is_the_shipped_build_and_nvrtc_stays_unloaded() -> None:
    """On an architecture the package ships a cubin for, a fresh process loads it and
    never maps NVRTC (no compile at start-up; 41-82 MiB less resident), and the device
    thread never imports CuPy (~160 MiB)."""
    capability = str(cp.cuda.Device().compute_capability)
    if kernel.shipped_cubin(capability) is None:
        pytest.skip(f"no shipped cubin for sm_{capability}")
    probe = (
        "from ingest_gpu.thread import DeviceThread\n"
        "from ingest_gpu import kernel\n"
        "from ingest_gpu.formats import PixelFormat, Transform\n"
        "from ingest_gpu.jobs import ChunkJob\n"
        "fmt = PixelFormat(512, 512, 1, 1, 16, 12, True, False)\n"
        "job = ChunkJob(memoryview(bytes(fmt.total_bytes)), fmt, Transform(), 0, lambda: None)\n"
        "with DeviceThread('cuda') as device:\n"
        "    device.submit([job]).result(timeout=60)\n"
        "    print(kernel.compile_kernel())\n"
        "    maps = open('/proc/self/maps').read()\n"
        "    print('nvrtc' if 'libnvrtc' in maps else 'no-nvrtc')\n"
        "import sys\n"
        "print('cupy' if 'cupy' in sys.modules else 'no-cupy')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["shipped", "no-nvrtc", "no-cupy"], done.stderr


def test_the_nvrtc_build_matches_numpy_where_no_cubin_is_shipped() -> None:
    """The fallback (another GPU, or a kernel changed since the build) is the same kernel."""
    kernel._kernel.cache_clear()
    try:
        with mock.patch.object(kernel, "shipped_cubin", return_value=None):
            assert kernel.compile_kernel() == "nvrtc"
            rng = np.random.default_rng(7)
            for fmt in FORMATS:
                for transform in TRANSFORMS[2:6]:
                    if transform.rescale and len(transform.slopes) not in (1, fmt.frames):
                        continue
                    raw = rng.bytes(fmt.total_bytes)
                    want = preprocess_numpy(np.frombuffer(raw, np.uint8), fmt, transform, 0)
                    assert_identical(on_gpu(raw, fmt, transform, 0), want)
    finally:
        kernel._kernel.cache_clear()


def test_pinned_alloc_host() -> None:
    with DeviceThread("cuda") as device:
        buffer = device.alloc_host(3 * ALIGNMENT + 5)
        attrs = cp.cuda.runtime.pointerGetAttributes(buffer.address)
    assert buffer.pinned
    assert buffer.address % ALIGNMENT == 0
    assert len(buffer.view) == 3 * ALIGNMENT + 5
    assert int(attrs.type) == int(getattr(cp.cuda.runtime, "memoryTypeHost", 1))
    buffer.close()


def _locked_kib() -> int:
    """Resident shared memory of this process (where CUDA's pinned allocations show), KiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssShmem:"))


def test_pinned_memory_is_the_size_asked_for_and_freed_on_close() -> None:
    """CuPy's pinned pool would lock 128 MiB for this and keep it after the close."""
    nbytes = 96 * 1024 * 1024
    with DeviceThread("cuda") as device:
        before = _locked_kib()
        buffer = device.alloc_host(nbytes)
        grew = _locked_kib() - before
        buffer.close()
        after = _locked_kib() - before
    assert nbytes // 1024 <= grew < (nbytes + 8 * ALIGNMENT) // 1024
    assert after < 8 * 1024


def test_on_consumed_fires_after_the_copy() -> None:
    """Scribbling over the slot in on_consumed must not reach the result."""
    fmt = PixelFormat(4096, 4096, 2, 1, 16, 12, True, False)  # 64 MiB
    transform = Transform((1.0,), (-1024.0,), True, (40.0, 400.0))
    threads: list[str] = []
    with DeviceThread("cuda") as device:
        slot = device.alloc_host(fmt.total_bytes)
        host = np.frombuffer(slot.view, np.uint8)
        host[:] = np.frombuffer(np.random.default_rng(9).bytes(fmt.total_bytes), np.uint8)
        want = preprocess_numpy(host.copy(), fmt, transform, 0)

        def scribble() -> None:
            threads.append(threading.current_thread().name)
            host[:] = 0xFF

        job = ChunkJob(slot.view, fmt, transform, 0, scribble)
        (result,) = device.submit([job]).result(timeout=60)
        stats = device.stats()
    assert threads == ["dicom-ingest-device"]
    assert isinstance(result, ChunkResult)
    assert result.host is not None
    assert_identical(result.host, want)
    assert stats["pageable_h2d_jobs"] == 0


def test_no_allocation_in_steady_state() -> None:
    fmt = PixelFormat(512, 512, 1, 1, 16, 12, True, False)
    transform = Transform((1.0,), (-1024.0,), True, (40.0, 400.0), "float16")
    watched = ("device_allocations", "pinned_staging_allocations", "device_result_arrays")
    pool = cp.get_default_memory_pool()
    with DeviceThread("cuda") as device:
        slots = [device.alloc_host(fmt.total_bytes) for _ in range(8)]
        jobs = [ChunkJob(s.view, fmt, transform, 0, lambda: None) for s in slots]
        device.submit(jobs).result(timeout=60)  # warm-up: arenas grow once
        before, host_before = device.stats(), COUNTERS.snapshot()
        pool_before = pool.total_bytes()
        for _ in range(100):
            outcomes = device.submit(jobs).result(timeout=60)
        after = device.stats()
    assert all(isinstance(o, ChunkResult) for o in outcomes)
    assert {k: after[k] for k in watched} == {k: before[k] for k in watched}
    assert COUNTERS.snapshot() == host_before
    assert pool.total_bytes() == pool_before
    assert after["batches"] == before["batches"] + 100


def test_h2d_throughput_report() -> None:
    """Not asserted: prints H2D GB/s from pinned slots and from pageable bytes, and kernel GB/s."""
    fmt = PixelFormat(4096, 4096, 1, 1, 16, 12, True, False)  # 32 MiB per chunk
    transform = Transform((1.0,), (-1024.0,), True, (40.0, 400.0))
    with DeviceThread("cuda") as device:
        ring = device.alloc_host(8 * fmt.total_bytes)
        size = fmt.total_bytes
        pinned = [ring.view[i * size : (i + 1) * size] for i in range(8)]
        pageable = [memoryview(bytearray(size)) for _ in range(8)]
        # 63 frames of 512 x 512 a fragment each (Encapsulated Uncompressed) in 32 MiB
        tile = PixelFormat(512, 512, 63, 1, 16, 12, True, False)
        pitch = tile.frame_bytes + 8
        span = 62 * pitch + tile.frame_bytes
        pitched = [ring.view[i * size : i * size + span] for i in range(8)]
        for name, views in (("pinned", pinned), ("pageable", pageable), ("pitched", pitched)):
            if name == "pitched":
                jobs = [ChunkJob(v, tile, transform, 0, lambda: None, pitch=pitch) for v in views]
                size = tile.total_bytes
            else:
                jobs = [ChunkJob(v, fmt, transform, 0, lambda: None) for v in views]
            device.submit(jobs).result(timeout=60)
            started = time.perf_counter()
            results = device.submit(jobs).result(timeout=60)
            wall = time.perf_counter() - started
            ok = [r for r in results if isinstance(r, ChunkResult)]
            h2d = sum(r.h2d_seconds for r in ok)
            kernel_s = ok[0].kernel_seconds
            print(
                f"\n{name}: H2D {8 * size / h2d / 1e9:.1f} GB/s over 8 x {size >> 20} MiB; "
                f"kernel {8 * size * 3 / kernel_s / 1e9:.0f} GB/s (in+out); "
                f"batch wall {wall * 1e3:.1f} ms"
            )


def test_enqueue_copies_both_ways_and_times_them_with_events() -> None:
    from ingest_gpu import driver
    from ingest_gpu.enqueue import Enqueue

    context = driver.primary_context(0)
    issue = Enqueue()
    stream = driver.Stream(context)
    host_in = driver.pinned_array(context, 1 << 20)
    host_out = driver.pinned_array(context, 1 << 20)
    source = np.frombuffer(memoryview(host_in), dtype=np.uint8)
    source[:] = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
    device = driver.DeviceMemory(context, 1 << 20)
    before, after = driver.Event(context), driver.Event(context)
    issue.record(before, stream)
    issue.h2d(device.ptr, ctypes.addressof(host_in), 1 << 20, stream)
    issue.record(after, stream)
    issue.d2h(ctypes.addressof(host_out), device.ptr, 1 << 20, stream)
    stream.synchronize()
    assert np.array_equal(np.frombuffer(memoryview(host_out), dtype=np.uint8), source)
    assert driver.elapsed_ms(before, after) > 0
    assert driver.memory_type(ctypes.addressof(host_in)) == driver.MEMORYTYPE_HOST
    assert driver.memory_type(device.ptr) == driver.MEMORYTYPE_DEVICE
    assert driver.memory_type(np.zeros(16).ctypes.data) == 0  # pageable
    for resource in (device, before, after, stream):
        resource.close()


def test_driver_errors_name_the_call_and_out_of_memory_is_a_memory_error() -> None:
    from ingest_gpu import driver

    context = driver.primary_context(0)
    cubin = kernel.shipped_cubin(context.compute_capability)
    if cubin is None:
        pytest.skip(f"no shipped cubin for sm_{context.compute_capability}")
    with pytest.raises(driver.CudaError, match=r"cuModuleGetFunction failed: CUDA error 500"):
        driver.Module(cubin, "no_such_kernel")
    with pytest.raises(MemoryError, match="cuMemAlloc_v2 failed"):
        driver.DeviceMemory(context, 1 << 52)
