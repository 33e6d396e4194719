"""Build the kernel's cubins, for the package to ship (``gpu/ingest_gpu/cubin/``).

Run on a machine with a GPU, CuPy and NVRTC::

    python3 -m ingest_gpu.build_cubin                  # this GPU's architecture
    python3 -m ingest_gpu.build_cubin --arch targets   # every one in TARGETS
    python3 -m ingest_gpu.build_cubin --arch 80,86     # the ones named

into ``gpu/ingest_gpu/cubin`` (or the folder given first).

This GPU's architecture is built as the worker's fallback builds it at run
time: CuPy compiles ``ingest_gpu.kernel.SOURCE`` into an empty kernel cache, and the
cubin is taken from that cache (CuPy stores it behind a hex digest of the
cubin, which is checked). Another architecture cannot be loaded here, so it is
compiled by NVRTC straight to a cubin for ``sm_<cc>``, with the option CuPy adds
to every compile (``-ftz=true``; the kernel is written so that it changes no
result: ``gpu/ingest_gpu/kernel.py``). Each is written as ``dicom_preprocess.sm_<cc>.cubin``;
``manifest.json`` records the SHA-256 of the source it was built from, so a
changed kernel is never run from a stale build (``ingest_gpu.kernel.shipped_cubin``),
and a test on CPU machines says when the shipped build no longer matches the
source.

A cubin runs only on its own architecture's major version and minor versions
at or above its own (sm_80 code on an sm_86 GPU, not on sm_90), hence one per
architecture hospitals run: T4 (75), A100 and A30 (80), A10, A40 and RTX A6000
(86), L4 and L40S (89), H100 and H200 (90). Any other GPU compiles the kernel at
start-up with CuPy's NVRTC.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ELF_MAGIC = b"\x7fELF"
TARGETS = ("75", "80", "86", "89", "90")
NVRTC_OPTIONS = ("-ftz=true",)  # what CuPy adds to every NVRTC compile of a RawKernel


def cubin_of(cache_file: bytes) -> bytes:
    """The cubin in a CuPy cache file: a hex digest of the cubin, then the cubin."""
    start = cache_file.find(ELF_MAGIC)
    stored, cubin = cache_file[:start], cache_file[start:]
    for algorithm in ("md5", "sha1", "sha256"):
        if start > 0 and hashlib.new(algorithm, cubin).hexdigest().encode() == stored:
            return cubin
    raise SystemExit(f"CuPy's cache file is not digest + cubin (starts {cache_file[:80]!r})")


def architectures(text: str | None, here: str) -> list[str]:
    """The compute capabilities to build: ``here`` (this GPU's) when ``text`` is None,
    ``TARGETS`` for ``targets``, else a comma-separated list such as ``80,86``."""
    if text is None:
        return [here]
    if text == "targets":
        return list(TARGETS)
    wanted = [item.strip().removeprefix("sm_") for item in text.split(",") if item.strip()]
    if not wanted or not all(item.isdigit() and len(item) in (2, 3) for item in wanted):
        raise SystemExit(f"--arch: expected e.g. 80,86 or targets, got {text!r}")
    return list(dict.fromkeys(wanted))


def _through_cupy_cache(cupy: Any, source: str, name: str, cache: Path) -> bytes:
    """This GPU's cubin, compiled and cached by CuPy exactly as at run time, in ``cache``
    (``CUPY_CACHE_DIR``, set before CuPy was imported: it reads it once)."""
    cupy.RawKernel(source, name).compile()
    built = sorted(cache.glob("*.cubin"))
    if len(built) != 1:
        raise SystemExit(f"expected one cubin in CuPy's cache, found {len(built)}")
    return cubin_of(built[0].read_bytes())


def _through_nvrtc(nvrtc: Any, source: str, name: str, capability: str) -> bytes:
    """A cubin for ``sm_<capability>``, compiled by NVRTC without a GPU of that kind."""
    program = nvrtc.createProgram(source, f"{name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(program, [f"--gpu-architecture=sm_{capability}", *NVRTC_OPTIONS])
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(program)
            raise SystemExit(f"NVRTC could not build sm_{capability}: {exc}\n{log}") from None
        cubin: bytes = nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)
    if not cubin.startswith(ELF_MAGIC):
        raise SystemExit(f"NVRTC's sm_{capability} output is not a cubin")
    return cubin


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=Path("gpu/ingest_gpu/cubin"))
    parser.add_argument("--arch", help="targets, or a list such as 80,86 (default: this GPU)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["CUPY_CACHE_DIR"] = cache
        os.environ["CUPY_CACHE_IN_MEMORY"] = "0"
        _build(args.out, args.arch, Path(cache))


def _build(out: Path, arch: str | None, cache: Path) -> None:
    import cupy
    from cupy.cuda import nvrtc

    from ingest_gpu import kernel

    here = str(cupy.cuda.Device().compute_capability)
    device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / kernel.MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    if manifest.get("source_sha256") != kernel.source_sha256():
        manifest = {"cubins": {}}  # builds of another source are dropped
    manifest["source_sha256"] = kernel.source_sha256()
    for capability in architectures(arch, here):
        if capability == here:
            cubin = _through_cupy_cache(cupy, kernel.SOURCE, kernel.KERNEL_NAME, cache)
            how = device
        else:
            cubin = _through_nvrtc(nvrtc, kernel.SOURCE, kernel.KERNEL_NAME, capability)
            how = f"NVRTC for sm_{capability}, on {device} (not loaded here)"
        name = f"{kernel.KERNEL_NAME}.sm_{capability}.cubin"
        (out / name).write_bytes(cubin)
        manifest["cubins"][capability] = name
        manifest.setdefault("built_with", {})[capability] = {
            "cupy": cupy.__version__,
            "nvrtc": ".".join(map(str, nvrtc.getVersion())),
            "device": how,
        }
        print(f"{out / name}: {len(cubin)} bytes for sm_{capability}")
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
