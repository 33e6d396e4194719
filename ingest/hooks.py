"""User hooks: hand each preprocessed chunk to the user's code, on the GPU when there is one.

Set ``DICOM_INGEST_HOOK=package.module:callable``. The callable receives a
``HookChunk`` for every output chunk, on the device thread, right after the
chunk's kernel: ``array`` is a CuPy array on the worker's device (a NumPy array
on the CPU backend) holding ``elements`` values of the object's output, starting
at flat index ``first_element`` of ``shape``. Small objects arrive as one
chunk; large ones as several, in order. The hook runs on the thread that owns
the device, so it may launch CuPy work; it should be quick, because the next
chunk waits for it. What it raises dead-letters the object (reason
``processing``).

The values are ready when the hook is called (the device thread has waited for
the chunk's kernel), so any stream may read them. Each chunk's array is a new
one from CuPy's memory pool, never reused while something refers to it: a hook
may keep it, or ``torch.from_dlpack(chunk.array)``, which shares its memory
without a copy (``tests/system/test_device_hook.py`` runs both on CUDA). What a hook keeps
stays in GPU memory until it lets go.

The worker's own CUDA path does not use CuPy (``gpu/ingest_gpu/driver.py`` says why); a
hook on CUDA does, so the worker imports it at start-up when a hook is set
(``enable_device_arrays``: CuPy's import is the larger part of a CUDA worker's
resident memory before its ring), and refuses to start if it is missing.

``DICOM_INGEST_SERIES_HOOK`` (with ``SERIES=volume``) is given each series volume
the assembler writes, as ``HookSlab``s: eight slices at a time, in order, each
copied to the device on the device thread (a CuPy array; NumPy on the CPU
backend), after the slab is on its way to S3. What it raises fails the volume,
which is tried again after the quiet period (its pending marker stays).

With ``DICOM_INGEST_SINK=none`` nothing is written to S3 and the arrays never
leave the GPU: the real-time analysis case. The result event and the audit
record are still published.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ingest.errors import ConfigError
from ingest_gpu.thread import DeviceThread


@dataclass(frozen=True, slots=True)
class HookChunk:
    bucket: str
    key: str
    etag: str
    sop_instance_uid: str | None
    shape: tuple[int, ...]
    dtype: str
    first_element: int
    elements: int
    backend: str
    array: Any  # cupy.ndarray on CUDA, numpy.ndarray on CPU; 1-D, output order


Hook = Callable[[HookChunk], None]


@dataclass(frozen=True, slots=True)
class HookSlab:
    """Slices ``first_slice`` .. ``first_slice + slices`` of a series volume (``SERIES_HOOK``).

    ``array`` has shape ``(slices, *shape[1:])``; ``affine`` maps (slice, row, column)
    of the whole volume to LPS millimetres (docs/output.md, "Series volumes")."""

    study_instance_uid: str
    series_instance_uid: str
    frame_of_reference_uid: str
    version: str
    shape: tuple[int, ...]  # the whole volume's
    dtype: str
    affine: tuple[tuple[float, ...], ...]
    first_slice: int
    slices: int
    backend: str
    array: Any  # cupy.ndarray on CUDA, numpy.ndarray on CPU


SeriesHook = Callable[[HookSlab], None]


def load_hook(spec: str, setting: str = "DICOM_INGEST_HOOK") -> Any:
    """Import ``module:attribute`` and check it is callable (a ``Hook``, or for
    ``SERIES_HOOK`` a ``SeriesHook``).

    Raises:
        ConfigError: the module or attribute is missing, or not callable.
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{setting}: expected 'module:callable', got {spec!r}")
    try:
        target = getattr(importlib.import_module(module_name), attribute)
    except Exception as exc:  # whatever the user's module raises on import
        raise ConfigError(f"{setting}: cannot load {spec!r}: {type(exc).__name__}: {exc}") from exc
    if not callable(target):
        raise ConfigError(f"{setting}: {spec!r} is not callable")
    return target


def enable_device_arrays(thread: DeviceThread) -> None:
    """Make ``thread`` ready to hand a hook its arrays (on CUDA: import CuPy there).

    Raises:
        ConfigError: the backend is CUDA and CuPy is not installed.
    """
    try:
        thread.enable_device_arrays()
    except ImportError as exc:
        raise ConfigError(
            "DICOM_INGEST_HOOK on CUDA hands CuPy arrays, and CuPy cannot be imported "
            f"(pip install 'dicom-ingest[cuda]'): {exc}"
        ) from exc
