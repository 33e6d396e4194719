"""``dicom-ingest worker --processes N`` under chaos loses nothing, and a live consumer sees it all.

SIGKILLs of children and of the supervisor, workers joining and leaving the
group, broker restarts (``tests/chaos_group.py``). ``make chaos`` runs the long
version (``--processes 8``, 4,000 objects, 8 partitions) and prints its report.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from ingest.embedded.stack import Stack, embedded_stack
from tests.chaos import no_orphans
from tests.chaos_group import (
    FULL,
    KILL_CHILD,
    KILL_SUPERVISOR,
    RESTART_BROKER,
    SCALE_IN,
    SCALE_OUT,
    GroupChaosConfig,
    GroupChaosReport,
    run_group_chaos,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def durable_stack() -> Iterator[Stack]:
    """A stack of its own whose broker keeps its log in S3, so it survives restarts."""
    with embedded_stack(durable_broker=True) as running:
        yield running


def _run(stack: Stack, config: GroupChaosConfig, workdir: Path) -> GroupChaosReport:
    """The run on an event loop of its own, closed with everything the test's clients opened.

    aiokafka drops, without closing them, connections its clients were opening when
    the broker went down; they are collected here, where their ResourceWarning is
    expected, and not in whichever later test the garbage collector runs in.
    """
    with no_orphans():
        report = asyncio.run(run_group_chaos(stack, config, workdir))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    return report


def _print(report: GroupChaosReport) -> None:
    print("\n" + report.format() + "\n" + "\n".join(report.event_log), flush=True)


def _check(report: GroupChaosReport, config: GroupChaosConfig) -> None:
    assert not report.problems(), report.format()
    assert report.events[KILL_CHILD] == config.child_kills
    assert report.events[KILL_SUPERVISOR] == config.supervisor_kills
    assert report.events[RESTART_BROKER] == config.broker_restarts
    assert report.events[SCALE_OUT] == report.events[SCALE_IN] == config.scale_outs
    assert report.supervisors == config.supervisor_kills + 1


@pytest.mark.timeout(300)
def test_group_chaos_short(durable_stack: Stack, tmp_path: Path) -> None:
    # Tansu at times holds a rebalance for 20-60 s (its members' sessions are 2 s): the
    # next event comes after 10 s without progress, not 30
    config = GroupChaosConfig(
        seed=3, ct_slices=120, multiframes=4, child_kills=4, event_timeout_s=10.0
    )
    report = _run(durable_stack, config, tmp_path)
    _print(report)
    _check(report, config)
    assert report.consistency.objects >= 120


@pytest.mark.slow
@pytest.mark.timeout(3600 * 4)
def test_group_chaos_full(tmp_path: Path) -> None:
    """The long run, ``CHAOS_RUNS`` times (default 1), each on a stack of its own, with seeds
    from FULL's + ``CHAOS_FIRST`` and workers on ``CHAOS_DEVICE`` (default cpu; ``auto`` on
    a GPU machine). ``-s`` prints each report."""
    runs = int(os.environ.get("CHAOS_RUNS", "1"))
    first = int(os.environ.get("CHAOS_FIRST", "0"))
    device = os.environ.get("CHAOS_DEVICE", "cpu")
    reports = []
    for run in range(runs):
        config = dataclasses.replace(FULL, seed=FULL.seed + first + run, device=device)
        with embedded_stack(durable_broker=True) as stack:
            report = _run(stack, config, tmp_path / f"run-{run}")
        print(f"\nrun {run + 1}/{runs} seed {config.seed}:", flush=True)
        _print(report)
        reports.append(report)
    failed = [r for r in reports if r.problems()]
    print(f"TOTAL runs {runs}: with problems {len(failed)}", flush=True)
    for report in reports:
        _check(report, FULL)
        assert report.consistency.objects >= 4000
