"""The decoding pool (``ingest.dicom.decoders``): processes forked from the fork server.

A group of JPEG tiles decodes in the pool as it does in this process; a process that
dies is a ``ProcessingError`` and the next task gets a fresh pool; a start cancelled
leaves the pool to start again. The pool's processes run the parent's main module
again before their first task, so it is also run from a script (as the
``dicom-ingest`` console script starts the worker) and from a module run with ``-m``
(as the supervisor starts ``python -m ingest.cli``): both decode, and say nothing on
stderr.
"""

from __future__ import annotations

import io
import os
import pickle
import signal
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import anyio
import numpy as np
import pytest
from pydicom import dcmread
from pydicom.encaps import generate_frames

from ingest.dicom.codec import Codec, codec_from_dataset, decode_encapsulated
from ingest.dicom.decoders import DecodePool
from ingest.embedded.samples_slide import jpeg_slide_bytes
from ingest.errors import ProcessingError
from tests.paths import DATA, ROOT


def _slide_frames(tiles: int = 6) -> tuple[Codec, list[bytes]]:
    ds = dcmread(io.BytesIO(jpeg_slide_bytes(tiles_across=tiles, tiles_down=1, tile=64)))
    codec = codec_from_dataset(ds, ds.file_meta.TransferSyntaxUID)
    return codec, list(generate_frames(ds.PixelData, number_of_frames=tiles))


def _parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _until_broken(pool: ProcessPoolExecutor) -> None:
    deadline = time.monotonic() + 30
    while not pool._broken:  # the executor's own thread notices the death
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.anyio
async def test_pool_decodes_as_this_process_does_and_starts_afresh_after_a_death() -> None:
    codec, frames = _slide_frames()
    expected = decode_encapsulated(codec, frames)
    async with DecodePool(2) as pool:
        np.testing.assert_array_equal(await pool.encapsulated(codec, frames), expected)
        assert pool._pool is not None
        if sys.platform == "linux":  # forked by the fork server, not by this process
            assert all(_parent_pid(pid) != os.getpid() for pid in pool._pool._processes)
        with pytest.raises(ProcessingError, match="a decoding process died"):
            await pool._run(os._exit, 1)
        assert pool._pool is None
        np.testing.assert_array_equal(await pool.encapsulated(codec, frames), expected)


@pytest.mark.anyio
async def test_a_pool_broken_between_tasks_is_an_error_once_then_started_afresh() -> None:
    codec, frames = _slide_frames()
    async with DecodePool(1) as pool:
        await pool.encapsulated(codec, frames)
        assert pool._pool is not None
        broken = pool._pool
        os.kill(next(iter(broken._processes)), signal.SIGKILL)
        await anyio.to_thread.run_sync(_until_broken, broken)
        with pytest.raises(ProcessingError, match="a decoding process died"):
            await pool.encapsulated(codec, frames)
        assert pool._pool is None
        await pool.encapsulated(codec, frames)
        assert pool._pool is not broken


@pytest.mark.anyio
async def test_a_cancelled_start_leaves_the_pool_to_start_again() -> None:
    codec, frames = _slide_frames()
    async with DecodePool(1) as pool:
        with anyio.CancelScope() as scope:
            scope.cancel()
            await pool.encapsulated(codec, frames)
        assert pool._pool is None
        with anyio.move_on_after(0.001):
            await pool.encapsulated(codec, frames)
        result = await pool.encapsulated(codec, frames)
    np.testing.assert_array_equal(result, decode_encapsulated(codec, frames))
    assert pool._pool is None  # closed


# what the subprocess runs as its main module, as a script or with -m
MAIN = DATA / "decode_main.txt"


@pytest.mark.parametrize("how", ["script", "module"])
def test_processes_decode_under_a_script_or_a_module_main(how: str, tmp_path: Path) -> None:
    codec, frames = _slide_frames()
    expected = decode_encapsulated(codec, frames)
    (tmp_path / "frames.pickle").write_bytes(pickle.dumps((codec, frames)))
    (tmp_path / "decode_main.py").write_text(MAIN.read_text())
    main = [str(tmp_path / "decode_main.py")] if how == "script" else ["-m", "decode_main"]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-W", "error", *main, str(tmp_path / "frames.pickle")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=90,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.split("\n")[0] == f"{expected.shape} {int(expected.sum())}"
