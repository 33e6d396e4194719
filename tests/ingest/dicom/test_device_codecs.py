"""Which compressed objects the worker sends to the device decoder (pure rules)."""

from __future__ import annotations

import dataclasses

import pytest

from ingest.dicom.codec_luts import Lut
from ingest.dicom.codec_read import Codec
from ingest.dicom.device_codecs import device_colour, device_format, matching_colour

JPEG, J2K, HTJ2K, HTJ2K_LOSSY = (
    "1.2.840.10008.1.2.4.50",
    "1.2.840.10008.1.2.4.90",
    "1.2.840.10008.1.2.4.201",
    "1.2.840.10008.1.2.4.203",
)
CT = Codec(HTJ2K, 512, 512, 1, 16, 12, 1, "MONOCHROME2", 0, 3, "OB", None, None)
TILE = Codec(JPEG, 256, 256, 3, 8, 8, 0, "YBR_FULL_422", 0, 40, "OB", None, None)


@pytest.mark.parametrize(
    ("codec", "device", "matching"),
    [
        (CT, "unchanged", "unchanged"),
        (TILE, "rgb", "rgb"),
        (dataclasses.replace(TILE, rows=128, columns=128), "rgb", "rgb"),
        (dataclasses.replace(TILE, rows=100, columns=100), None, "rgb"),  # CPU is faster
        (dataclasses.replace(CT, rows=128, columns=128), None, "unchanged"),
        (dataclasses.replace(CT, transfer_syntax_uid=J2K), None, "unchanged"),  # CPU faster
        (dataclasses.replace(CT, transfer_syntax_uid=J2K, number_of_frames=31), None, "unchanged"),
        (  # a volume's frames fill the device's batches
            dataclasses.replace(CT, transfer_syntax_uid=J2K, number_of_frames=32),
            "unchanged",
            "unchanged",
        ),
        (dataclasses.replace(CT, transfer_syntax_uid=HTJ2K_LOSSY), None, None),
        (dataclasses.replace(TILE, photometric_interpretation="RGB"), None, None),
        (
            dataclasses.replace(CT, photometric_interpretation="YBR_RCT", samples_per_pixel=3),
            "rgb",
            "rgb",
        ),
        (dataclasses.replace(CT, bits_allocated=32, bits_stored=32), None, None),
        (dataclasses.replace(CT, transfer_syntax_uid="1.2.840.10008.1.2.4.70"), None, None),
        (dataclasses.replace(CT, transfer_syntax_uid="1.2.840.10008.1.2.5"), None, None),
    ],
)
def test_device_and_matching_colours(
    codec: Codec, device: str | None, matching: str | None
) -> None:
    assert device_colour(codec) == device
    assert matching_colour(codec) == matching


def test_a_modality_lut_sequence_keeps_the_object_on_the_cpu() -> None:
    lut = Lut(first_mapped=0, entries=4096, bits=16, data=bytes(8192))
    assert device_colour(dataclasses.replace(CT, modality_lut=lut)) is None


def test_the_device_format_spans_the_object_and_keeps_bits_stored() -> None:
    fmt = device_format(CT)
    assert (fmt.frames, fmt.samples, fmt.bits_allocated, fmt.bits_stored, fmt.signed) == (
        3,
        1,
        16,
        12,
        True,
    )
    assert device_format(TILE).samples == 3
