"""Frames decoded in worker processes, awaited from the event loop.

pydicom's decoding plugins for JPEG, JPEG-LS and JPEG 2000 (pylibjpeg's
libjpeg and openjpeg, pyjpegls) hold the GIL while they decode: two threads
decode no faster than one, two processes almost twice as fast on two cores
(``python -m ingest.bench.diagnostics.decode_scaling``). So those frames go to
a pool of processes, one a core by default (``DECODE_PROCESSES``), shared by
every object: frames of one object and of many decode at once (16 processes
decode 4.6-13x as many frames a second as one thread). An RLE frame decodes
in about a millisecond, little more than sending it to a process and its
result back costs: with fewer than ``RLE_POOL_FROM`` processes RLE decodes in
a thread of this process (two processes: 0.31x a thread; sixteen: 1.5x).
Native Pixel Data needs only NumPy and always decodes in a thread.

The pool starts at the first object that needs it, so a worker that never sees
compressed data never pays for it; its processes are started with ``spawn``
(a fork of a process that runs threads can deadlock).

A task is a group of frames: the codec description and the frames' bytes go
to a process, the decoded array comes back. What goes wrong in a process is an
``IngestError`` there (the codec raises it) and the same here; a process that
dies takes its tasks with it as ``ProcessingError``\\s, and the pool is started
afresh for the next task.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import anyio
import numpy as np
import numpy.typing as npt

from ingest.dicom.codec import Codec, decode_encapsulated, decode_native
from ingest.errors import ProcessingError

RLE_LOSSLESS = "1.2.840.10008.1.2.5"
RLE_POOL_FROM = 4  # processes from which RLE frames go to the pool too


def default_processes() -> int:
    """One process a core this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class DecodePool:
    """A lazily started pool of decoding processes (an async context manager)."""

    def __init__(self, processes: int = 0) -> None:
        self.processes = processes or default_processes()
        self._pool: ProcessPoolExecutor | None = None

    async def __aenter__(self) -> DecodePool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the processes; tasks not started are cancelled."""
        pool, self._pool = self._pool, None
        if pool is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(lambda: pool.shutdown(cancel_futures=True))

    async def encapsulated(self, codec: Codec, frames: Sequence[bytes]) -> npt.NDArray[np.generic]:
        """``decode_encapsulated(codec, frames)`` in a process.

        Raises:
            IngestError: the codec's own error (a corrupt codestream ...), or
                ``ProcessingError`` when the decoding process died.
        """
        if codec.transfer_syntax_uid == RLE_LOSSLESS and self.processes < RLE_POOL_FROM:
            return await anyio.to_thread.run_sync(decode_encapsulated, codec, list(frames))
        return await self._run(decode_encapsulated, codec, list(frames))

    async def native(
        self, codec: Codec, pixel_data: bytes, first: int, count: int
    ) -> npt.NDArray[np.generic]:
        """``decode_native(codec, pixel_data, first, count)`` in a thread.

        Raises:
            IngestError: as ``encapsulated``.
        """
        return await anyio.to_thread.run_sync(decode_native, codec, pixel_data, first, count)

    async def _run(
        self, function: Callable[..., npt.NDArray[np.generic]], *args: object
    ) -> npt.NDArray[np.generic]:
        if self._pool is None:
            context = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(self.processes, mp_context=context)
        pool = self._pool
        future: Future[npt.NDArray[np.generic]] = pool.submit(function, *args)
        try:
            result: npt.NDArray[np.generic] = await asyncio.wrap_future(future)
        except BrokenProcessPool as exc:
            if self._pool is pool:
                self._pool = None
                pool.shutdown(wait=False, cancel_futures=True)
            raise ProcessingError("a decoding process died") from exc
        finally:
            future.cancel()  # a cancelled object task leaves no queued decode behind
        return result
