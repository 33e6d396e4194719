"""The real worker process, SIGKILLed at random points and restarted, loses nothing.

Every supported object ends with exactly one output equal to the reference, at
least one result event (copies agree), an audit record; every bad object and
malformed notification ends in the dead-letter topic with its reason; each
worker process's audit chain has no gap (a killed one may end early).
``make chaos`` runs the long version and prints its report.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ingest.embedded.stack import Stack
from tests.chaos import ChaosConfig, ChaosReport, no_orphans, run_chaos

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


def _check(report: ChaosReport, wanted_kills: int, verbose: bool = False) -> None:
    text = report.format(verbose)
    print("\n" + text)
    assert not report.problems(), text
    assert report.kills >= wanted_kills


@pytest.mark.timeout(120)
async def test_sigkill_chaos_short(stack: Stack, tmp_path: Path) -> None:
    config = ChaosConfig(
        seed=1, ct_slices=136, multiframes=6, kills=6, max_processed_before_kill=30
    )
    with no_orphans():
        report = await run_chaos(stack, config, tmp_path)
    _check(report, config.kills)
    assert report.objects >= 150


@pytest.mark.slow
@pytest.mark.timeout(1200)
async def test_sigkill_chaos_full(stack: Stack, tmp_path: Path) -> None:
    config = ChaosConfig(
        seed=20261121,
        ct_slices=1000,
        multiframes=40,
        not_dicom_objects=8,
        truncated=8,
        missing=4,
        bad_notifications=6,
        kills=24,
        max_processed_before_kill=80,
        finish_timeout_s=300,
    )
    with no_orphans():
        report = await run_chaos(stack, config, tmp_path)
    _check(report, 20, verbose=True)  # with the list of kills
    assert report.objects >= 1000
    assert report.kills_by_phase["working"] >= 10  # most kills land mid-work
