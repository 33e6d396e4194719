"""Preprocessing of raw stored samples: the NumPy twin and the CuPy entry point.

Both twins give bit-identical results (``formats.Transform``; docs/output.md). Per stored
sample, in this order, all in float64 until the last step (the NumPy twin
works in float32 where that gives the same bits: ``exact_in_float32``):

1. unused-bit correction as pydicom 3's native decoder does it:
   ``x = (x << s) >> s`` in the stored integer type, ``s = bits_allocated - bits_stored``;
2. rescale ``x * slope[f] + intercept[f]``, two separately rounded operations;
3. window ``clip((x - (c - 0.5)) / (w - 1) + 0.5, 0, 1)``; for ``w == 1`` the
   DICOM step (``x > c - 0.5``), since the formula divides by zero there;
4. one correctly rounded cast to ``out_dtype`` (an integer ``out_dtype`` only where
   every value is an integer it holds: ``narrowest_exact``);
5. planar colour is written interleaved: ``out[f, p, s] = in[f, s, p]``.

``plan_chunk`` validates a chunk and fixes every constant (``c - 0.5`` and
``w - 1`` are computed once, here) so that both twins use the same numbers.
The CUDA side of the twin lives in ``ingest_gpu.kernel``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ingest_gpu.formats import OUT_DTYPES, OutDtype, PixelFormat, Transform

# The NumPy twin works through the chunk in blocks of this many samples, so
# its temporaries stay at a few MiB whatever the chunk size.
BLOCK_ELEMENTS = 1 << 18

# Bits of ChunkPlan.flags; ingest_gpu.kernel's CUDA source uses the same values.
F_RESCALE = 1
F_WINDOW = 2
F_STEP = 4
F_PLANAR = 8
F_HALF = 16
F_PER_FRAME = 32
# (F_HALF is kept for the kernel's flags word; the output type is ``ChunkPlan.out_code``)

DTYPE_CODES = {"<u1": 0, "<i1": 1, "<u2": 2, "<i2": 3, "<u4": 4, "<i4": 5}

# Per-frame rescale of a block: one pair of scalar ufunc calls per frame up to
# this many frames in the block, a gather of per-sample parameters beyond it.
_MAX_FRAME_LOOP = 64


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """A validated chunk: everything either twin needs, with its constants fixed."""

    n: int  # samples in the chunk
    first_element: int
    frame_elements: int
    plane_elements: int  # rows * columns
    stored_dtype: str
    dtype_code: int
    shift: int  # bits_allocated - bits_stored
    flags: int
    slopes: tuple[float, ...]  # one value, or those of frames frame0.. that the chunk covers
    intercepts: tuple[float, ...]
    frame0: int  # the object frame of slopes[0] when the values are per frame
    low: float  # window center - 0.5
    span: float  # window width - 1
    out_dtype: str
    out_code: int = 0  # index of out_dtype in formats.OUT_DTYPES (the kernel's OUT)

    @property
    def out_nbytes(self) -> int:
        return self.n * np.dtype(self.out_dtype).itemsize


def plan_chunk(
    nbytes: int, fmt: PixelFormat, transform: Transform, first_element: int
) -> ChunkPlan:
    """Validate a chunk of ``nbytes`` raw bytes starting at sample ``first_element``.

    Raises:
        ValueError: the format, the transform or the chunk's position is invalid.
    """
    if fmt.bits_allocated not in (8, 16, 32):
        raise ValueError(f"bits allocated {fmt.bits_allocated} is not 8, 16 or 32")
    if not 1 <= fmt.bits_stored <= fmt.bits_allocated:
        raise ValueError(f"bits stored {fmt.bits_stored} outside 1..{fmt.bits_allocated}")
    if fmt.samples not in (1, 3):
        raise ValueError(f"samples per pixel {fmt.samples} is not 1 or 3")
    if min(fmt.rows, fmt.columns, fmt.frames) < 1:
        raise ValueError(f"empty image {fmt.frames}x{fmt.rows}x{fmt.columns}")
    if transform.out_dtype not in OUT_DTYPES:
        raise ValueError(f"output dtype {transform.out_dtype!r} is not one of {OUT_DTYPES}")
    if transform.window is not None and transform.out_dtype not in ("float32", "float16"):
        raise ValueError("a windowed output is float32 or float16")
    if nbytes % fmt.itemsize:
        raise ValueError(f"chunk of {nbytes} bytes is not whole {fmt.itemsize}-byte samples")
    n = nbytes // fmt.itemsize
    if first_element < 0 or first_element + n > fmt.total_elements:
        raise ValueError(
            f"samples {first_element}..{first_element + n} outside 0..{fmt.total_elements}"
        )
    fe = fmt.frame_elements
    planar = fmt.planar and fmt.samples == 3
    if planar and (first_element % fe or n % fe):
        raise ValueError("a planar colour chunk must hold whole frames")
    flags = (F_PLANAR if planar else 0) | (F_HALF if transform.out_dtype == "float16" else 0)
    # Only the frames this chunk covers: an object's per-frame values are copied,
    # checked and sent per chunk, so all of them would cost O(frames) each time.
    frame0, frame_end = first_element // fe, -(-(first_element + n) // fe)
    values = {"slopes": transform.slopes, "intercepts": transform.intercepts}
    if transform.rescale:
        for name, all_values in values.items():
            if len(all_values) not in (1, fmt.frames):
                raise ValueError(f"{len(all_values)} rescale {name} for {fmt.frames} frames")
            if len(all_values) > 1:
                values[name] = all_values[frame0 : max(frame_end, frame0 + 1)]
            if not all(math.isfinite(v) for v in values[name]):
                raise ValueError(f"rescale {name} must be finite")
        flags |= F_RESCALE
        if len(transform.slopes) > 1 or len(transform.intercepts) > 1:
            flags |= F_PER_FRAME
    low, span = 0.0, 1.0
    if transform.window is not None:
        center, width = transform.window
        if not (math.isfinite(center) and math.isfinite(width)) or width < 1:
            raise ValueError(f"window {transform.window} needs a finite center and width >= 1")
        low, span = float(center) - 0.5, float(width) - 1.0
        flags |= F_WINDOW | (F_STEP if span == 0.0 else 0)
    return ChunkPlan(
        n=n,
        first_element=first_element,
        frame_elements=fe,
        plane_elements=fmt.rows * fmt.columns,
        stored_dtype=fmt.stored_dtype,
        dtype_code=DTYPE_CODES[fmt.stored_dtype],
        shift=fmt.bits_allocated - fmt.bits_stored,
        flags=flags,
        slopes=tuple(float(v) for v in values["slopes"]),
        intercepts=tuple(float(v) for v in values["intercepts"]),
        frame0=frame0 if flags & F_PER_FRAME else 0,
        low=low,
        span=span,
        out_dtype=transform.out_dtype,
        out_code=OUT_DTYPES.index(transform.out_dtype),
    )


_INTEGER_OUT: tuple[OutDtype, ...] = ("uint8", "int8", "uint16", "int16", "uint32", "int32")


def narrowest_exact(fmt: PixelFormat, transform: Transform) -> OutDtype:
    """The narrowest output dtype that holds every value ``transform`` (its ``out_dtype``
    aside) gives ``fmt``'s stored samples exactly.

    Without rescale the values are the stored integers: the narrowest integer type
    of their range (8-bit samples stay ``uint8``). With integer slopes and intercepts
    (CT's 1 and -1024) they are integers too: the narrowest integer type of
    ``slope * x + intercept`` over the stored range, every frame's. Otherwise
    float32 when every value is exact in it (``exact_in_float32``), else float64.
    A window's values (its division) are exact in no narrower type: those are
    float32, rounded once as ever.
    """
    if transform.window is not None:
        return "float32"
    shift = fmt.bits_allocated - fmt.bits_stored
    bits = 8 * fmt.itemsize - shift
    low, high = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if fmt.signed else (0, (1 << bits) - 1)
    slopes = transform.slopes if transform.rescale else (1.0,)
    intercepts = transform.intercepts if transform.rescale else (0.0,)
    if all(float(v).is_integer() for v in (*slopes, *intercepts)):
        lows, highs = [], []
        for k in range(max(len(slopes), len(intercepts))):
            s = int(slopes[k if len(slopes) > 1 else 0])
            b = int(intercepts[k if len(intercepts) > 1 else 0])
            lows.append(min(s * low, s * high) + b)
            highs.append(max(s * low, s * high) + b)
        for name in _INTEGER_OUT:
            info = np.iinfo(name)
            if info.min <= min(lows) and max(highs) <= info.max:
                return name
        return "float64"  # beyond int32 (float64 holds integers to 2**53: all of these)
    as_float32 = Transform(slopes, intercepts, transform.rescale, None, "float32")
    plan = plan_chunk(fmt.total_bytes, fmt, as_float32, 0)
    return "float32" if exact_in_float32(plan) else "float64"


def preprocess_numpy(
    raw: npt.NDArray[np.uint8],
    fmt: PixelFormat,
    transform: Transform,
    first_element: int,
    out: npt.NDArray[Any] | None = None,
) -> npt.NDArray[Any]:
    """Preprocess one chunk on the CPU; returns a 1-D ``out_dtype`` array in output order.

    ``raw`` is a 1-D uint8 view of whole stored samples. With ``out`` given the
    result is written there and nothing of chunk size is allocated; temporaries
    are bounded by ``BLOCK_ELEMENTS``.

    Raises:
        ValueError: see ``plan_chunk``; also a wrong ``raw`` or ``out``.
    """
    if raw.ndim != 1 or raw.dtype != np.uint8:
        raise ValueError("raw must be a 1-D uint8 array")
    plan = plan_chunk(raw.nbytes, fmt, transform, first_element)
    if out is None:
        out = np.empty(plan.n, dtype=plan.out_dtype)
    elif out.shape != (plan.n,) or out.dtype != np.dtype(plan.out_dtype):
        raise ValueError(f"out must be a 1-D {plan.out_dtype} array of {plan.n} samples")
    if plan.n == 0:
        return out
    src = raw.view(plan.stored_dtype)
    block = min(plan.n, BLOCK_ELEMENTS)
    ints = np.empty(block, dtype=plan.stored_dtype)
    # float32 when every value of the chunk is exact in it: the same bits in less time
    # (python -m ingest.bench.diagnostics.twin_cost compares the two)
    work = np.float32 if exact_in_float32(plan) else np.float64
    floats = np.empty(block, dtype=work)
    slopes = np.asarray(plan.slopes, dtype=work)
    intercepts = np.asarray(plan.intercepts, dtype=work)
    # Overflow to inf in the cast (float16 above 65504) is the defined result on
    # both twins, not an error.
    with np.errstate(all="ignore"):
        for start, stop, dest in _blocks(plan, out):
            # float32 work goes straight into a contiguous float32 output
            direct = dest.dtype == floats.dtype and dest.flags.c_contiguous
            y = dest if direct else floats[: stop - start]
            x = src[start:stop]
            if plan.shift:
                x = ints[: stop - start]
                np.left_shift(src[start:stop], plan.shift, out=x)
                np.right_shift(x, plan.shift, out=x)
            np.copyto(y, x, casting="unsafe")  # exact: float64, or values of < 24 bits
            if plan.flags & F_RESCALE:
                _rescale(plan, y, plan.first_element + start, slopes, intercepts)
            if plan.flags & F_STEP:
                np.copyto(y, np.greater(y, plan.low))
            elif plan.flags & F_WINDOW:
                np.subtract(y, plan.low, out=y)
                np.divide(y, plan.span, out=y)
                np.add(y, 0.5, out=y)
                np.clip(y, 0.0, 1.0, out=y)
            if not direct:  # integer outputs hold their values exactly (narrowest_exact)
                np.copyto(dest, y, casting="unsafe")
    return out


def exact_in_float32(plan: ChunkPlan) -> bool:
    """Whether float32 arithmetic gives this chunk the same bits as the float64 steps.

    It does when nothing is rounded: no window (it divides), and for every frame
    of the chunk, ``x * slope + intercept`` for every stored ``x`` is a multiple
    of one power of two 1/D with fewer than 24 bits above it. Then each step is
    exact in both widths, so they agree, signed zeros included (the same IEEE
    operations on the same exact values), and so does the one final rounding.
    """
    if plan.flags & (F_WINDOW | F_STEP):
        return False
    magnitude = 1 << (8 * np.dtype(plan.stored_dtype).itemsize - plan.shift)  # > any |x|
    if not plan.flags & F_RESCALE:
        return magnitude < 1 << 24
    slopes, intercepts = plan.slopes, plan.intercepts
    for k in range(max(len(slopes), len(intercepts))):
        ns, ds = slopes[k if len(slopes) > 1 else 0].as_integer_ratio()
        ni, di = intercepts[k if len(intercepts) > 1 else 0].as_integer_ratio()
        unit = max(ds, di)  # powers of two: every value is a multiple of 1 / unit
        if unit > 1 << 64 or magnitude * abs(ns) * (unit // ds) + abs(ni) * (unit // di) >= 1 << 24:
            return False
    return True


def _blocks(plan: ChunkPlan, out: npt.NDArray[Any]) -> Iterator[tuple[int, int, npt.NDArray[Any]]]:
    """(start, stop, destination) of each block of contiguous input samples."""
    if not plan.flags & F_PLANAR:
        for start in range(0, plan.n, BLOCK_ELEMENTS):
            stop = min(start + BLOCK_ELEMENTS, plan.n)
            yield start, stop, out[start:stop]
        return
    fe, pe = plan.frame_elements, plan.plane_elements
    for frame in range(plan.n // fe):
        pixels = out[frame * fe : (frame + 1) * fe].reshape(pe, 3)
        for sample in range(3):
            base = frame * fe + sample * pe
            for offset in range(0, pe, BLOCK_ELEMENTS):
                stop = min(offset + BLOCK_ELEMENTS, pe)
                yield base + offset, base + stop, pixels[offset:stop, sample]


def _rescale(
    plan: ChunkPlan,
    y: npt.NDArray[Any],
    element: int,
    slopes: npt.NDArray[Any],
    intercepts: npt.NDArray[Any],
) -> None:
    """``y = y * slope + intercept`` in place; ``y[0]`` is sample ``element`` of the object."""
    if not plan.flags & F_PER_FRAME:
        if slopes[0] != 1.0:  # x * 1.0 is x, bit for bit (x is never -0.0 here)
            np.multiply(y, slopes[0], out=y)
        np.add(y, intercepts[0], out=y)
        return
    fe, frame0 = plan.frame_elements, plan.frame0
    first, last = element // fe, (element + len(y) - 1) // fe
    if last - first < _MAX_FRAME_LOOP:
        for frame in range(first, last + 1):
            seg = y[max(frame * fe - element, 0) : (frame + 1) * fe - element]
            np.multiply(seg, slopes[frame - frame0 if len(slopes) > 1 else 0], out=seg)
            np.add(seg, intercepts[frame - frame0 if len(intercepts) > 1 else 0], out=seg)
        return
    frames = np.arange(element, element + len(y), dtype=np.int64) // fe - frame0
    np.multiply(y, slopes[frames] if len(slopes) > 1 else slopes[0], out=y)
    np.add(y, intercepts[frames] if len(intercepts) > 1 else intercepts[0], out=y)


def preprocess_cupy(
    raw_dev: Any,
    fmt: PixelFormat,
    transform: Transform,
    first_element: int,
    out: Any = None,
    stream: Any = None,
) -> Any:
    """The device twin of ``preprocess_numpy`` for one chunk already on the GPU, for
    callers that hold CuPy arrays (the worker itself does not use CuPy).

    ``raw_dev`` is a 1-D uint8 CuPy array; returns (or fills) a 1-D ``out_dtype``
    CuPy array. Runs asynchronously on ``stream`` (the current stream when None).
    The DeviceThread batches many chunks into one launch with ``ingest_gpu.kernel``.

    Raises:
        ValueError: see ``plan_chunk``; also a wrong ``raw_dev`` or ``out``.
    """
    import cupy

    from ingest_gpu import driver, kernel

    if raw_dev.ndim != 1 or raw_dev.dtype != cupy.uint8 or not raw_dev.flags.c_contiguous:
        raise ValueError("raw_dev must be a contiguous 1-D uint8 CuPy array")
    plan = plan_chunk(raw_dev.nbytes, fmt, transform, first_element)
    current = stream if stream is not None else cupy.cuda.get_current_stream()
    device = int(raw_dev.device.id)
    with current:
        if out is None:
            out = cupy.empty(plan.n, dtype=plan.out_dtype)
        elif (
            out.shape != (plan.n,)
            or out.dtype != np.dtype(plan.out_dtype)
            or not out.flags.c_contiguous
        ):
            raise ValueError(f"out must be a contiguous 1-D {plan.out_dtype} array of {plan.n}")
        if plan.n:
            ints, floats, table = kernel.pack_params([plan], [raw_dev.data.ptr], [out.data.ptr])
            # Device copies of the parameters are freed into CuPy's pool, which
            # reuses memory on this stream only after the launch below: safe.
            p, f, t = (cupy.asarray(a) for a in (ints, floats, table))
            driver.primary_context(device)  # current on this thread, as CuPy's is
            kernel.launch(p.data.ptr, f.data.ptr, t.data.ptr, 1, plan.n, int(current.ptr), device)
    return out
