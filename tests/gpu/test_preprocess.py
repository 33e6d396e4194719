"""The NumPy twin of the preprocessing kernel against a naive reference, bit for bit."""

from __future__ import annotations

import dataclasses
import itertools
import math
import struct
import tracemalloc
from fractions import Fraction
from typing import Any
from unittest import mock

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ingest_gpu.preprocess
from ingest_gpu.formats import PixelFormat, Transform
from ingest_gpu.preprocess import plan_chunk, preprocess_numpy


def reference(raw: bytes, fmt: PixelFormat, transform: Transform) -> npt.NDArray[Any]:
    """The whole object, written as plainly as possible: 1-D, output order."""
    stored = np.frombuffer(raw, dtype=fmt.stored_dtype).astype(np.int64)
    bits = fmt.bits_stored
    values = stored & ((1 << bits) - 1)  # the low bits_stored bits...
    if fmt.signed:  # ...read as a two's complement number of bits_stored bits
        values = np.where(values >= 1 << (bits - 1), values - (1 << bits), values)
    frames = values.astype(np.float64).reshape(fmt.frames, fmt.frame_elements)
    result = np.empty_like(frames)
    for f in range(fmt.frames):
        y = frames[f]
        if transform.rescale:
            slope = transform.slopes[f if len(transform.slopes) > 1 else 0]
            intercept = transform.intercepts[f if len(transform.intercepts) > 1 else 0]
            y = y * slope + intercept
        if transform.window is not None:
            center, width = transform.window
            if width == 1:
                y = np.where(y > center - 0.5, 1.0, 0.0)
            else:
                y = np.clip((y - (center - 0.5)) / (width - 1) + 0.5, 0, 1)
        result[f] = y
    with np.errstate(over="ignore"):
        out = result.astype(transform.out_dtype)
    if fmt.samples == 3 and fmt.planar:
        pixels = fmt.rows * fmt.columns
        return np.ascontiguousarray(out.reshape(fmt.frames, 3, pixels).transpose(0, 2, 1)).ravel()
    return out.ravel()


def bits(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
    return a.view(np.uint16 if a.dtype == np.float16 else np.uint32)


def assert_identical(got: npt.NDArray[Any], want: npt.NDArray[Any]) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert np.array_equal(bits(got), bits(want))


def run(raw: bytes, fmt: PixelFormat, transform: Transform, first: int = 0) -> npt.NDArray[Any]:
    return preprocess_numpy(np.frombuffer(raw, dtype=np.uint8), fmt, transform, first)


FINITE = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False)
ODD_VALUES = st.sampled_from([1.0, 0.5, -1.0, 1 / 3, 1e-7, 0.0, -0.0, 1 + 2**-11 + 2**-40])


@st.composite
def formats(draw: st.DrawFn) -> PixelFormat:
    allocated = draw(st.sampled_from([8, 16, 32]))
    return PixelFormat(
        rows=draw(st.integers(1, 5)),
        columns=draw(st.integers(1, 5)),
        frames=draw(st.integers(1, 4)),
        samples=draw(st.sampled_from([1, 3])),
        bits_allocated=allocated,
        bits_stored=draw(st.integers(1, allocated)),
        signed=draw(st.booleans()),
        planar=draw(st.booleans()),
    )


@st.composite
def per_frame(draw: st.DrawFn, frames: int) -> tuple[float, ...]:
    count = draw(st.sampled_from([1, frames]))
    return tuple(draw(st.lists(FINITE | ODD_VALUES, min_size=count, max_size=count)))


@st.composite
def transforms(draw: st.DrawFn, frames: int) -> Transform:
    widths = st.floats(1, 5000) | st.sampled_from([1.0, 2.0, 1.5, 4096.0])
    return Transform(
        slopes=draw(per_frame(frames)),
        intercepts=draw(per_frame(frames)),
        rescale=draw(st.booleans()),
        window=draw(st.none() | st.tuples(FINITE, widths)),
        out_dtype=draw(st.sampled_from(["float32", "float16"])),
    )


