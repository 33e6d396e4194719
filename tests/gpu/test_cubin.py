"""The kernel build the package ships (``gpu/ingest_gpu/cubin/``) is one of today's source.

``ingest_gpu.kernel`` would quietly fall back to NVRTC for a stale build; this test
says so on any machine, without a GPU, so a kernel change comes with a new
build (``python -m ingest_gpu.build_cubin gpu/ingest_gpu/cubin`` on the GPU machine).
"""

from __future__ import annotations

import json
from importlib import resources

import pytest

from ingest_gpu import kernel


def test_the_shipped_cubins_are_built_from_the_current_source() -> None:
    folder = resources.files(kernel.CUBIN_PACKAGE)
    manifest = json.loads(folder.joinpath(kernel.MANIFEST).read_text())
    assert manifest["source_sha256"] == kernel.source_sha256(), (
        "gpu/ingest_gpu/kernel.py changed since its cubins were built: rebuild them on the GPU"
        " machine"
    )
    assert manifest["cubins"], "no architecture is shipped"
    for capability, name in manifest["cubins"].items():
        data = folder.joinpath(name).read_bytes()
        assert data[:4] == b"\x7fELF", name  # a cubin is an ELF image
        assert kernel.shipped_cubin(capability) == data


def test_no_cubin_for_an_architecture_not_shipped() -> None:
    assert kernel.shipped_cubin("10") is None


def test_the_build_names_the_architectures_hospitals_run() -> None:
    """``python -m ingest_gpu.build_cubin --arch targets`` builds T4, A100, A10/A40, L4/L40S and
    H100/H200 (the build itself runs on the GPU machine); a list is taken as given."""
    from ingest_gpu.build_cubin import TARGETS, architectures

    assert TARGETS == ("75", "80", "86", "89", "90")
    assert architectures(None, "90") == ["90"]
    assert architectures("targets", "90") == list(TARGETS)
    assert architectures("sm_80, 86,80", "90") == ["80", "86"]
    for bad in ("", "eighty", "8"):
        with pytest.raises(SystemExit):
            architectures(bad, "90")
