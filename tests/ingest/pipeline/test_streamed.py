"""The references a streamed object's frames hold on ring slots (``ingest.pipeline.streamed``):
frames split out as views of a slot keep it out of the ring until their group is done
with them, nothing is left held when the object ends, however it ends, and no group
waits on reads that need the slots its own frames hold."""

from __future__ import annotations

import uuid
from collections import Counter
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from ingest.device import stage
from ingest.dicom.device_codecs import MIN_DEVICE_J2K_FRAMES
from ingest.embedded.samples_compressed import ct_volume
from ingest.embedded.stack import Stack
from ingest.fetch.ring import PinnedRing
from ingest.pipeline.streamed import SlotRefs, device_hold
from ingest_gpu.memory import alloc_host
from ingest_gpu.thread import ChunkResult
from tests import harness
from tests.paths import DATA
from tests.reference import reference_array

pytestmark = pytest.mark.anyio


async def make_ring(slots: int = 2) -> PinnedRing:
    return await PinnedRing.allocate(partial(alloc_host, pinned=False), 64 * 1024, slots)


async def test_frames_keep_their_slot_until_their_steps_end() -> None:
    async with await make_ring() as ring:
        slot = await ring.acquire()
        refs = SlotRefs()
        refs.take(slot, 3)  # three frames are views of it
        slot.release()  # the reader is done with it
        assert ring.stats().in_use == 1

        async def fails() -> ChunkResult:
            raise RuntimeError("the step failed")

        with pytest.raises(RuntimeError):
            await refs.holding(Counter({slot: 2}), fails)()
        assert ring.stats().in_use == 1  # one frame still pending
        refs.give_back_all()
        assert ring.stats().in_use == 0
        refs.give_back_all()  # nothing twice
        refs.give_back(Counter({slot: 1}))
        assert ring.stats().in_use == 0


async def test_a_step_never_started_gives_back_at_the_end() -> None:
    async with await make_ring() as ring:
        slot = await ring.acquire()
        refs = SlotRefs()
        refs.take(slot, 1)
        refs.take(slot, 0)
        slot.release()
        step = refs.holding(Counter({slot: 1}), fails_if_run)
        del step  # cancelled before it ran
        assert ring.stats().in_use == 1
        refs.give_back_all()
        assert ring.stats().in_use == 0


async def fails_if_run() -> ChunkResult:
    raise AssertionError("not to be run")


async def test_the_device_job_holds_its_slots_until_the_device_thread_lets_go() -> None:
    async with await make_ring() as ring:
        first, second = await ring.acquire(), await ring.acquire()
        release = device_hold([first, second])()
        first.release()
        second.release()
        assert ring.stats().in_use == 2
        await anyio.to_thread.run_sync(release)  # as the device thread's on_consumed does
        for _ in range(3):
            await anyio.lowlevel.checkpoint()
        assert ring.stats().in_use == 0


@pytest.mark.integration
async def test_a_group_larger_than_the_free_slots_does_not_wait_on_itself(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Volumes whose group of frames (64 of 256 x 256 with the sink) spans more parts than
    the ring has slots, read in 64 KiB parts into 8 slots, as the device path reads them
    (frames left in their slots; on this CPU backend the device refuses them and the
    decoding processes take them): each comes out whole and equal to pydicom's."""
    for name, value in stack.endpoints.environment().items():
        monkeypatch.setenv(name, value)
    made = stage.DeviceStage.__init__

    def decoding(self: stage.DeviceStage, *args: Any) -> None:
        made(self, *args)
        self.decodes = True  # frames split as views of their slots, as on the GPU

    monkeypatch.setattr(stage.DeviceStage, "__init__", decoding)
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    objects = {}
    for slice_name in ("ct-htj2k-lossless-256", "ct-jpeg2000-lossless-256"):
        slice_ = (DATA / "volume" / f"{slice_name}.dcm").read_bytes()
        # ~50 KB frames: 40 of them span 32 parts of 64 KiB
        objects[f"volume/{slice_name}.dcm"] = ct_volume([slice_], MIN_DEVICE_J2K_FRAMES + 8)
    await harness.upload(stack, names.source_bucket, objects.items())
    notes = [harness.aws_notification(names.source_bucket, [key]) for key in objects]
    await harness.publish(stack, names.source_topic, notes)
    settings = harness.make_settings(stack, names, ring_slots="8")
    with anyio.fail_after(120):
        run = await harness.run_worker(settings, stop_after=len(objects))
    assert {o.ref.key: o.error for o in run.outcomes if o.ref} == dict.fromkeys(objects)
    assert run.ring is not None
    assert run.ring.in_use == 0
    for key, data in objects.items():
        base = f"out/{names.source_bucket}/{key}"
        out_array = harness.load_npy(
            await harness.get_object(stack, names.output_bucket, f"{base}.npy")
        )
        assert out_array.tobytes() == reference_array(data, None, "float32").tobytes(), key
