"""The command line's own parts: ``--version`` and what a failed run's one line reports."""

from __future__ import annotations

import pytest

from ingest.cli import first_error, main
from ingest.errors import BrokerError, ConfigError, ObjectNotFound
from ingest.logs import package_version


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ended:
        main(["--version"])
    assert ended.value.code == 0
    assert capsys.readouterr().out == f"dicom-ingest {package_version()}\n"
    assert package_version() != "0+unknown"  # the checkout is installed (make, CI)


def test_the_error_a_task_group_ended_with_is_found_inside_its_group() -> None:
    """A configuration error anywhere in the group wins (status 2), then any IngestError;
    anything else is the group itself (a bug: logged with its traceback)."""
    config, broker, bug = ConfigError("DICOM_INGEST_HOOK: x"), BrokerError("b"), KeyError("k")
    nested = BaseExceptionGroup("outer", [broker, BaseExceptionGroup("inner", [bug, config])])
    assert first_error(nested) is config
    assert first_error(ExceptionGroup("g", [bug, ObjectNotFound("o")])).args == ("o",)
    only_bugs = ExceptionGroup("g", [bug])
    assert first_error(only_bugs) is only_bugs
    assert first_error(broker) is broker
