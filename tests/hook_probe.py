"""A user hook for tests: keeps a host copy of every chunk it is handed."""

from __future__ import annotations

import threading

import numpy as np

from ingest.hooks import HookChunk

CHUNKS: list[tuple[HookChunk, np.ndarray]] = []
THREADS: set[str] = set()


def collect(chunk: HookChunk) -> None:
    """Runs on the device thread: a CuPy array there, a NumPy array on the CPU backend."""
    THREADS.add(threading.current_thread().name)
    array = chunk.array
    host = array.get() if hasattr(array, "get") else np.array(array, copy=True)
    CHUNKS.append((chunk, host))
