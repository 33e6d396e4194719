"""The CUDA twin of ``preprocess_numpy``: one RawKernel launch for a batch of chunks.

Each chunk of a batch is described by one row of ``P_COUNT`` int64 parameters
(sizes, device pointers, dtype code, flags, offsets into a table of rescale
slopes and intercepts) and ``FP_COUNT`` float64 parameters (window constants).
The launch grid is ``(gx, chunks)``: ``blockIdx.y`` picks the chunk and the
blocks along x stride over its samples, so chunks of any mix of sizes, stored
types, transforms and output dtypes share one launch.

Bit-identity with NumPy: every float64 operation uses an ``_rn`` intrinsic, so
the compiler cannot contract ``x * slope + intercept`` into an FMA (NumPy rounds
the product and the sum separately), and float64 -> float16 is the single PTX
instruction ``cvt.rn.f16.f64`` (what ``__double2half`` in cuda_fp16.h uses on
the device), one correct round-to-nearest-even like NumPy's ``astype``; never
through float32, which would round twice. float64 -> float32 is inline PTX too
(``cvt.rn.f32.f64``, no ``.ftz``): CuPy appends ``-ftz=true`` to every NVRTC
compile, which makes ``__double2float_rn`` flush float32 subnormals to zero
where NumPy keeps them (CuPy 14.2). Float64 arithmetic is
never flushed. A float64 output is the value itself; an integer output
(``OUTPUT_DTYPE=exact``) only ever receives integers its type holds
(``preprocess.narrowest_exact``), so its cast is exact, as NumPy's ``astype`` is.

Loading: the package ships the kernel compiled for the GPUs we measure on
(``gpu/ingest_gpu/cubin/``, made by ``python -m ingest_gpu.build_cubin`` on such a GPU, with the
SHA-256 of ``SOURCE`` it was built from). On a GPU of that architecture the
worker loads it through the driver (``ingest_gpu.driver``) and never loads NVRTC or
CuPy: no compile at start-up (a fresh container has no kernel cache) and less
resident memory than NVRTC, with CuPy's kernel cache warm or cold
(``python3 -m ingest.bench.diagnostics.rss_cost cuda`` measures both).
Elsewhere, or if the shipped build is not of this ``SOURCE``, CuPy compiles the
source with NVRTC and caches it on disk.

Importing this module needs NumPy only (``ingest_gpu.driver`` is ``ctypes``).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np
import numpy.typing as npt

from ingest_gpu import driver
from ingest_gpu.preprocess import F_PER_FRAME, F_PLANAR, F_RESCALE, F_STEP, F_WINDOW, ChunkPlan

# Layout of one chunk's int64 parameter row.
P_N, P_SRC, P_DST, P_FIRST, P_FRAME, P_PLANE, P_CODE, P_SHIFT, P_FLAGS = range(9)
P_SLOPES, P_NSLOPES, P_ICPTS, P_NICPTS, P_FRAME0, P_OUT = range(9, 15)
P_COUNT = 16
FP_COUNT = 2  # low (center - 0.5), span (width - 1)

THREADS = 256
MAX_GRID_X = 2048
MAX_GRID_Y = 65535

_CONSTANTS = {
    "P_COUNT": P_COUNT,
    "FP_COUNT": FP_COUNT,
    "P_N": P_N,
    "P_SRC": P_SRC,
    "P_DST": P_DST,
    "P_FIRST": P_FIRST,
    "P_FRAME": P_FRAME,
    "P_PLANE": P_PLANE,
    "P_CODE": P_CODE,
    "P_SHIFT": P_SHIFT,
    "P_FLAGS": P_FLAGS,
    "P_SLOPES": P_SLOPES,
    "P_NSLOPES": P_NSLOPES,
    "P_ICPTS": P_ICPTS,
    "P_NICPTS": P_NICPTS,
    "P_FRAME0": P_FRAME0,
    "P_OUT": P_OUT,
    "F_RESCALE": F_RESCALE,
    "F_WINDOW": F_WINDOW,
    "F_STEP": F_STEP,
    "F_PLANAR": F_PLANAR,
    "F_PER_FRAME": F_PER_FRAME,
}

_BODY = r"""

// y is an integer the type holds (preprocess.narrowest_exact): each cast is exact. The
// type is a run-time switch, the same for every thread of a chunk (no divergence), so
// the integer outputs add one kernel body per stored type, not six.
__device__ __forceinline__ void store_integer(void* dst, long long o, double y, int out)
{
    switch (out) {
    case 3: static_cast<unsigned char*>(dst)[o] = static_cast<unsigned char>(y); break;
    case 4: static_cast<signed char*>(dst)[o] = static_cast<signed char>(y); break;
    case 5: static_cast<unsigned short*>(dst)[o] = static_cast<unsigned short>(y); break;
    case 6: static_cast<short*>(dst)[o] = static_cast<short>(y); break;
    case 7: static_cast<unsigned int*>(dst)[o] = static_cast<unsigned int>(y); break;
    default: static_cast<int*>(dst)[o] = static_cast<int>(y); break;
    }
}

