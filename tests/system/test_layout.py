"""The layout's rules (docs/architecture.md, "Module map"), checked on the source tree.

A module's path names its stage, imports flow one way, and each fact has one home:
- ``gpu/`` never imports ``ingest/``;
- a stage (``source``, ``fetch``, ``dicom``, ``device``, ``sink``, ``audit``) never
  imports the wiring (``worker``, ``pipeline``, ``cli``, ``ops``) or the tools
  built on the product (``bench``, ``embedded``);
- nothing in the product imports ``bench`` or ``embedded``, except the command
  line, which dispatches to them;
- nothing in the product imports ``tests``;
- at most ten modules lie flat in ``ingest/`` (modules are sized by what they hold);
- a transfer syntax's UID is written in one module, ``ingest/dicom/syntaxes.py``;
- ``tests/`` mirrors the source tree (``tests/ingest/audit/`` tests ``ingest/audit/``; the whole
  worker in ``tests/system/``) and holds tests and the fixtures they import, nothing else.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.paths import ROOT

STAGES = ("source", "fetch", "dicom", "device", "sink", "audit")
WIRING = ("ingest.worker", "ingest.pipeline", "ingest.cli", "ingest.ops")
TOOLS = ("ingest.bench", "ingest.embedded")
MAX_FLAT = 10


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def dotted(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (lazy imports too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_gpu_never_imports_ingest() -> None:
    bad = {
        dotted(p): sorted(i for i in imports(p) if under(i, ("ingest",))) for p in modules("gpu")
    }
    assert {m: i for m, i in bad.items() if i} == {}


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_never_imports_the_wiring_or_the_tools(stage: str) -> None:
    bad = {
        dotted(p): sorted(i for i in imports(p) if under(i, WIRING + TOOLS))
        for p in modules(f"ingest/{stage}")
    }
    assert {m: i for m, i in bad.items() if i} == {}


def test_the_product_never_imports_the_bench_or_the_embedded_servers() -> None:
    product = [p for p in modules("ingest") if not under(dotted(p), (*TOOLS, "ingest.cli"))]
    bad = {dotted(p): sorted(i for i in imports(p) if under(i, TOOLS)) for p in product}
    assert {m: i for m, i in bad.items() if i} == {}


def test_few_flat_modules() -> None:
    flat = [p.name for p in (ROOT / "ingest").glob("*.py") if p.name != "__init__.py"]
    assert len(flat) <= MAX_FLAT, flat


def test_the_product_never_imports_the_tests() -> None:
    offenders = {
        dotted(p): sorted(n for n in imports(p) if under(n, ("tests",)))
        for p in modules("ingest") + modules("gpu")
    }
    assert {m: found for m, found in offenders.items() if found} == {}


def test_transfer_syntax_uids_have_one_home() -> None:
    """Every other module names a syntax through ``ingest.dicom.syntaxes`` or ``pydicom.uid``."""
    home = ROOT / "ingest" / "dicom" / "syntaxes.py"
    uid = re.compile(r"""["']1\.2\.840\.10008\.1\.2[0-9.]*["']""")
    found = {
        str(p.relative_to(ROOT)): uid.findall(p.read_text())
        for p in modules("ingest") + modules("gpu")
        if p != home
    }
    assert {path: uids for path, uids in found.items() if uids} == {}


def test_every_package_is_a_package() -> None:
    missing = [
        str(d.relative_to(ROOT))
        for top in ("ingest", "gpu")
        for d in [ROOT / top, *(ROOT / top).rglob("*")]
        if d.is_dir()
        and d.name != "__pycache__"
        and any(d.glob("*.py"))
        and not (d / "__init__.py").exists()
    ]
    assert missing == []


MIRRORS = ("ingest", "gpu")  # tests/ingest/audit/ tests the package ingest/audit/
WHOLE = "system"  # tests of the whole worker, its deployment and the repository


def test_tests_mirror_the_source_tree() -> None:
    """A test module sits beside the package it tests, or in tests/system/ if it tests them all."""
    astray = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if (place := p.parent.relative_to(ROOT / "tests")).parts[:1] != (WHOLE,)
        and not (place.parts[:1] in [(m,) for m in MIRRORS] and (ROOT / place).is_dir())
    ]
    assert astray == []


def test_tests_hold_only_tests_and_their_fixtures() -> None:
    """A module in tests/ that no test imports is a diagnostic: it belongs in ingest/bench/."""
    helpers = {
        p.stem
        for p in (ROOT / "tests").glob("*.py")
        if p.name not in ("__init__.py", "conftest.py", "paths.py")
    } | {
        p.parent.name
        for p in (ROOT / "tests").glob("*/__init__.py")
        if p.parent.name not in (*MIRRORS, WHOLE)
    }

    def tests_imported_by(path: Path) -> set[str]:
        return {i.split(".")[1] for i in imports(path) if i.startswith("tests.")}

    def sources(name: str) -> list[Path]:
        """A helper's modules: ``tests/name.py``, or every module of the package ``tests/name/``."""
        package = ROOT / "tests" / name
        return sorted(package.glob("*.py")) if package.is_dir() else [ROOT / "tests" / f"{name}.py"]

    roots = [*(ROOT / "tests").rglob("test_*.py"), ROOT / "tests" / "conftest.py"]
    used = set().union(*(tests_imported_by(p) for p in roots))
    while grown := set().union(*(tests_imported_by(s) for u in used for s in sources(u))) - used:
        used |= grown
    assert helpers - used == set()
