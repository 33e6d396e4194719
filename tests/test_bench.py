"""``dicom-ingest bench`` in a tiny configuration against the session's real stack.

Checks the shape of the report, not speed: every workload has every reader,
the CPU readers have positive figures, the GPU readers are reported as
skipped where CUDA is absent, the JSON file is written and the tables render.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from ingest.bench import BenchConfig, run_bench
from ingest.bench_gpu import kvikio_missing
from ingest.bench_measure import percentile
from ingest.bench_readers import plan_ranges
from ingest.bench_workloads import BenchObject, Workload
from ingest.cli import main
from ingest.stack import Stack

CPU_READERS = ("curl", "threads", "naive", "ours", "ours-hook")
GPU_READERS = ("kvikio-raw", "kvikio")


@pytest.fixture(autouse=True)
def aws_environment(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench sets these for its worker; monkeypatch restores them afterwards."""
    for name, value in stack.endpoints.environment().items():
        monkeypatch.setenv(name, value)


@pytest.mark.anyio
@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_tiny_bench_reports_every_reader_and_workload(stack: Stack, tmp_path: Path) -> None:
    config = BenchConfig(out=tmp_path, ct_count=3, large_mb=20, repeats=1, plots=True)
    output = io.StringIO()
    report = await run_bench(config, stack, Console(file=output, width=140))
    _check(report, _written(tmp_path), output.getvalue())


def _written(out: Path) -> dict[str, Any]:
    files = list(out.glob("bench-*.json"))
    assert len(files) == 1
    document: dict[str, Any] = json.loads(files[0].read_text())
    return document


def _check(report: dict[str, Any], on_disk: dict[str, Any], text: str) -> None:
    assert on_disk["results"].keys() == {"ct", "large", "mix"}
    assert report["machine"]["cpu_count"] >= 1
    for workload, readers in on_disk["results"].items():
        for name in CPU_READERS:
            entry = readers[name]
            assert entry["status"] == "ok", (workload, name, entry)
            assert len(entry["runs"]) == 1
            for key in ("gb_per_s", "objects_per_s", "cpu_s", "peak_rss_bytes"):
                assert entry["median"][key] > 0, (workload, name, key)
        for name in GPU_READERS:
            if kvikio_missing() is not None:
                assert readers[name]["status"] == "skipped"
            else:  # the GPU machine with KvikIO carried
                assert readers[name]["status"] == "ok", (workload, name, readers[name])
                assert readers[name]["median"]["gb_per_s"] > 0
        for mode, sink in (("ours", "s3"), ("ours-hook", "none")):
            ours = readers[mode]
            assert ours["settings"]["sink"] == sink
            assert ours["latency_burst"]["p99_ms"] > 0
            assert ours["ring_bytes"] == 32 * 8 * 1024 * 1024
            assert set(ours["steady_state_allocations"]) >= {"pinned_allocations"}
        assert readers["ours"]["hook_chunks"] == 0
        assert readers["ours-hook"]["hook_chunks"] >= len(readers["ours-hook"]["runs"])
    assert on_disk["results"]["ct"]["ours"]["latency_paced"]["count"] == 3
    assert {(r["workload"], r["mode"]) for r in on_disk["ratios"]} == {
        (w, m) for w in ("ct", "large", "mix") for m in ("ours", "ours-hook")
    }
    assert any(t["status"] == "met" or t["status"] == "missed" for t in on_disk["targets"])
    assert "targets (issue 4)" in text
    assert "ours / reference" in text
    if "plots" in on_disk:
        assert all(Path(p).is_file() for p in on_disk["plots"])
    else:
        assert any("matplotlib" in n for n in on_disk["notes"])


def test_plan_ranges_cover_every_byte_once() -> None:
    workload = Workload("w", (BenchObject("a", 10), BenchObject("b", 4), BenchObject("c", 8)))
    jobs = plan_ranges(workload, 4)
    assert [(j.key, j.start, j.length, j.dest) for j in jobs] == [
        ("a", 0, 4, 0), ("a", 4, 4, 4), ("a", 8, 2, 8),
        ("b", 0, 4, 10),
        ("c", 0, 4, 14), ("c", 4, 4, 18),
    ]  # fmt: skip


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([], 99) == 0.0


def test_cli_bench_needs_bootstrap_with_endpoint(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--endpoint", "http://127.0.0.1:1"]) == 2
    assert "--bootstrap" in capsys.readouterr().err
