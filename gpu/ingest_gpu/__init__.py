"""Device side of dicom-ingest: preprocessing kernels, host buffers, the device thread.

Importing ``ingest_gpu`` or any of its modules needs NumPy only; CuPy is imported
lazily, on the device thread, when CUDA is used. ``ingest_gpu`` never imports ``ingest``.
"""

from ingest_gpu.formats import OutDtype, PixelFormat, Transform

__all__ = ["OutDtype", "PixelFormat", "Transform"]
