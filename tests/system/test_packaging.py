"""Packaging: the licence ships, the GPL decoder is an extra, the CUDA extras name their
CUDA, and constraints.txt pins what the extras install (the Dockerfile and make use it)."""

from __future__ import annotations

import re
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.paths import ROOT

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]


def names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def test_the_apache_licence_ships_with_the_package() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text
    assert "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]


def test_the_gpl_decoder_is_only_an_extra() -> None:
    """pylibjpeg-libjpeg (GPL-3.0) is not installed with the worker unless asked for."""
    assert "pylibjpeg-libjpeg" not in names(PROJECT["dependencies"])
    assert names(EXTRAS["gpl"]) == {"pylibjpeg-libjpeg"}
    for extra, requirements in EXTRAS.items():
        if extra not in ("gpl", "dev"):
            assert "pylibjpeg-libjpeg" not in names(requirements), extra
    assert any("gpl" in Requirement(r).extras for r in EXTRAS["dev"])  # CI decodes all


def test_cuda_extras_for_cuda_12_and_13() -> None:
    cuda13, cuda12 = names(EXTRAS["cuda13"]), names(EXTRAS["cuda12"])
    assert {"cupy-cuda13x", "nvidia-nvimgcodec-cu13", "nvidia-nvjpeg2k-cu13"} <= cuda13
    assert {"cupy-cuda12x", "nvidia-nvimgcodec-cu12", "nvidia-nvjpeg2k-cu12"} <= cuda12
    assert not any(n.endswith(("-cu12", "cuda12x")) for n in cuda13)
    assert not any(n.endswith(("-cu13", "cuda13x")) for n in cuda12)
    assert [Requirement(r).extras for r in EXTRAS["cuda"]] == [{"cuda13"}]  # the old name


def test_constraints_pin_every_requirement_once() -> None:
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            match = re.fullmatch(r"([A-Za-z0-9._-]+)==([A-Za-z0-9.+!-]+)", line.strip())
            assert match, line
            name = canonicalize_name(match[1])
            assert name not in pins, name
            pins[name] = match[2]
    wanted = names(PROJECT["dependencies"])
    for requirements in EXTRAS.values():
        wanted |= names([r for r in requirements if not r.startswith("dicom-ingest")])
    assert wanted - set(pins) == set()
    for requirement in [*PROJECT["dependencies"], *EXTRAS["dev"], *EXTRAS["gpl"]]:
        parsed = Requirement(requirement)
        if parsed.name != "dicom-ingest":
            assert parsed.specifier.contains(pins[canonicalize_name(parsed.name)]), requirement
    makefile = (ROOT / "Makefile").read_text()
    assert makefile.count("pip install -q -c constraints.txt -e") == 2
    assert (ROOT / "compose" / "Dockerfile").read_text().count("-c constraints.txt") == 2
