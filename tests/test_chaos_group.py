"""``dicom-ingest worker --processes N`` under chaos loses nothing, and a live consumer sees it all.

SIGKILLs of children and of the supervisor, workers joining and leaving the
group, broker restarts (``tests/chaos_group.py``). ``make chaos`` runs the long
version (``--processes 8``, 4,000 objects, 8 partitions) and prints its report.
"""

from __future__ import annotations

import asyncio
import gc
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


def _check(report: GroupChaosReport, config: GroupChaosConfig) -> None:
    text = report.format()
    print("\n" + text + "\n" + "\n".join(report.event_log))
    assert not report.problems(), text
    assert report.events[KILL_CHILD] == config.child_kills
    assert report.events[KILL_SUPERVISOR] == config.supervisor_kills
    assert report.events[RESTART_BROKER] == config.broker_restarts
    assert report.events[SCALE_OUT] == report.events[SCALE_IN] == config.scale_outs
    assert report.supervisors == config.supervisor_kills + 1


@pytest.mark.timeout(300)
def test_group_chaos_short(durable_stack: Stack, tmp_path: Path) -> None:
    config = GroupChaosConfig(seed=3, ct_slices=120, multiframes=4, child_kills=4)
    report = _run(durable_stack, config, tmp_path)
    _check(report, config)
    assert report.consistency.objects >= 120


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_group_chaos_full(durable_stack: Stack, tmp_path: Path) -> None:
    config = FULL
    report = _run(durable_stack, config, tmp_path)
    _check(report, config)
    assert report.consistency.objects >= 4000
