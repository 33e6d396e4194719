"""Every image that ships with pydicom and pydicom-data, through the real worker.

Each file with pixel data is uploaded, notified and processed by the worker
against the real broker and S3 server. It must come out equal to pydicom's
``pixel_array`` (then the palette or the Modality LUT: ``tests/reference.py``),
bit for bit, lossy syntaxes included (the worker decodes with the same codec
libraries); or it must be dead-lettered, and then it is one of ``REFUSED``
below, with the reason that table names. ``REFUSED`` is the list of what the
worker does not take; docs/dicom-support.md gives the same table.

Two passes: the default part size, where each file fits the first GET and is
decoded from its slot; and 64 KiB parts, where every file larger than that is
read in ranges and its frames split out of them as they arrive. Both are slow tests;
the quick pass takes the smallest file of each kind (transfer syntax, photometric
interpretation, bits, samples, signedness, one frame or many) and every file named
below, so each decoding path runs end to end in every suite
(``tests/ingest/dicom/test_codec.py`` decodes every file without the worker).
"""

from __future__ import annotations

import json
import re
import uuid
import warnings
from pathlib import Path

import numpy as np
import pytest
from pydicom import dcmread
from pydicom.uid import HTJ2KLossless, JPEG2000Lossless

from ingest.dicom.parse import DicomHeader, parse_header
from ingest.embedded.samples_compressed import compressed_ct_volume, compressed_samples
from ingest.embedded.samples_slide import write_jpeg_slide
from ingest.embedded.stack import Stack
from tests import harness
from tests.reference import pydicom_samples, reference_array

SAMPLES, _ = pydicom_samples()

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.integration,
    pytest.mark.timeout(600),
    pytest.mark.usefixtures("aws_environment"),
]

# file name -> what its dead-letter record's message must say: files pydicom itself
# cannot decode (deliberately broken, or no image in them).
REFUSED: dict[str, str] = {
    "JPEG-lossy.dcm": r"1\.2\.840\.10008\.1\.2\.4\.51\).*does not decode",
    "JPEG2000-embedded-sequence-delimiter.dcm": r"1\.2\.840\.10008\.1\.2\.4\.91\).*larger than",
    "MR_truncated.dcm": "truncated",
    "badVR.dcm": "Number of Frames is not an integer",
    "meta_missing_tsyntax.dcm": "missing Rows",
    "nested_priv_SQ.dcm": "missing Rows",
}


# With the 64 KiB parts of the "ranges" pass: a planar colour frame must fit one part
IN_RANGES_REFUSED: dict[str, str] = {
    "color-pl.dcm": "planar colour frame of 92160 bytes exceeds the part size 65536",
}

# Big endian palettes: pydicom's ``apply_color_lut`` reads their OW tables as little
# endian (wrong colours); the worker swaps them, so these equal their little endian twins.
TWINS: dict[str, str] = {
    "OBXXXX1A_expb.dcm": "OBXXXX1A.dcm",
    "OBXXXX1A_expb_2frame.dcm": "OBXXXX1A_2frame.dcm",
}


