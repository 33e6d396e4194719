"""Lookup tables of an image: read from its dataset once, applied to each frame as pydicom 3 does.

Two tables turn ``pixel_array`` values into the values the output holds
(docs/output.md): a PALETTE COLOR image's three channels (pydicom's
``apply_color_lut``) and a Modality LUT Sequence (``apply_modality_lut``).
``codec`` reads them here into :class:`Lut` values that hold the tables
themselves, so a decoding process needs no dataset, and applies them with the
same NumPy operations as pydicom, so out-of-range values clip, and narrow
integers wrap, exactly as there.

Where this differs from pydicom, on purpose:

* A non-segmented palette in an Explicit VR Big Endian file: pydicom reads
  its OW words as little endian (wrong colours); here the words are swapped
  first, so the colours equal those of the same image in little endian.
* A segmented palette is expanded by a port of pydicom's
  ``_expand_segmented_lut`` with bounds (at most ``MAX_EXPANDED`` entries and
  ``MAX_INDIRECTION`` nested indirect segments) that pydicom lacks: a
  malformed table cannot grow memory or recurse without end.
* A table shorter than its descriptor's entry count is refused here; pydicom
  fails only when a pixel value indexes past its end.

Errors name elements and numbers only, never values.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from pydicom.dataset import Dataset

from ingest.errors import MalformedDicom, UnsupportedDicom

MAX_EXPANDED: Final = 2**17  # entries of one expanded segmented palette channel
MAX_INDIRECTION: Final = 8  # indirect segments within indirect segments
_CHANNELS: Final = ("Red", "Green", "Blue")

Array = npt.NDArray[Any]


@dataclass(frozen=True, slots=True)
class Lut:
    """One lookup table: a Modality LUT Sequence item, or one channel of a palette.

    ``data`` is the table itself, already decoded from however the file stores
    it (US values or OW words, either byte order, segmented or not): exactly
    ``entries`` little-endian unsigned integers of ``bits`` bits. A stored value
    ``v`` maps to entry ``v - first_mapped``, clipped to the table.
    """

    first_mapped: int  # descriptor[1], as pydicom reads it (signed when the VR is SS)
    entries: int  # descriptor[0]; 0 in the file means 65536
    bits: int  # 8 or 16 (palette), 8, 16 or 32 (Modality LUT): the output dtype's size
    data: bytes

    @property
    def table(self) -> Array:
        return np.frombuffer(self.data, dtype=f"<u{self.bits // 8}")


def apply_palette(arr: Array, palette: tuple[Lut, Lut, Lut]) -> Array:
    """RGB of each value of ``arr``, as ``apply_color_lut`` computes it (red's descriptor rules)."""
    red = palette[0]
    dtype = np.dtype(f"<u{red.bits // 8}")
    clipped = np.zeros(arr.shape, dtype=dtype)
    mapped = arr >= red.first_mapped
    # pydicom subtracts an int32 and stores into the table's dtype: wide values wrap
    clipped[mapped] = arr[mapped] - np.int32(red.first_mapped)
    np.clip(clipped, 0, red.entries - 1, out=clipped)
    out = np.empty((*arr.shape, 3), dtype=dtype)
    for channel, lut in enumerate(palette):
        out[..., channel] = lut.table[clipped]
    return out


def apply_lut(arr: Array, lut: Lut) -> Array:
    """The Modality LUT Sequence's value of each value of ``arr``, as ``apply_modality_lut``."""
    clipped = np.zeros(arr.shape, dtype=arr.dtype)
    mapped = arr >= lut.first_mapped
    clipped[mapped] = arr[mapped] - lut.first_mapped
    np.clip(clipped, 0, lut.entries - 1, out=clipped)
    return lut.table[clipped]


def read_modality_lut(ds: Dataset, little_endian: bool) -> Lut | None:
    """The first Modality LUT Sequence item's table, or None when the sequence is absent/empty.

    Raises:
        MalformedDicom, UnsupportedDicom: a table pydicom could not apply either.
    """
    sequence = ds.get("ModalityLUTSequence")
    if not sequence:
        return None
    item = sequence[0]
    entries, first, bits = _descriptor(item.get("LUTDescriptor"), "Modality LUT Descriptor")
    if bits not in (8, 16, 32):
        raise UnsupportedDicom(f"Modality LUT Descriptor gives {bits}-bit entries, not 8 or 16")
    if "LUTData" not in item:
        raise MalformedDicom("missing Modality LUT Sequence LUT Data")
    element = item["LUTData"]
    values: Sequence[int]
    if element.VR == "OW":
        raw = element.value
        if not isinstance(raw, bytes) or len(raw) != 2 * entries:
            size = len(raw) if isinstance(raw, bytes) else 0
            raise MalformedDicom(f"Modality LUT Data holds {size} bytes, not {entries} OW words")
        values = struct.unpack(f"{'<' if little_endian else '>'}{entries}H", raw)
    else:
        values = element.value
        if not isinstance(values, Sequence) or isinstance(values, str | bytes):
            raise MalformedDicom("Modality LUT Data is not a list of numbers")
    try:
        table = np.asarray(values, dtype=f"uint{bits}")
    except (OverflowError, TypeError, ValueError) as exc:
        raise MalformedDicom(f"Modality LUT Data has values that are not {bits}-bit") from exc
    return Lut(first, entries, bits, _entries(table, entries, "Modality LUT Data"))


def read_palette(ds: Dataset, little_endian: bool) -> tuple[Lut, Lut, Lut]:
    """The Palette Color Lookup Table Module's three channels, as ``apply_color_lut`` reads them.

    Raises:
        MalformedDicom, UnsupportedDicom: a palette pydicom could not apply either, an
            alpha channel (RGBA), or a Supplemental Palette (Pixel Presentation MIXED/COLOR).
    """
    if ds.get("PixelPresentation") in ("MIXED", "COLOR"):
        raise UnsupportedDicom("a Supplemental Palette Color LUT (Pixel Presentation MIXED/COLOR)")
    if ds.get("AlphaPaletteColorLookupTableData") or ds.get(
        "SegmentedAlphaPaletteColorLookupTableData"
    ):
        raise UnsupportedDicom("an Alpha Palette Color Lookup Table (RGBA output)")
    descriptor = ds.get("RedPaletteColorLookupTableDescriptor")
    entries, first, nominal = _descriptor(descriptor, "Red Palette Color Lookup Table Descriptor")
    if "RedPaletteColorLookupTableData" in ds:
        tables, bits = _plain_tables(ds, entries, little_endian)
    elif "SegmentedRedPaletteColorLookupTableData" in ds:
        tables, bits = _segmented_tables(ds, nominal, little_endian), nominal
    else:
        raise MalformedDicom("PALETTE COLOR without Palette Color Lookup Table Data")
    if len({len(table) for table in tables}) != 1:
        raise MalformedDicom("the Red, Green and Blue palette tables differ in length")
    red, green, blue = (
        Lut(first, entries, bits, _entries(table, entries, f"{name} Palette Color LUT Data"))
        for table, name in zip(tables, _CHANNELS, strict=True)
    )
    return red, green, blue


def _plain_tables(ds: Dataset, entries: int, little_endian: bool) -> tuple[list[Array], int]:
    raws = []
    for name in _CHANNELS:
        raw = ds.get(f"{name}PaletteColorLookupTableData")
        if not isinstance(raw, bytes) or not raw:
            raise MalformedDicom(f"{name} Palette Color Lookup Table Data is missing or not OW")
        if not little_endian:
            # OW words stored big endian: swap each pair (pydicom does not, see above)
            if len(raw) % 2:
                raise MalformedDicom(f"{name} Palette Color Lookup Table Data has odd length")
            raw = np.frombuffer(raw, dtype=">u2").astype("<u2").tobytes()
        raws.append(raw)
    # pydicom: the entry size is the red table's length over the descriptor's entries
    if len(raws[0]) * 8 not in (8 * entries, 16 * entries):
        raise MalformedDicom(f"palette data of {len(raws[0])} bytes for {entries} entries")
    bits = len(raws[0]) * 8 // entries
    if any(len(raw) % (bits // 8) for raw in raws):
        raise MalformedDicom(f"palette data that is not whole {bits}-bit entries")
    return [np.frombuffer(raw, dtype=f"<u{bits // 8}") for raw in raws], bits


def _segmented_tables(ds: Dataset, nominal: int, little_endian: bool) -> list[Array]:
    if nominal not in (8, 16):
        raise UnsupportedDicom(f"a segmented palette of {nominal}-bit entries, not 8 or 16")
    size = nominal // 8
    tables = []
    for name in _CHANNELS:
        raw = ds.get(f"Segmented{name}PaletteColorLookupTableData")
        if not isinstance(raw, bytes) or not raw or len(raw) % size:
            raise MalformedDicom(f"Segmented {name} Palette Color LUT Data is missing or uneven")
        fmt = f"{'<' if little_endian else '>'}{len(raw) // size}{'B' if size == 1 else 'H'}"
        words = struct.unpack(fmt, raw)
        try:
            expanded = _expand(words, size == 1, little_endian, None, None, 0)
            tables.append(np.asarray(expanded, dtype=f"uint{nominal}"))
        except (IndexError, ValueError, OverflowError) as exc:
            raise MalformedDicom(
                f"Segmented {name} Palette Color LUT Data does not expand"
            ) from exc
    return tables


def _expand(
    data: tuple[int, ...],
    bytewise: bool,
    little_endian: bool,
    segments: int | None,
    last: int | None,
    depth: int,
) -> list[int]:
    """pydicom's ``_expand_segmented_lut`` (PS3.3 C.7.9.2), bounded in size and depth."""
    if depth > MAX_INDIRECTION:
        raise ValueError("indirect segments nest too deep")
    lut: list[int] = []
    offset = read = 0
    while offset + 1 < len(data):  # a trailing null may pad the data
        opcode, length = data[offset], data[offset + 1]
        offset += 2
        if opcode == 0:  # discrete
            lut.extend(data[offset : offset + length])
            offset += length
        elif opcode == 1:  # linear, from the previous value
            if lut:
                y0 = lut[-1]
            elif last:
                y0 = last
            else:
                raise ValueError("the first segment is linear")
            y1 = data[offset]
            offset += 1
            if y0 == y1:
                lut.extend([y1] * length)
            else:
                step = (y1 - y0) / length
                lut.extend(int(v) for v in np.around(np.linspace(y0 + step, y1, length)))
        elif opcode == 2:  # indirect: replay `length` segments from a byte offset
            if not lut:
                raise ValueError("the first segment is indirect")
            if bytewise:
                order = (3, 2, 1, 0) if little_endian else (2, 3, 0, 1)
                b = [data[offset + i] for i in order]
                start = (b[0] << 8 | b[1]) << 16 | (b[2] << 8 | b[3])
                offset += 4
            else:
                start = data[offset + 1] << 16 | data[offset]
                offset += 2
            lut.extend(_expand(data[start:], bytewise, little_endian, length, lut[-1], depth + 1))
        else:
            raise ValueError("unknown segment type")
        if len(lut) > MAX_EXPANDED:
            raise ValueError("the expanded table is too long")
        read += 1
        if read == segments:
            break
    return lut


def _descriptor(value: Any, name: str) -> tuple[int, int, int]:
    """(entries, first mapped value, bits per entry) of a LUT descriptor."""
    if value is None or value == "":
        raise MalformedDicom(f"missing {name}")
    if isinstance(value, int) or len(value) != 3:
        raise MalformedDicom(f"{name} does not have 3 values")
    entries, first, bits = value
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (entries, first, bits)):
        raise MalformedDicom(f"{name} is not 3 integers")
    entries = int(entries) or 2**16
    if not 1 <= entries <= 2**16:
        raise MalformedDicom(f"{name} gives {entries} entries")
    return entries, int(first), int(bits)


def _entries(table: Array, entries: int, name: str) -> bytes:
    """The first ``entries`` entries as little-endian bytes; the rest are never indexed."""
    if table.ndim != 1 or len(table) < entries:
        raise MalformedDicom(f"{name} holds {table.size} entries; its descriptor says {entries}")
    return table[:entries].astype(table.dtype.newbyteorder("<")).tobytes()
