"""User hooks for tests: one keeps a host copy of every chunk, one the chunk as a PyTorch tensor."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ingest.hooks import HookChunk, HookSlab

CHUNKS: list[tuple[HookChunk, np.ndarray]] = []
THREADS: set[str] = set()


def collect(chunk: HookChunk) -> None:
    """Runs on the device thread: a CuPy array there, a NumPy array on the CPU backend."""
    THREADS.add(threading.current_thread().name)
    array = chunk.array
    host = array.get() if hasattr(array, "get") else np.array(array, copy=True)
    CHUNKS.append((chunk, host))


TENSORS: list[tuple[HookChunk, Any, bool]] = []


def into_torch(chunk: HookChunk) -> None:
    """Takes each chunk into PyTorch through DLPack and keeps the tensor past the call."""
    import torch

    tensor = torch.from_dlpack(chunk.array)
    TENSORS.append((chunk, tensor, tensor.data_ptr() == chunk.array.data.ptr))


SLABS: list[tuple[HookSlab, np.ndarray, str]] = []


def collect_slabs(slab: HookSlab) -> None:
    """A series hook: keeps a host copy of every slab and the thread it came on."""
    array = slab.array
    host = array.get() if hasattr(array, "get") else np.array(array, copy=True)
    SLABS.append((slab, host, threading.current_thread().name))