def _key(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


def _kind(path: Path) -> tuple[str, ...]:
    """What decides how a file is decoded: its syntax and its Image Pixel values."""
    names = ("PhotometricInterpretation", "BitsAllocated", "SamplesPerPixel")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ds = dcmread(path, stop_before_pixels=True, force=True)
            syntax = str(getattr(getattr(ds, "file_meta", None), "TransferSyntaxUID", ""))
            values = [str(ds.get(name, "")) for name in (*names, "PixelRepresentation")]
            frames = str(ds.get("NumberOfFrames") or 1).strip()
        except Exception:
            return ("unreadable", path.name)
    return (syntax, *values, str(not frames.isdigit() or int(frames) > 1))


def one_of_each_kind(paths: list[Path]) -> list[Path]:
    """The smallest file of each kind, and every file the tables above name (and the twins
    those stand for)."""
    named = set(REFUSED) | set(IN_RANGES_REFUSED) | set(TWINS) | set(TWINS.values())
    chosen: dict[tuple[str, ...], Path] = {}
    for path in sorted(paths, key=lambda p: p.stat().st_size):
        chosen.setdefault(_kind(path), path)
    return sorted({*chosen.values(), *(p for p in paths if p.name in named)})


def _expected(data: bytes) -> np.ndarray | Exception:
    try:
        return reference_array(data, None, "float32")
    except Exception as exc:  # pydicom itself cannot decode it
        return exc


# the default part size, or the harness's 64 KiB parts; every file, or one of each kind
@pytest.mark.parametrize(
    ("part_size", "every"),
    [
        pytest.param(32 * 1024 * 1024, False, id="one-get-each-kind"),
        pytest.param(32 * 1024 * 1024, True, id="one-get", marks=pytest.mark.slow),
        pytest.param(None, True, id="ranges", marks=pytest.mark.slow),
    ],
)
async def test_every_sample_file_is_processed_or_refused_by_name(
    stack: Stack, part_size: int | None, every: bool
) -> None:
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    files = SAMPLES if every else one_of_each_kind(SAMPLES)
    objects = {_key(path): path.read_bytes() for path in files}
    await harness.upload(stack, names.source_bucket, objects.items())
    messages = [harness.aws_notification(names.source_bucket, [key]) for key in objects]
    await harness.publish(stack, names.source_topic, messages)
    ring = {"part_size": str(part_size), "ring_slots": "4"} if part_size else {}
    settings = harness.make_settings(stack, names, **ring)

    run = await harness.run_worker(settings, stop_after=len(objects))

    outcomes = {o.ref.key: o for o in run.outcomes if o.ref is not None}
    assert sorted(outcomes) == sorted(objects)
    refused = {key: o.error for key, o in outcomes.items() if o.error is not None}
    table = "\n".join(f"{k}: {type(e).__name__}: {e}" for k, e in sorted(refused.items()))
    print(f"dead-lettered {len(refused)} of {len(objects)}:\n{table}")
    expected_refusals = REFUSED if part_size else {**REFUSED, **IN_RANGES_REFUSED}
    sent = {key.split("/")[1] for key in objects}
    expected_refusals = {k: v for k, v in expected_refusals.items() if k in sent}
    assert {k.split("/")[1] for k in refused} == set(expected_refusals), table
    for key, error in refused.items():
        assert re.search(expected_refusals[key.split("/")[1]], str(error)), (key, str(error))
    for key, outcome in outcomes.items():
        if outcome.error is not None:
            continue
        folder, name = key.split("/")
        expected = _expected(objects[f"{folder}/{TWINS[name]}" if name in TWINS else key])
        assert not isinstance(expected, Exception), (key, expected)
        out = harness.load_npy(
            await harness.get_object(
                stack, names.output_bucket, f"out/{names.source_bucket}/{key}.npy"
            )
        )
        assert out.shape == expected.shape, key
        assert out.tobytes() == expected.tobytes(), key


@pytest.mark.parametrize("part_size", [32 * 1024 * 1024, None], ids=["one-get", "ranges"])
async def test_every_compressed_syntax_and_a_tiled_slide(
    stack: Stack, tmp_path: Path, part_size: int | None
) -> None:
    """One object of every compressed syntax (HTJ2K and JPEG Lossless Process 14 ship in no
    sample file), JPEG 2000 and HTJ2K CT volumes (a series as one Enhanced CT object), and
    JPEG-tiled slides with a Basic and with an Extended Offset Table: each equal to
    pydicom's decode, the slide's sidecar giving its total matrix."""
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    objects = dict(compressed_samples(ct_size=128, slide_tiles=(4, 3)))
    for syntax in (JPEG2000Lossless, HTJ2KLossless):  # a series as one object, many frames
        objects[f"volume/{syntax}.dcm"] = compressed_ct_volume(syntax, 34, 64, 64)
    for offsets in ("basic", "extended"):
        info = write_jpeg_slide(
            tmp_path / f"{offsets}.dcm", tiles_across=9, tiles_down=7, tile=64, offsets=offsets
        )
        objects[f"slide/{offsets}.dcm"] = (tmp_path / f"{offsets}.dcm").read_bytes()
    await harness.upload(stack, names.source_bucket, objects.items())
    messages = [harness.aws_notification(names.source_bucket, [key]) for key in objects]
    await harness.publish(stack, names.source_topic, messages)
    ring = {"part_size": str(part_size), "ring_slots": "4"} if part_size else {}
    settings = harness.make_settings(stack, names, **ring)

    run = await harness.run_worker(settings, stop_after=len(objects))

    errors = {o.ref.key: str(o.error) for o in run.outcomes if o.ref and o.error}
    assert errors == {}
    for key, data in objects.items():
        expected = reference_array(data, None, "float32")
        base = f"out/{names.source_bucket}/{key}"
        out = harness.load_npy(await harness.get_object(stack, names.output_bucket, f"{base}.npy"))
        assert out.tobytes() == expected.tobytes(), key
        sidecar = harness.load_json(
            await harness.get_object(stack, names.output_bucket, f"{base}.json")
        )
        assert any(step.startswith("decode:") for step in sidecar["conversions"]), key
        if key.startswith("volume/"):  # ranged: its per-frame groups read as ranges arrive
            full = parse_header(data, len(data))
            assert isinstance(full, DicomHeader)
            assert full.geometry is not None
            assert sidecar["geometry"] == json.loads(json.dumps(full.geometry.as_json())), key
        if key.startswith("slide/") and key.endswith(("basic.dcm", "extended.dcm")):
            slide = sidecar["slide"]
            matrix = ("total_rows", "total_columns", "tile_rows", "tile_columns", "frames")
            assert {k: slide[k] for k in (*matrix, "dimension_organization")} == {
                "total_rows": info.total_rows,
                "total_columns": info.total_columns,
                "tile_rows": 64,
                "tile_columns": 64,
                "frames": 63,
                "dimension_organization": "TILED_FULL",
            }
            # TILED_FULL: tiles row by row across the matrix, 9 a row
            assert (slide["tiles_across"], slide["tiles_down"]) == (9, 7)
            assert slide["optical_paths"] == ["1"]
