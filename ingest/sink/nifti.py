"""NIfTI-1 for series volumes, the pure part: the header, and why the voxels need no reorder.

A volume is written C-ordered with axes (slice, row, column). NIfTI stores its
first axis fastest, so a NIfTI image with axes (i, j, k) = (column, row, slice)
has exactly the same voxel bytes: the ``.nii`` is a 352-byte header (the 348 of
NIfTI-1, then four zero bytes: no extensions) followed by the ``.npy``'s payload,
which is why a volume can be streamed into either without a transpose.

The header's affine (``srow_*``, ``sform_code`` 1, scanner coordinates) is the
volume's LPS affine with its columns taken as (column, row, slice) and its
first two rows negated (LPS to RAS, NIfTI's space); ``pixdim`` holds each
axis's step in millimetres. There is no ``qform``: a quaternion cannot carry
a shear, and the sform is what readers (nibabel, ITK, FSL) take when both are
there. NIfTI-1 has no 16-bit float, so ``float16`` volumes are written as
``float32`` (exactly). Colour volumes are not written as NIfTI.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Final

import numpy as np

HEADER_BYTES: Final = 352  # vox_offset: the header and an empty extension flag
# NIfTI-1 datatype codes of the dtypes a volume may have
_DATATYPES: Final = {
    "uint8": 2,
    "int16": 4,
    "int32": 8,
    "float32": 16,
    "float64": 64,
    "int8": 256,
    "uint16": 512,
    "uint32": 768,
}
_LPS_TO_RAS: Final = np.diag([-1.0, -1.0, 1.0, 1.0])
_FORMAT: Final = "<i10s18sihbB8h3f4h8f3fhbb4f2i80s24s2h6f4f4f4f16s4s"


def nifti_dtype(dtype: str) -> str | None:
    """The dtype a volume of ``dtype`` is written in as NIfTI (None: it cannot be)."""
    if dtype == "float16":
        return "float32"
    return dtype if dtype in _DATATYPES else None


def ras_affine(affine: Sequence[Sequence[float]]) -> np.ndarray:
    """The NIfTI (column, row, slice) -> RAS millimetres affine of a volume's
    (slice, row, column) -> LPS one."""
    lps = np.asarray(affine, dtype=np.float64)
    return np.asarray(_LPS_TO_RAS @ lps[:, [2, 1, 0, 3]])


def nifti_header(shape: Sequence[int], dtype: str, affine: Sequence[Sequence[float]]) -> bytes:
    """The 352 bytes before a volume's voxels in its ``.nii``.

    Raises:
        ValueError: a shape other than (slices, rows, columns), a dtype NIfTI-1 has no
            code for (``nifti_dtype`` first), or a dimension over 32,767.
    """
    if len(shape) != 3:
        raise ValueError(f"a NIfTI volume has three axes, not {len(shape)}")
    code = _DATATYPES.get(dtype)
    if code is None:
        raise ValueError(f"NIfTI-1 has no datatype {dtype}")
    slices, rows, columns = shape
    if max(shape) > 32767:
        raise ValueError("a NIfTI-1 dimension holds at most 32,767")
    ras = ras_affine(affine)
    steps = np.sqrt((ras[:3, :3] ** 2).sum(axis=0))
    bits = np.dtype(dtype).itemsize * 8
    header = struct.pack(
        _FORMAT,
        348,  # sizeof_hdr
        b"",  # data_type
        b"",  # db_name
        0,  # extents
        0,  # session_error
        0,  # regular
        0,  # dim_info
        *(3, columns, rows, slices, 1, 1, 1, 1),  # dim
        0.0,  # intent_p1
        0.0,  # intent_p2
        0.0,  # intent_p3
        0,  # intent_code
        code,  # datatype
        bits,  # bitpix
        0,  # slice_start
        *(1.0, *(float(v) for v in steps), 0.0, 0.0, 0.0, 0.0),  # pixdim (qfac 1)
        float(HEADER_BYTES),  # vox_offset
        0.0,  # scl_slope (0: the values as they are)
        0.0,  # scl_inter
        0,  # slice_end
        0,  # slice_code
        2,  # xyzt_units: millimetres
        0.0,  # cal_max
        0.0,  # cal_min
        0.0,  # slice_duration
        0.0,  # toffset
        0,  # glmax
        0,  # glmin
        b"dicom-ingest series volume",  # descrip
        b"",  # aux_file
        0,  # qform_code
        1,  # sform_code: scanner coordinates
        *(0.0,) * 6,  # quatern_b/c/d, qoffset_x/y/z
        *(float(v) for v in ras[0]),  # srow_x
        *(float(v) for v in ras[1]),  # srow_y
        *(float(v) for v in ras[2]),  # srow_z
        b"",  # intent_name
        b"n+1\0",  # magic: header and voxels in one file
    )
    return header + b"\0\0\0\0"  # no extensions