template <typename S, typename U, int OUT>
__device__ __forceinline__ void run_chunk(const long long* p, const double* fp, const double* table)
{
    const long long n = p[P_N];
    const U* src = reinterpret_cast<const U*>(static_cast<unsigned long long>(p[P_SRC]));
    void* dst = reinterpret_cast<void*>(static_cast<unsigned long long>(p[P_DST]));
    const long long first = p[P_FIRST];
    const long long fe = p[P_FRAME];
    const long long frame0 = p[P_FRAME0];
    const long long plane = p[P_PLANE];
    const int shift = static_cast<int>(p[P_SHIFT]);
    const long long flags = p[P_FLAGS];
    const int out = static_cast<int>(p[P_OUT]);
    const double* slopes = table + p[P_SLOPES];
    const double* icpts = table + p[P_ICPTS];
    const bool per_slope = p[P_NSLOPES] > 1;
    const bool per_icpt = p[P_NICPTS] > 1;
    const double low = fp[0];
    const double span = fp[1];
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        // pydicom's (x << s) >> s in the stored type: the left shift in the
        // unsigned twin (defined on overflow), the right shift in S (sign-extends).
        const U u = static_cast<U>(src[i] << shift);
        double y = static_cast<double>(static_cast<S>(static_cast<S>(u) >> shift));
        if (flags & F_RESCALE) {
            const long long frame = (flags & F_PER_FRAME) ? (first + i) / fe - frame0 : 0;
            y = __dadd_rn(__dmul_rn(y, slopes[per_slope ? frame : 0]),
                          icpts[per_icpt ? frame : 0]);
        }
        if (flags & F_STEP) {
            y = (y > low) ? 1.0 : 0.0;
        } else if (flags & F_WINDOW) {
            y = __dadd_rn(__ddiv_rn(__dsub_rn(y, low), span), 0.5);
            y = (y < 0.0) ? 0.0 : ((y > 1.0) ? 1.0 : y);
        }
        long long o = i;
        if (flags & F_PLANAR) {
            const long long f = i / fe;
            const long long r = i - f * fe;
            const long long s = r / plane;
            o = f * fe + (r - s * plane) * 3 + s;
        }
        if (OUT == 0) {
            float v;  // not __double2float_rn: CuPy compiles with -ftz=true, which flushes it
            asm("cvt.rn.f32.f64 %0, %1;" : "=f"(v) : "d"(y));
            static_cast<float*>(dst)[o] = v;
        } else if (OUT == 1) {
            unsigned short h;
            asm("cvt.rn.f16.f64 %0, %1;" : "=h"(h) : "d"(y));
            static_cast<unsigned short*>(dst)[o] = h;
        } else if (OUT == 2) {
            static_cast<double*>(dst)[o] = y;
        } else {  // an integer type that holds y, an integer, exactly: the cast is exact
            store_integer(dst, o, y, out);
        }
    }
}

