"""Frames decoded in worker processes, awaited from the event loop.

pydicom's decoding plugins for JPEG, JPEG-LS and JPEG 2000 (pylibjpeg's libjpeg
and openjpeg, pyjpegls) hold the GIL while they decode: two threads decode no
faster than one, while processes scale with the cores
(``python -m ingest.bench.diagnostics.decode_scaling``). So those frames go to a
pool of processes, one a core by default (``DECODE_PROCESSES``), shared by every
object: frames of one object and of many decode at once. An RLE frame decodes in
little more time than sending it to a process and its result back costs, so a
small pool decodes RLE slower than one thread and only a large one faster: with
fewer than ``RLE_POOL_FROM`` processes RLE decodes in a thread of this process
(docs/dicom-support.md has the measurements). Native Pixel Data needs only NumPy
and always decodes in a thread.

The pool starts at the first object that needs it, so a worker that never sees
compressed data never pays for it. Its processes are forked from a fork server:
a process started from a clean interpreter, so forking it is safe where forking
this one, which runs threads, could deadlock. The fork server imports
``PRELOAD`` (NumPy, pydicom and its plugins, the codec) once, and each process
forked from it shares those pages instead of importing its own copy
(docs/benchmarks.md compares the memory of forked and spawned pools). Python
keeps one fork server a process, and its preload list is the process's (set here
before the pool starts; nothing else in the worker starts processes that way).
The first process waits for the fork server's imports, so the pool starts in a
thread, not on the event loop.

A task is a group of frames: the codec description and the frames' bytes go
to a process, the decoded array comes back. What goes wrong in a process is an
``IngestError`` there (the codec raises it) and the same here; a process that
dies takes its tasks with it as ``ProcessingError``\\s, and the pool is started
afresh for the next task.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.context import BaseContext
from typing import Final

import anyio
import numpy as np
import numpy.typing as npt

from ingest import metrics
from ingest.dicom.codec import Codec, decode_encapsulated, decode_native
from ingest.dicom.syntaxes import SYNTAXES
from ingest.errors import ProcessingError

RLE_POOL_FROM = 4  # processes from which RLE frames go to the pool too

# What the fork server imports: this module, and through it the codec and pydicom's
# decoding plugins. A new process also runs its parent's main module again, the
# worker's ``ingest.cli``, before its first task: what that imports is preloaded too,
# but not ``ingest.cli`` itself (runpy warns when the module it runs is already there).
PRELOAD: Final = ("ingest.dicom.decoders", "ingest.logs", "ingest.settings")


def default_processes() -> int:
    """One process a core this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pool_context() -> BaseContext:
    """The fork server's context, ``PRELOAD`` set (``spawn`` where there is none)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    return context


def _launch(pool: ProcessPoolExecutor, processes: int) -> None:
    # Each submit starts a process while none is idle; the first waits for the fork server.
    concurrent.futures.wait([pool.submit(os.getpid) for _ in range(processes)])


class DecodePool:
    """A lazily started pool of decoding processes (an async context manager)."""

    def __init__(self, processes: int = 0) -> None:
        self.processes = processes or default_processes()
        self._pool: ProcessPoolExecutor | None = None
        self._starting = anyio.Lock()

    async def __aenter__(self) -> DecodePool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the processes; tasks not started are cancelled."""
        with anyio.CancelScope(shield=True):
            async with self._starting:  # a pool being started is stopped too
                pool, self._pool = self._pool, None
            if pool is not None:
                await anyio.to_thread.run_sync(lambda: pool.shutdown(cancel_futures=True))

    @metrics.timed_async("decode")
    async def encapsulated(self, codec: Codec, frames: Sequence[bytes]) -> npt.NDArray[np.generic]:
        """``decode_encapsulated(codec, frames)`` in a process.

        Raises:
            IngestError: the codec's own error (a corrupt codestream ...), or
                ``ProcessingError`` when the decoding process died.
        """
        rle = SYNTAXES[codec.transfer_syntax_uid].family == "rle"
        if rle and self.processes < RLE_POOL_FROM:
            return await anyio.to_thread.run_sync(decode_encapsulated, codec, list(frames))
        return await self._run(decode_encapsulated, codec, list(frames))

    @metrics.timed_async("decode")
    async def native(
        self, codec: Codec, pixel_data: bytes, first: int, count: int
    ) -> npt.NDArray[np.generic]:
        """``decode_native(codec, pixel_data, first, count)`` in a thread.

        Raises:
            IngestError: as ``encapsulated``.
        """
        return await anyio.to_thread.run_sync(decode_native, codec, pixel_data, first, count)

    async def _started(self) -> ProcessPoolExecutor:
        async with self._starting:
            if self._pool is None:
                pool = ProcessPoolExecutor(self.processes, mp_context=pool_context())
                try:
                    await anyio.to_thread.run_sync(_launch, pool, self.processes)
                except BaseException:  # cancelled: what was started stops
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise
                self._pool = pool
            return self._pool

    async def _run(
        self, function: Callable[..., npt.NDArray[np.generic]], *args: object
    ) -> npt.NDArray[np.generic]:
        pool = self._pool or await self._started()
        try:
            future: Future[npt.NDArray[np.generic]] = pool.submit(function, *args)
        except BrokenProcessPool as exc:  # a process died since the pool started
            raise self._broken(pool) from exc
        try:
            result: npt.NDArray[np.generic] = await asyncio.wrap_future(future)
        except BrokenProcessPool as exc:
            raise self._broken(pool) from exc
        finally:
            future.cancel()  # a cancelled object task leaves no queued decode behind
        return result

    def _broken(self, pool: ProcessPoolExecutor) -> ProcessingError:
        """The error for a task of a broken pool, the pool discarded: the next task starts one."""
        if self._pool is pool:
            self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
        return ProcessingError("a decoding process died")
