"""ingest/sink/series.py: which slices make a volume, in what order, with what affine.

Member records come from real sidecar documents of the sample CT series (their
geometry as the header parser reads it), so the plan sees what the worker writes.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from ingest.dicom.parse import DicomHeader, parse_header
from ingest.embedded.samples import synthetic_ct_series, synthetic_pet_series
from ingest.sink.series import (
    Member,
    SeriesId,
    manifest_of,
    member_from_json,
    member_of,
    plan_volume,
)


def sidecar_of(data: bytes, key: str, dtype: str = "int16") -> dict[str, object]:
    """The sidecar fields a member record is made of, as ``sink.records.sidecar`` writes them."""
    header = parse_header(data, len(data))
    assert isinstance(header, DicomHeader)
    geometry = header.geometry
    assert geometry is not None
    return {
        "source": {"crc64nvme": f"crc-{key}", "etag": "e"},
        "output": {"npy": f"out/{key}.npy", "json": f"out/{key}.json"},
        "study_instance_uid": header.study_instance_uid,
        "series_instance_uid": header.series_instance_uid,
        "sop_instance_uid": header.sop_instance_uid,
        "shape": list(header.pixel.shape),
        "dtype": dtype,
        "geometry": geometry.as_json(),
        "instance": {
            "instance_number": geometry.instance_number,
            "acquisition_number": geometry.acquisition_number,
            "images_in_acquisition": geometry.images_in_acquisition,
            "number_of_slices": geometry.number_of_slices,
            "number_of_time_slices": geometry.number_of_time_slices,
            "number_of_time_slots": geometry.number_of_time_slots,
        },
    }


def members(
    count: int, seed: int = 0, pet_time_slices: int | None = None
) -> tuple[SeriesId, list[Member]]:
    """The members of a CT series, or of a PET one of ``pet_time_slices`` time slices."""
    objects = (
        synthetic_ct_series(count, 8, 8, seed)
        if pet_time_slices is None
        else synthetic_pet_series(count, 8, 8, seed, time_slices=pet_time_slices)
    )
    found = [member_of(sidecar_of(data, key)) for key, data in objects]
    assert all(f is not None for f in found)
    series = {f[0] for f in found if f is not None}
    assert len(series) == 1
    return series.pop(), [f[1] for f in found if f is not None]


def test_shuffled_slices_are_sorted_along_the_normal_with_the_first_slices_affine() -> None:
    series, slices = members(6)
    shuffled = slices[:]
    random.Random(3).shuffle(shuffled)
    plan = plan_volume(series, shuffled)
    assert plan.refused == ()
    # the sample's slices go head to foot (z = -1.25 k): the normal (0, 0, 1) sorts them
    # from the last one to the first
    assert [m.sop_instance_uid for m in plan.members] == [
        m.sop_instance_uid for m in reversed(slices)
    ]
    assert plan.complete_by_data  # Images in Acquisition: 6
    assert plan.shape == (6, 8, 8)
    affine = np.asarray(plan.affine)
    for index, member in enumerate(plan.members):  # each slice where its own header puts it
        np.testing.assert_allclose(affine @ [index, 0, 0, 1], [*member.position, 1], atol=1e-9)
    assert plan.step_mm == pytest.approx(1.25)
    assert plan_volume(series, slices).version == plan.version  # order does not matter


def test_a_missing_slice_refuses_the_volume_and_says_where() -> None:
    series, slices = members(6)
    plan = plan_volume(series, slices[:2] + slices[3:])
    assert plan.affine is None
    assert not plan.complete_by_data
    assert len(plan.refused) == 1
    assert "1 missing slice(s)" in plan.refused[0]
    assert "2.5 mm where the smallest step is 1.25 mm" in plan.refused[0]


def test_a_late_slice_makes_a_new_version() -> None:
    series, slices = members(5)
    early = plan_volume(series, slices[:4])
    late = plan_volume(series, slices)
    assert early.version != late.version
    assert not early.complete_by_data
    assert late.complete_by_data
    assert early.refused == ()  # the four that came are a volume too (after the quiet period)


def test_duplicates_keep_one_slice_a_position() -> None:
    series, slices = members(4)
    # another instance at slice 1's position, with a later Instance Number: it goes
    copy = member_from_json(
        {**slices[1].as_json(), "sop_instance_uid": "1.2.3.999", "instance_number": 99}
    )
    plan = plan_volume(series, [*slices, copy])
    assert len(plan.members) == 4
    assert plan.duplicates == ("1.2.3.999",)
    assert plan.complete_by_data  # four distinct positions, as Images in Acquisition says
    assert plan.refused == ()


def test_two_series_interleaved_are_told_apart() -> None:
    first = synthetic_ct_series(3, 8, 8, seed=1)
    second = synthetic_ct_series(3, 8, 8, seed=2)
    interleaved = [item for pair in zip(first, second, strict=True) for item in pair]
    found = [member_of(sidecar_of(data, key)) for key, data in interleaved]
    by_series: dict[SeriesId, list[Member]] = {}
    for series, member in (f for f in found if f is not None):
        by_series.setdefault(series, []).append(member)
    assert len(by_series) == 2
    for series, group in by_series.items():
        plan = plan_volume(series, group)
        assert plan.complete_by_data
        assert len(plan.members) == 3


def test_mixed_sizes_and_acquisitions() -> None:
    series, slices = members(3)
    wider = member_from_json({**slices[0].as_json(), "shape": [1, 8, 9], "sop_instance_uid": "9"})
    assert plan_volume(series, [*slices[1:], wider]).refused == ("the slices' sizes differ",)
    second = member_from_json(
        {**slices[2].as_json(), "acquisition_number": 2, "sop_instance_uid": "8"}
    )
    mixed = plan_volume(series, [*slices[:2], second])
    assert mixed.acquisitions == ()  # one acquisition number is missing: the rest say none
    numbered = [member_from_json({**m.as_json(), "acquisition_number": 1}) for m in slices[:2]]
    assert plan_volume(series, [*numbered, second]).acquisitions == (1, 2)


def test_mixed_output_types_promote_to_one_that_holds_both() -> None:
    series, slices = members(2)
    wide = member_from_json({**slices[1].as_json(), "dtype": "uint16"})
    assert plan_volume(series, [slices[0], wide]).dtype == "int32"


def test_not_a_slice_of_a_volume() -> None:
    key, data = synthetic_ct_series(1, 8, 8)[0]
    document = sidecar_of(data, key)
    assert member_of({**document, "output": None}) is None  # SINK=none: nothing to read back
    assert member_of({**document, "shape": [3, 8, 8]}) is None  # multi-frame: its own volume
    geometry = {**document["geometry"], "image_position_patient": None}  # type: ignore[dict-item]
    assert member_of({**document, "geometry": geometry}) is None  # no position: no place


def test_a_manifest_completes_a_series_and_makes_its_volume_of_the_instances_it_names() -> None:
    series, slices = members(6)
    bare = [dataclasses.replace(m, images_in_acquisition=None) for m in slices]
    named = frozenset(m.sop_instance_uid for m in bare[:4])
    assert plan_volume(series, bare[:3], manifest=named).complete_by is None  # one to come
    plan = plan_volume(series, bare, manifest=named)
    assert plan.complete_by == "manifest"
    assert plan.complete_by_data
    assert {m.sop_instance_uid for m in plan.members} == named
    assert plan.not_in_manifest == tuple(sorted(m.sop_instance_uid for m in bare[4:]))
    assert plan.version == plan_volume(series, bare[:4]).version  # of the named ones alone
    document = plan.as_json("v.npy")
    assert document["complete_by"] == "manifest"
    assert document["not_in_manifest"] == list(plan.not_in_manifest)
    # without a manifest nor a count, nothing says the series is complete
    assert plan_volume(series, bare).complete_by is None
    assert plan_volume(series, slices).complete_by == "images_in_acquisition"


@pytest.mark.parametrize(
    "doc", [{}, {"sop_instance_uids": []}, {"sop_instance_uids": [1]}, {"sop_instance_uids": "x"}]
)
def test_what_is_not_a_manifest(doc: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="sop_instance_uids"):
        manifest_of(doc)
    assert manifest_of({"sop_instance_uids": ["1.2", "1.3"]}) == {"1.2", "1.3"}


def test_a_held_member_has_no_output_of_its_own_in_the_volumes_sidecar() -> None:
    series, slices = members(3)
    held = [dataclasses.replace(m, held=True) for m in slices]
    assert member_from_json(held[0].as_json()) == held[0]
    assert member_from_json(slices[0].as_json()).held is False
    plan = plan_volume(series, held[:1] + slices[1:])
    npys = {s["sop_instance_uid"]: s["npy"] for s in plan.as_json("v.npy")["slices"]}
    assert npys[held[0].sop_instance_uid] is None
    assert npys[slices[1].sop_instance_uid] == slices[1].npy


def test_number_of_slices_completes_a_pet_series() -> None:
    series, slices = members(5, pet_time_slices=1)
    assert {m.number_of_slices for m in slices} == {5}  # read from each header
    assert {m.images_in_acquisition for m in slices} == {None}
    assert member_from_json(slices[0].as_json()) == slices[0]
    shuffled = slices[:]
    random.Random(4).shuffle(shuffled)
    assert plan_volume(series, shuffled[:4]).complete_by is None  # one to come
    plan = plan_volume(series, shuffled)
    assert plan.complete_by == "number_of_slices"
    assert plan.as_json("v.npy")["complete_by"] == "number_of_slices"
    assert plan.refused == ()
    assert plan.shape == (5, 8, 8)
    assert plan.step_mm == pytest.approx(3.27)
    # a duplicate at one position does not count as a slice
    copy = member_from_json({**slices[1].as_json(), "sop_instance_uid": "1.2.3.999"})
    assert plan_volume(series, [*slices[:4], copy]).complete_by is None
    # members that disagree on the count say nothing
    other = dataclasses.replace(slices[0], number_of_slices=6)
    assert plan_volume(series, [other, *slices[1:]]).complete_by is None
    # Images in Acquisition, where every member names it, is the count that completes
    counted = [dataclasses.replace(m, images_in_acquisition=5) for m in slices]
    assert plan_volume(series, counted).complete_by == "images_in_acquisition"


def test_number_of_slices_does_not_complete_a_dynamic_or_gated_series() -> None:
    """A dynamic series holds a volume a time slice, a gated one a time slot: Number of
    Slices counts each volume's slices, not the series', so it completes nothing."""
    series, slices = members(4, pet_time_slices=3)
    assert {m.number_of_time_slices for m in slices} == {3}
    first = slices[:4]  # the first time slice's four slices, all there
    assert plan_volume(series, first).complete_by is None
    assert all(m.volume_slices is None for m in slices)
    gated = [
        dataclasses.replace(m, number_of_time_slices=None, number_of_time_slots=8) for m in first
    ]
    assert plan_volume(series, gated).complete_by is None
    one = [dataclasses.replace(m, number_of_time_slices=1, number_of_time_slots=1) for m in first]
    assert plan_volume(series, one).complete_by == "number_of_slices"