extern "C" __global__ void dicom_preprocess(const long long* __restrict__ params,
                                            const double* __restrict__ fparams,
                                            const double* __restrict__ table)
{
    const long long* p = params + static_cast<long long>(blockIdx.y) * P_COUNT;
    const double* fp = fparams + static_cast<long long>(blockIdx.y) * FP_COUNT;
    const int out = static_cast<int>(p[P_OUT]);
    switch (static_cast<int>(p[P_CODE]) * OUT_KINDS + (out < OUT_KINDS ? out : OUT_KINDS - 1)) {
CASES
    default: break;
    }
}
"""

_STORED = (
    ("unsigned char", "unsigned char"),
    ("signed char", "unsigned char"),
    ("unsigned short", "unsigned short"),
    ("short", "unsigned short"),
    ("unsigned int", "unsigned int"),
    ("int", "unsigned int"),
)  # (S, U) of preprocess.DTYPE_CODES' stored types, in code order
# Kernel bodies per stored type: float32, float16, float64, and one for every integer
# output type (OUT_DTYPES from index 3 on; store_integer switches on it at run time).
_OUT_KINDS = 4
_CASES = "\n".join(
    f"    case {code * _OUT_KINDS + kind}: run_chunk<{s}, {u}, {kind}>(p, fp, table); break;"
    for code, (s, u) in enumerate(_STORED)
    for kind in range(_OUT_KINDS)
)
SOURCE: str = (
    "".join(f"#define {k} {v}\n" for k, v in _CONSTANTS.items())
    + f"#define OUT_KINDS {_OUT_KINDS}\n"
    + _BODY.replace("CASES", _CASES)
)


def pack_params(
    plans: Sequence[ChunkPlan], src_ptrs: Sequence[int], dst_ptrs: Sequence[int]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """The kernel's parameter arrays for ``plans``, whose samples are at the given device pointers.

    Returns ``(params, fparams, table)``: int64 ``(chunks, P_COUNT)``, float64
    ``(chunks, FP_COUNT)`` and the float64 table of slopes and intercepts (never empty).
    """
    ints = np.zeros((len(plans), P_COUNT), dtype=np.int64)
    floats = np.zeros((len(plans), FP_COUNT), dtype=np.float64)
    table: list[float] = [1.0, 0.0]  # the (unused) rescale of chunks without one
    for row, (plan, src, dst) in enumerate(zip(plans, src_ptrs, dst_ptrs, strict=True)):
        slope_at, icpt_at = 0, 1
        if plan.flags & F_RESCALE:
            slope_at = len(table)
            table.extend(plan.slopes)
            icpt_at = len(table)
            table.extend(plan.intercepts)
        ints[row, P_N] = plan.n
        ints[row, P_SRC] = src
        ints[row, P_DST] = dst
        ints[row, P_FIRST] = plan.first_element
        ints[row, P_FRAME] = plan.frame_elements
        ints[row, P_PLANE] = plan.plane_elements
        ints[row, P_CODE] = plan.dtype_code
        ints[row, P_SHIFT] = plan.shift
        ints[row, P_FLAGS] = plan.flags
        ints[row, P_SLOPES] = slope_at
        ints[row, P_NSLOPES] = len(plan.slopes)
        ints[row, P_ICPTS] = icpt_at
        ints[row, P_NICPTS] = len(plan.intercepts)
        ints[row, P_FRAME0] = plan.frame0
        ints[row, P_OUT] = plan.out_code
        floats[row] = (plan.low, plan.span)
    return ints, floats, np.asarray(table, dtype=np.float64)


KERNEL_NAME = "dicom_preprocess"
CUBIN_PACKAGE = "ingest_gpu.cubin"
MANIFEST = "manifest.json"


def source_sha256() -> str:
    return hashlib.sha256(SOURCE.encode()).hexdigest()


def shipped_cubin(compute_capability: str) -> bytes | None:
    """The shipped build of ``SOURCE`` for this architecture (e.g. ``"90"``), if there is one."""
    folder = resources.files(CUBIN_PACKAGE)
    try:
        manifest = json.loads(folder.joinpath(MANIFEST).read_text())
    except (FileNotFoundError, ValueError):
        return None
    if manifest.get("source_sha256") != source_sha256():
        return None
    name = manifest.get("cubins", {}).get(compute_capability)
    if not isinstance(name, str):
        return None
    return folder.joinpath(name).read_bytes()


@dataclass(frozen=True, slots=True)
class LoadedKernel:
    """The kernel in a device's primary context: its ``CUfunction`` handle, where it came
    from (``"shipped"`` or ``"nvrtc"``), and what keeps its module loaded."""

    function: int
    origin: str
    keep: Any


@functools.cache
def _kernel(device_index: int) -> LoadedKernel:
    """Load the shipped cubin through the driver; where none fits, compile with CuPy's
    NVRTC (cached on disk by CuPy) into the same primary context."""
    context = driver.primary_context(device_index)
    cubin = shipped_cubin(context.compute_capability)
    if cubin is not None:
        try:
            module = driver.Module(cubin, KERNEL_NAME)
        except driver.CudaError:
            # A driver older than the toolkit that built the cubin (a CUDA 12 host and
            # a CUDA 13 build) refuses the image: compile for it as for any other GPU.
            pass
        else:
            return LoadedKernel(module.function, "shipped", module)
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(
            f"no kernel ships for sm_{context.compute_capability} that this driver loads, "
            "and CuPy, which would "
            "compile one with NVRTC, is not installed (pip install 'dicom-ingest[cuda13]', "
            "or [cuda12] on a CUDA 12 host)"
        ) from exc
    with cupy.cuda.Device(device_index):
        raw = cupy.RawKernel(SOURCE, KERNEL_NAME)
        function = raw.kernel  # compiles (NVRTC) and loads into the primary context
    return LoadedKernel(int(function.ptr), "nvrtc", (raw, function))


def compile_kernel(device_index: int = 0) -> str:
    """Load or build the kernel for the device now, not at the first launch.

    Returns ``"shipped"`` or ``"nvrtc"``.

    Raises:
        ingest_gpu.driver.CudaError: the driver refused the module.
        RuntimeError: no cubin fits this GPU and CuPy is not there to compile one.
    """
    return _kernel(device_index).origin


def launch(
    params: int, fparams: int, table: int, chunks: int, max_n: int, stream: int, device_index: int
) -> None:
    """Launch the batch kernel on ``stream`` over the device copies of ``pack_params``
    (device pointers), with the device's primary context current on this thread.

    Batches of more than ``MAX_GRID_Y`` chunks take one launch per ``MAX_GRID_Y``.
    """
    function = _kernel(device_index).function
    grid_x = max(1, min(-(-max_n // THREADS), MAX_GRID_X))
    for first in range(0, chunks, MAX_GRID_Y):
        rows = min(MAX_GRID_Y, chunks - first)
        driver.launch(
            function,
            (grid_x, rows, 1),
            (THREADS, 1, 1),
            (params + first * P_COUNT * 8, fparams + first * FP_COUNT * 8, table),
            stream,
        )
