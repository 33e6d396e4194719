"""What a dataset says about decoding its Pixel Data: the value ``codec`` decodes with.

``codec_from_dataset`` reads the Image Pixel module (``image_pixel``), the
palette and the Modality LUT Sequence once, checks them as pydicom 3's decoder
would (a value pydicom refuses is refused here, before any frame is read) and
returns a :class:`Codec`: small, frozen and picklable, so frames can be
decoded in other processes. ``needs_codec`` says which objects the native
path takes without it; ``conversions`` names, for the sidecar, what decoding
does to the stored samples. Errors name elements and numbers, never values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from pydicom.dataset import Dataset
from pydicom.pixels.decoders.base import get_decoder
from pydicom.uid import UID

from ingest.dicom.codec_luts import Lut, read_modality_lut, read_palette
from ingest.dicom.image_pixel import ImagePixel, image_pixel
from ingest.dicom.syntaxes import (
    COMPRESSED,
    DEFLATED_LE,
    EXPLICIT_VR_BE,
    J2K_CODESTREAMS,
    NATIVE_LE,
    SYNTAXES,
)
from ingest.errors import MalformedDicom, MissingDecoder, UnsupportedDicom

_MONOCHROME: Final = frozenset({"MONOCHROME1", "MONOCHROME2"})
_UID_RE: Final = re.compile(r"[0-9.]{1,64}")


@dataclass(frozen=True, slots=True)
class Codec:
    """How one object's stored frames become pydicom 3's pixel_array values, then its LUT."""

    transfer_syntax_uid: str
    rows: int
    columns: int
    samples_per_pixel: int
    bits_allocated: int  # 1, 8, 16 or 32
    bits_stored: int
    pixel_representation: int
    photometric_interpretation: str
    planar_configuration: int  # 0 when samples_per_pixel is 1
    number_of_frames: int
    pixel_vr: str  # "OB" / "OW": big-endian 8-bit OW swaps byte pairs
    palette: tuple[Lut, Lut, Lut] | None  # PALETTE COLOR -> RGB, as apply_color_lut
    modality_lut: Lut | None  # Modality LUT Sequence, as apply_modality_lut

    @property
    def syntax_name(self) -> str:
        """The transfer syntax for messages: its name and UID."""
        return syntax_name(self.transfer_syntax_uid)

    @property
    def frame_shape(self) -> tuple[int, ...]:
        """Shape of one output frame: (rows, columns) or (rows, columns, 3)."""
        samples = 3 if self.palette is not None else self.samples_per_pixel
        return (self.rows, self.columns) if samples == 1 else (self.rows, self.columns, samples)

    @property
    def stored_bytes(self) -> int:
        """Bytes of native stored Pixel Data: 1-bit packed, YBR_FULL_422 two samples a pixel."""
        samples = 2 if self.photometric_interpretation == "YBR_FULL_422" else self.samples_per_pixel
        bits = self.rows * self.columns * samples * self.number_of_frames * self.bits_allocated
        return -(-bits // 8)


def needs_codec(
    transfer_syntax_uid: str, photometric: str, bits_allocated: int, has_modality_lut_sequence: bool
) -> bool:
    """False only for what the native path handles already.

    That is Implicit/Explicit VR Little Endian and Encapsulated Uncompressed,
    MONOCHROME1/MONOCHROME2/RGB, Bits Allocated 8/16/32, no Modality LUT Sequence.
    """
    return not (
        transfer_syntax_uid in NATIVE_LE
        and photometric in ("MONOCHROME1", "MONOCHROME2", "RGB")
        and bits_allocated in (8, 16, 32)
        and not has_modality_lut_sequence
    )


GPL_DECODER: Final = "pylibjpeg-libjpeg"  # the extra `gpl`


def missing_decoder(uid: str, what: str = "no decoding plugin is installed") -> MissingDecoder:
    """The error of a syntax none of whose decoders is installed (or whose installed ones
    cannot decode it: ``what``), naming what pydicom's decoders for it would need and the
    extra that brings the GPL one."""
    needs = "; ".join(get_decoder(uid).missing_dependencies) or "a pydicom decoding plugin"
    extra = (
        f" ({GPL_DECODER} is GPL-3.0: pip install 'dicom-ingest[gpl]')"
        if GPL_DECODER in needs
        else ""
    )
    return MissingDecoder(
        f"{syntax_name(uid)}: {what}; pydicom's decoders for it need {needs}{extra}"
    )


def missing_gpl_decoder(uid: str) -> MissingDecoder | None:
    """The error to give when a decode with the plugins present failed where the GPL
    decoder, absent here, is pydicom's choice for the syntax (Pillow decodes JPEG Baseline
    but not 12-bit JPEG): None when that decoder is installed or does not apply."""
    decoder = get_decoder(uid)
    if set(decoder.available_plugins) - {"pillow"}:  # a full decoder was there: bad data
        return None
    if not any(GPL_DECODER in need for need in decoder.missing_dependencies):
        return None
    return missing_decoder(uid, "the installed plugins (Pillow: 8-bit only) do not decode it")


def codec_from_dataset(ds: Dataset, transfer_syntax_uid: str, pixel_vr: str = "") -> Codec:
    """The codec of a dataset whose Pixel Data is encoded as ``transfer_syntax_uid``.

    ``pixel_vr``: the Pixel Data element's VR when ``ds`` was read without it
    (``stop_before_pixels``); otherwise the element's own.

    Reads the Image Pixel module (``image_pixel``'s checks), the palette and the
    Modality LUT Sequence.
    pydicom may warn and log while it converts a value read here for the
    first time: call this where ``parse`` drives pydicom (its lock and filters).

    Raises:
        MalformedDicom: elements missing or out of range (what pydicom would refuse).
        UnsupportedDicom: no decoder for the syntax, Float Pixel Data, a photometric
            interpretation pydicom leaves unconverted or YBR_ICT/YBR_RCT outside JPEG
            2000, Bits Allocated 64, an RGBA or supplemental palette.
    """
    uid = transfer_syntax_uid
    if not uid:
        raise UnsupportedDicom("no Transfer Syntax UID: the Pixel Data's encoding is unknown")
    if uid not in SYNTAXES:
        raise UnsupportedDicom(f"transfer syntax {syntax_name(uid)} has no decoder")
    if uid in COMPRESSED and not get_decoder(uid).is_available:
        raise missing_decoder(uid)
    if "FloatPixelData" in ds or "DoubleFloatPixelData" in ds:
        raise UnsupportedDicom("Float and Double Float Pixel Data are not supported")
    if "PixelData" not in ds and not pixel_vr:
        raise MalformedDicom("no Pixel Data element")

    image = image_pixel(ds)
    little = transfer_syntax_uid != EXPLICIT_VR_BE
    photometric = image.photometric_interpretation
    if photometric in ("YBR_ICT", "YBR_RCT") and uid not in J2K_CODESTREAMS:
        raise UnsupportedDicom(f"{photometric} outside JPEG 2000 ({syntax_name(uid)})")
    palette = read_palette(ds, little) if photometric == "PALETTE COLOR" else None
    lut = read_modality_lut(ds, little)
    vr = str(ds["PixelData"].VR) if "PixelData" in ds else pixel_vr
    return codec_from_image(image, uid, vr, palette, lut)


def codec_from_image(
    image: ImagePixel,
    transfer_syntax_uid: str,
    pixel_vr: str,
    palette: tuple[Lut, Lut, Lut] | None = None,
    modality_lut: Lut | None = None,
) -> Codec:
    """The codec of an Image Pixel module whose Pixel Data (of VR ``pixel_vr``) is encoded
    as ``transfer_syntax_uid``, with its palette and Modality LUT when it has them.

    Raises:
        UnsupportedDicom: no decoder for the syntax, YBR_ICT/YBR_RCT outside JPEG 2000, a
            Modality LUT Sequence on colour.
    """
    uid, photometric = transfer_syntax_uid, image.photometric_interpretation
    if uid not in SYNTAXES:
        raise UnsupportedDicom(f"transfer syntax {syntax_name(uid)} has no decoder")
    if uid in COMPRESSED and not get_decoder(uid).is_available:
        raise UnsupportedDicom(f"{syntax_name(uid)}: no decoding plugin is installed")
    if photometric in ("YBR_ICT", "YBR_RCT") and uid not in J2K_CODESTREAMS:
        raise UnsupportedDicom(f"{photometric} outside JPEG 2000 ({syntax_name(uid)})")
    if modality_lut is not None and photometric not in _MONOCHROME:
        raise UnsupportedDicom(
            f"a Modality LUT Sequence with photometric interpretation {photometric}"
        )
    return Codec(
        transfer_syntax_uid=uid,
        rows=image.rows,
        columns=image.columns,
        samples_per_pixel=image.samples_per_pixel,
        bits_allocated=image.bits_allocated,
        bits_stored=image.bits_stored,
        pixel_representation=image.pixel_representation,
        photometric_interpretation=photometric,
        planar_configuration=image.planar_configuration,
        number_of_frames=image.number_of_frames,
        pixel_vr="OW" if pixel_vr == "OW" else "OB",
        palette=palette,
        modality_lut=modality_lut,
    )


def conversions(codec: Codec) -> tuple[str, ...]:
    """Names of what turns the stored samples into ``decode_*``'s output, in order, for the sidecar.

    ``inflate`` (Deflated) is the caller's, before ``decode_native``. A JPEG
    whose codestream contradicts Photometric Interpretation (a JFIF marker, RGB
    component IDs) is converted as pydicom converts it, which only the
    codestream shows: that is not listed.
    """
    uid, photometric = codec.transfer_syntax_uid, codec.photometric_interpretation
    done: list[str] = []
    if uid in COMPRESSED:
        done.append(f"decode:{COMPRESSED[uid]}")
    if uid == DEFLATED_LE:
        done.append("inflate")  # by the caller, before decode_native
    if uid == EXPLICIT_VR_BE and (codec.bits_allocated > 8 or codec.pixel_vr == "OW"):
        done.append("big_endian->little")
    if codec.bits_allocated == 1:
        done.append("bits_allocated_1->uint8")
    if codec.planar_configuration == 1:
        done.append("planar->interleaved")
    if photometric in ("YBR_FULL", "YBR_FULL_422", "YBR_ICT", "YBR_RCT"):
        done.append(f"{photometric.lower()}->rgb")
    if codec.palette is not None:
        done.append("palette->rgb")
    if codec.modality_lut is not None:
        done.append("modality_lut_sequence")
    return tuple(done)


def syntax_name(uid: str) -> str:
    """A transfer syntax for messages: its name and UID, or that it is not a UID."""
    if not _UID_RE.fullmatch(uid):
        return "(a Transfer Syntax UID that is not a UID)"
    name = UID(uid).name
    return f"{name} ({uid})" if name != uid else uid
