"""ingest/sink/nifti.py: the NIfTI-1 header of a series volume, read by nibabel.

nibabel is the independent reader: the voxels it reads from header + the
volume's C-ordered bytes must be the volume's, (column, row, slice), and its
affine the volume's LPS affine taken to RAS.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import nibabel
import numpy as np
import pytest

from ingest.sink.nifti import HEADER_BYTES, nifti_dtype, nifti_header, ras_affine

# (slice, row, column) -> LPS: 2.5 mm slices along a tilted normal, 0.7 x 0.8 mm pixels
AFFINE = [
    [0.0, 0.0, 0.8, -120.0],
    [0.4330127, 0.7, 0.0, -100.5],
    [2.25, 0.0, 0.0, 30.25],
    [0.0, 0.0, 0.0, 1.0],
]


@pytest.mark.parametrize("dtype", ["int16", "uint8", "uint16", "float32", "float64"])
def test_nibabel_reads_the_same_voxels_and_affine(dtype: str, tmp_path: Path) -> None:
    volume = (np.arange(4 * 5 * 6) % 251).astype(dtype).reshape(4, 5, 6)  # (slice, row, col)
    header = nifti_header(volume.shape, dtype, AFFINE)
    assert len(header) == HEADER_BYTES
    path = tmp_path / "volume.nii.gz"
    path.write_bytes(gzip.compress(header + volume.tobytes()))
    image = nibabel.load(path)
    assert isinstance(image, nibabel.Nifti1Image)
    assert image.shape == (6, 5, 4)
    data = np.asarray(image.dataobj)
    assert data.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(data, volume.transpose(2, 1, 0))
    lps = np.asarray(AFFINE)
    ras = np.diag([-1.0, -1.0, 1.0, 1.0]) @ lps[:, [2, 1, 0, 3]]
    np.testing.assert_allclose(image.affine, ras, atol=1e-5)  # the sform holds float32
    np.testing.assert_allclose(ras_affine(AFFINE), ras)
    # each voxel where the volume's own affine puts it
    for s, r, c in [(0, 0, 0), (3, 4, 5), (2, 1, 3)]:
        lps_point = lps @ [s, r, c, 1]
        np.testing.assert_allclose(
            image.affine @ [c, r, s, 1], [-lps_point[0], -lps_point[1], lps_point[2], 1], atol=1e-4
        )
    zooms = image.header["pixdim"][1:4]
    assert zooms == pytest.approx((0.8, 0.7, np.linalg.norm(lps[:3, 0])))
    assert image.header["sform_code"] == 1


def test_what_nifti_cannot_hold() -> None:
    assert nifti_dtype("float16") == "float32"  # NIfTI-1 has no 16-bit float
    assert nifti_dtype("bool") is None
    with pytest.raises(ValueError, match="three axes"):
        nifti_header((2, 3, 4, 3), "uint8", AFFINE)  # colour
    with pytest.raises(ValueError, match="no datatype"):
        nifti_header((2, 3, 4), "float16", AFFINE)
