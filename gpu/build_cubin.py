"""Build the kernel's cubin for this machine's GPU, for the package to ship (``gpu/cubin/``).

Run on a GPU of the architecture to ship (it needs CuPy and NVRTC)::

    python3 -m gpu.build_cubin gpu/cubin

CuPy compiles ``gpu.kernel.SOURCE`` exactly as it does at run time, into an
empty kernel cache; the cubin is taken from that cache (CuPy stores it behind
a hex digest of the cubin, which is checked) and written as
``dicom_preprocess.sm_<cc>.cubin``. ``manifest.json`` records the SHA-256 of the
source it was built from, so a changed kernel is never run from a stale build
(``gpu.kernel.shipped_cubin``), and a test on CPU machines says when the
shipped build no longer matches the source.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

ELF_MAGIC = b"\x7fELF"


def cubin_of(cache_file: bytes) -> bytes:
    """The cubin in a CuPy cache file: a hex digest of the cubin, then the cubin."""
    start = cache_file.find(ELF_MAGIC)
    stored, cubin = cache_file[:start], cache_file[start:]
    for algorithm in ("md5", "sha1", "sha256"):
        if start > 0 and hashlib.new(algorithm, cubin).hexdigest().encode() == stored:
            return cubin
    raise SystemExit(f"CuPy's cache file is not digest + cubin (starts {cache_file[:80]!r})")


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "gpu/cubin")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["CUPY_CACHE_DIR"] = cache
        os.environ["CUPY_CACHE_IN_MEMORY"] = "0"
        import cupy

        from gpu import kernel

        capability = str(cupy.cuda.Device().compute_capability)
        cupy.RawKernel(kernel.SOURCE, kernel.KERNEL_NAME).compile()
        built = sorted(Path(cache).glob("*.cubin"))
        if len(built) != 1:
            raise SystemExit(f"expected one cubin in CuPy's cache, found {len(built)}")
        cubin = cubin_of(built[0].read_bytes())
    name = f"{kernel.KERNEL_NAME}.sm_{capability}.cubin"
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_bytes(cubin)
    manifest_path = out / kernel.MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    if manifest.get("source_sha256") != kernel.source_sha256():
        manifest = {"cubins": {}}  # builds of another source are dropped
    manifest["source_sha256"] = kernel.source_sha256()
    manifest["cubins"][capability] = name
    manifest.setdefault("built_with", {})[capability] = {
        "cupy": cupy.__version__,
        "nvrtc": ".".join(map(str, cupy.cuda.nvrtc.getVersion())),
        "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
    }
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(f"{out / name}: {len(cubin)} bytes for sm_{capability}")


if __name__ == "__main__":
    main()
