"""Device side of dicom-ingest: preprocessing kernels, host buffers, the device thread.

Importing ``gpu`` or any of its modules needs NumPy only; CuPy is imported
lazily, on the device thread, when CUDA is used. ``gpu`` never imports ``ingest``.
"""

from gpu.formats import OutDtype, PixelFormat, Transform

__all__ = ["OutDtype", "PixelFormat", "Transform"]
