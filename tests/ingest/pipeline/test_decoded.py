"""The one-frame codestream cut (``single_frame``) against pydicom's ``generate_frames``."""

from __future__ import annotations

import random
import struct
import warnings

import pytest
from pydicom.encaps import generate_frames

from ingest.errors import MalformedDicom
from ingest.pipeline.decoded import single_frame

DELIMITER = struct.pack("<HHI", 0xFFFE, 0xE0DD, 0)


def _item(data: bytes) -> bytes:
    return struct.pack("<HHI", 0xFFFE, 0xE000, len(data)) + data


def test_one_frame_is_what_pydicom_joins() -> None:
    rng = random.Random(7)
    for _ in range(300):
        fragments = [rng.randbytes(rng.choice((2, 4, 10, 100))) for _ in range(rng.randint(1, 4))]
        table = _item(b"" if rng.random() < 0.5 else struct.pack("<I", 0))
        value = table + b"".join(_item(f) for f in fragments)
        if rng.random() < 0.5:
            value += DELIMITER
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = list(generate_frames(value, number_of_frames=1))
        assert [single_frame(memoryview(value), "syntax")] == expected


@pytest.mark.parametrize(
    "value",
    [
        _item(b""),  # a Basic Offset Table and no fragment
        _item(b"") + struct.pack("<HHI", 0x7FE0, 0x0010, 4) + b"abcd",  # not an item
        _item(b"") + struct.pack("<HHI", 0xFFFE, 0xE000, 400) + b"short",  # past the end
    ],
)
def test_a_malformed_value_is_refused(value: bytes) -> None:
    with pytest.raises(MalformedDicom):
        single_frame(memoryview(value), "syntax")