@st.composite
def cases(draw: st.DrawFn) -> tuple[PixelFormat, Transform, bytes, list[int]]:
    fmt = draw(formats())
    transform = draw(transforms(fmt.frames))
    seed = draw(st.integers(0, 2**32 - 1))
    raw = np.random.default_rng(seed).bytes(fmt.total_bytes)  # garbage in the unused bits too
    unit = fmt.frame_elements if fmt.planar and fmt.samples == 3 else 1
    cuts = draw(st.lists(st.integers(0, fmt.total_elements // unit), max_size=5))
    return fmt, transform, raw, sorted({0, *(c * unit for c in cuts), fmt.total_elements})


@settings(max_examples=400, deadline=None)
@given(case=cases(), block=st.sampled_from([3, 7, 64, ingest_gpu.preprocess.BLOCK_ELEMENTS]))
def test_matches_reference_and_splits_concatenate(
    case: tuple[PixelFormat, Transform, bytes, list[int]], block: int
) -> None:
    fmt, transform, raw, cuts = case
    want = reference(raw, fmt, transform)
    with mock.patch.object(ingest_gpu.preprocess, "BLOCK_ELEMENTS", block):
        assert_identical(run(raw, fmt, transform), want)
        size = fmt.itemsize
        parts = [
            run(raw[a * size : b * size], fmt, transform, first=a)
            for a, b in itertools.pairwise(cuts)
        ]
    assert_identical(np.concatenate(parts), want)


def test_ct_slice_with_garbage_high_bits() -> None:
    fmt = PixelFormat(1, 4, 1, 1, 16, 12, True, False)
    stored = np.array([0xF400, 0x0FFF, 0xA7FF, 0x5800], dtype="<u2")  # 1024, -1, 2047, -2048
    transform = Transform((1.0,), (-1024.0,), rescale=True)
    got = run(stored.tobytes(), fmt, transform)
    assert got.tolist() == [0.0, -1025.0, 1023.0, -3072.0]
    windowed = run(stored.tobytes(), fmt, Transform((1.0,), (-1024.0,), True, (40.0, 400.0)))
    assert_identical(
        windowed,
        reference(stored.tobytes(), fmt, Transform((1.0,), (-1024.0,), True, (40.0, 400.0))),
    )
    assert windowed[0] == np.float32((0.0 - 39.5) / 399 + 0.5)
    assert windowed[1] == 0.0
    assert windowed[2] == 1.0


def test_unsigned_masks_unused_bits() -> None:
    fmt = PixelFormat(1, 2, 1, 1, 8, 3, False, False)
    assert run(bytes([0xFF, 0xF9]), fmt, Transform()).tolist() == [7.0, 1.0]
    signed = PixelFormat(1, 2, 1, 1, 8, 3, True, False)
    assert run(bytes([0xFF, 0xF9]), signed, Transform()).tolist() == [-1.0, 1.0]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (
            1 + 2**-11 + 2**-40,
            0x3C01,
        ),  # just above a tie: up (float32 first would round it to the tie, then down)
        (1 + 2**-11, 0x3C00),  # a tie: to even
        (1 + 3 * 2**-11, 0x3C02),  # a tie: to even, upwards
        (65520.0, 0x7C00),  # rounds past the largest half: inf, without a warning
        (2**-25 + 2**-40, 0x0001),  # just above half the smallest subnormal
    ],
)
def test_float16_is_one_correct_rounding(value: float, expected: int) -> None:
    fmt = PixelFormat(1, 1, 1, 1, 16, 16, False, False)
    one = np.array([1], dtype="<u2").tobytes()
    got = run(one, fmt, Transform((value,), (0.0,), rescale=True, out_dtype="float16"))
    assert int(bits(got)[0]) == expected
    if expected != 0x7C00:  # struct refuses to pack what rounds to inf
        assert expected == struct.unpack("<H", struct.pack("<e", value))[0]


def test_rescale_rounds_product_and_sum_separately() -> None:
    """intercept = -round(x * slope) leaves exactly 0, where a fused multiply-add would not."""
    stored = np.array([3, 12345, 2**31 - 1], dtype="<i4")
    slopes = (0.1, 1 / 3, 0.7)
    intercepts = tuple(-(float(x) * s) for x, s in zip(stored.tolist(), slopes, strict=True))
    fmt = PixelFormat(1, 1, 3, 1, 32, 32, True, False)
    got = run(stored.tobytes(), fmt, Transform(slopes, intercepts, rescale=True))
    assert got.tolist() == [0.0, 0.0, 0.0]
    # the exact x * slope + intercept, which one fused operation would round, is not 0
    exact = [
        Fraction(int(x)) * Fraction(sl) + Fraction(c)
        for x, sl, c in zip(stored, slopes, intercepts, strict=True)
    ]
    assert all(exact)


def test_window_width_one_is_a_step_and_edges_are_exact() -> None:
    fmt = PixelFormat(1, 5, 1, 1, 16, 16, True, False)
    raw = np.array([-1, 0, 1, 2, 3], dtype="<i2").tobytes()
    assert run(raw, fmt, Transform(window=(1.0, 1.0))).tolist() == [0, 0, 1, 1, 1]
    # center 1, width 3: x <= -0.5 -> 0, x = 0.5 -> 0.5, x >= 1.5 -> 1
    assert run(raw, fmt, Transform(window=(1.0, 3.0))).tolist() == [0, 0.25, 0.75, 1, 1]


def test_planar_rgb_is_interleaved_from_a_later_frame() -> None:
    fmt = PixelFormat(1, 2, 2, 3, 8, 8, False, True)
    raw = bytes([0, 0, 0, 0, 0, 0, 1, 2, 11, 12, 21, 22])  # frame 1: R=1,2 G=11,12 B=21,22
    got = run(raw[6:], fmt, Transform(), first=6)
    assert got.tolist() == [1, 11, 21, 2, 12, 22]


def test_per_frame_rescale_over_many_small_frames() -> None:
    fmt = PixelFormat(1, 2, 300, 1, 16, 16, False, False)
    raw = np.arange(600, dtype="<u2").tobytes()
    transform = Transform(tuple(float(f) for f in range(300)), (0.5,), rescale=True)
    assert_identical(run(raw, fmt, transform), reference(raw, fmt, transform))
    assert_identical(
        run(raw[202:], fmt, transform, first=101), reference(raw, fmt, transform)[101:]
    )


def test_writes_into_out_with_bounded_temporaries() -> None:
    n = 4 << 20
    fmt = PixelFormat(1, n, 1, 1, 16, 12, True, False)
    raw = np.frombuffer(np.random.default_rng(1).bytes(2 * n), dtype=np.uint8)
    out = np.empty(n, dtype=np.float32)
    transform = Transform((2.0,), (-1.0,), True, (40.0, 400.0))
    tracemalloc.start()
    try:
        result = preprocess_numpy(raw, fmt, transform, 0, out=out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result is out
    assert peak < 16 << 20  # one float64 temporary of the chunk alone would be 32 MiB
    assert_identical(out, reference(raw.tobytes(), fmt, transform))


@pytest.mark.parametrize(
    ("fmt", "transform", "nbytes", "first", "match"),
    [
        (PixelFormat(2, 2, 1, 1, 16, 16, False, False), Transform(), 3, 0, "whole"),
        (PixelFormat(2, 2, 1, 1, 16, 16, False, False), Transform(), 8, 1, "outside"),
        (PixelFormat(2, 2, 1, 1, 16, 17, False, False), Transform(), 8, 0, "bits stored"),
        (PixelFormat(2, 2, 1, 1, 12, 12, False, False), Transform(), 8, 0, "bits allocated"),
        (PixelFormat(1, 1, 2, 3, 8, 8, False, True), Transform(), 3, 1, "whole frames"),
        (
            PixelFormat(1, 1, 3, 1, 8, 8, False, False),
            Transform((1.0, 2.0), rescale=True),
            3,
            0,
            "2 rescale slopes for 3 frames",
        ),
        (
            PixelFormat(1, 1, 1, 1, 8, 8, False, False),
            Transform(window=(0.0, 0.5)),
            1,
            0,
            "width >= 1",
        ),
        (
            PixelFormat(1, 1, 1, 1, 8, 8, False, False),
            Transform((float("nan"),), rescale=True),
            1,
            0,
            "finite",
        ),
    ],
)
def test_rejects_bad_chunks(
    fmt: PixelFormat, transform: Transform, nbytes: int, first: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        preprocess_numpy(np.zeros(nbytes, dtype=np.uint8), fmt, transform, first)


def test_rejects_wrong_out() -> None:
    fmt = PixelFormat(1, 4, 1, 1, 8, 8, False, False)
    with pytest.raises(ValueError, match="out must be"):
        preprocess_numpy(np.zeros(4, np.uint8), fmt, Transform(), 0, out=np.empty(4, np.float16))


def test_a_chunk_plan_carries_only_the_values_of_the_frames_it_covers() -> None:
    fmt = PixelFormat(2, 2, 1000, 1, 16, 16, False, False)  # 4 samples a frame
    slopes = tuple(float(f) + 1 for f in range(1000))
    transform = Transform(slopes, (0.0,), rescale=True)
    plan = plan_chunk(2 * 10, fmt, transform, first_element=4 * 500 + 2)  # frames 500-503
    assert (plan.frame0, plan.slopes, plan.intercepts) == (500, slopes[500:503], (0.0,))
    broken = Transform((*slopes[:900], math.inf, *slopes[901:]), (0.0,), rescale=True)
    plan_chunk(2 * 10, fmt, broken, first_element=4 * 500 + 2)  # frame 900 is not its concern
    with pytest.raises(ValueError, match="finite"):
        plan_chunk(2 * 4, fmt, broken, first_element=4 * 900)


DYADIC_SLOPES = st.builds(lambda k, j: k / 2**j, st.integers(-64, 64), st.integers(0, 4))
DYADIC_INTERCEPTS = st.builds(lambda k, j: k / 2**j, st.integers(-4096, 4096), st.integers(0, 3))


@st.composite
def dyadic_cases(draw: st.DrawFn) -> tuple[PixelFormat, Transform, bytes]:
    """Rescales whose every value is exact in float32 for narrow samples (CT's 1 and
    -1024 among them), on every format: the float32 path where it applies."""
    fmt = draw(formats())
    count = draw(st.sampled_from([1, fmt.frames]))
    transform = Transform(
        slopes=tuple(draw(st.lists(DYADIC_SLOPES, min_size=count, max_size=count))),
        intercepts=tuple(draw(st.lists(DYADIC_INTERCEPTS, min_size=1, max_size=1))),
        rescale=draw(st.booleans()),
        out_dtype=draw(st.sampled_from(["float32", "float16"])),
    )
    raw = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).bytes(fmt.total_bytes)
    return fmt, transform, raw


@settings(max_examples=400, deadline=None)
@given(case=dyadic_cases(), block=st.sampled_from([3, 64, ingest_gpu.preprocess.BLOCK_ELEMENTS]))
def test_the_float32_path_gives_the_float64_paths_bits(
    case: tuple[PixelFormat, Transform, bytes], block: int
) -> None:
    fmt, transform, raw = case
    with mock.patch.object(ingest_gpu.preprocess, "BLOCK_ELEMENTS", block):
        fast = run(raw, fmt, transform)
        with mock.patch.object(ingest_gpu.preprocess, "exact_in_float32", return_value=False):
            slow = run(raw, fmt, transform)
    assert_identical(fast, slow)
    assert_identical(fast, reference(raw, fmt, transform))


@pytest.mark.parametrize(
    ("bits", "slopes", "intercepts", "window", "exact"),
    [
        ((16, 12), (1.0,), (-1024.0,), None, True),  # a CT slice
        ((16, 16), (0.5, 0.75, 1.0, 1.25), (-1024.0,), None, True),  # the bench's large object
        ((16, 16), (1.0,), (-1024.0,), (40.0, 400.0), False),  # a window divides
        ((16, 16), (1 / 3,), (0.0,), None, False),  # not a power-of-two fraction
        ((16, 16), (255.0,), (0.0,), None, True),  # 2^16 x 255 < 2^24
        ((16, 16), (256.0,), (0.0,), None, False),  # 2^16 x 256 = 2^24
        ((32, 32), (1.0,), (0.0,), None, False),  # 32-bit samples do not fit
        ((32, 20), (1.0,), (0.0,), None, True),  # 20 bits stored do
        ((16, 16), (2.0**-70,), (0.0,), None, False),  # too fine a unit
    ],
)
def test_which_chunks_take_the_float32_path(
    bits: tuple[int, int],
    slopes: tuple[float, ...],
    intercepts: tuple[float, ...],
    window: tuple[float, float] | None,
    exact: bool,
) -> None:
    fmt = PixelFormat(2, 2, len(slopes), 1, bits[0], bits[1], True, False)
    transform = Transform(slopes, intercepts, True, window)
    plan = plan_chunk(fmt.total_bytes, fmt, transform, 0)
    assert ingest_gpu.preprocess.exact_in_float32(plan) is exact
    raw = np.random.default_rng(3).bytes(fmt.total_bytes)
    assert_identical(run(raw, fmt, transform), reference(raw, fmt, transform))


@pytest.mark.parametrize(
    ("fmt", "transform", "expected"),
    [
        (PixelFormat(4, 4, 2, 3, 8, 8, False, False), Transform(), "uint8"),  # 8-bit colour
        (PixelFormat(4, 4, 2, 1, 8, 8, False, False), Transform(), "uint8"),
        (PixelFormat(4, 4, 1, 1, 8, 7, True, False), Transform(), "int8"),
        (PixelFormat(4, 4, 1, 1, 16, 12, False, False), Transform(), "uint16"),
        # CT: 12 bits stored, signed, slope 1, intercept -1024
        (
            PixelFormat(4, 4, 2, 1, 16, 12, True, False),
            Transform((1.0,), (-1024.0,), True),
            "int16",
        ),
        # unsigned 16 bits less 1024 no longer fit int16
        (
            PixelFormat(4, 4, 1, 1, 16, 16, False, False),
            Transform((1.0,), (-1024.0,), True),
            "int32",
        ),
        (PixelFormat(4, 4, 1, 1, 8, 8, False, False), Transform((2.0,), (-1.0,), True), "int16"),
        # non-integer slopes: float32 while every value is exact in it, else float64
        (
            PixelFormat(4, 4, 2, 1, 16, 12, True, False),
            Transform((0.5,), (-100.0,), True),
            "float32",
        ),
        (PixelFormat(4, 4, 2, 1, 16, 16, True, False), Transform((0.1,), (0.0,), True), "float64"),
        (
            PixelFormat(4, 4, 3, 1, 16, 12, True, False),
            Transform((0.5, 0.75, 1.0), (-1024.0, -1016.0, -1008.0), True),
            "float32",
        ),
        (
            PixelFormat(4, 4, 1, 1, 32, 32, False, False),
            Transform((1.0,), (-1.0,), True),
            "float64",
        ),
        # a window's values are float32, rounded once as ever
        (PixelFormat(4, 4, 1, 1, 16, 12, True, False), Transform(window=(40.0, 400.0)), "float32"),
    ],
)
def test_narrowest_exact_holds_every_value_exactly(
    fmt: PixelFormat, transform: Transform, expected: str
) -> None:
    chosen = ingest_gpu.preprocess.narrowest_exact(fmt, transform)
    assert chosen == expected
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, fmt.total_bytes, dtype=np.uint8)
    info = np.iinfo(fmt.stored_dtype)  # the extremes of the stored range are in it too
    extremes = np.array([info.min, info.max], dtype=fmt.stored_dtype).view(np.uint8)
    raw[: extremes.size] = extremes
    exact = dataclasses.replace(transform, out_dtype=chosen)
    got = preprocess_numpy(raw, fmt, exact, 0)
    assert got.dtype == np.dtype(chosen)
    assert_identical(got, reference(raw.tobytes(), fmt, exact))
    if transform.window is None:  # the values themselves, not a rounding of them
        as_float64 = dataclasses.replace(transform, out_dtype="float64")
        np.testing.assert_array_equal(
            got.astype(np.float64), preprocess_numpy(raw, fmt, as_float64, 0)
        )
        assert np.array_equal(got.astype(np.float64), reference(raw.tobytes(), fmt, as_float64))


def test_integer_outputs_refuse_a_window() -> None:
    fmt = PixelFormat(2, 2, 1, 1, 8, 8, False, False)
    with pytest.raises(ValueError, match="windowed"):
        plan_chunk(4, fmt, Transform(window=(1.0, 2.0), out_dtype="uint8"), 0)
