"""docs/configuration.md is what ``ingest/ops/config_doc.py`` makes of the declarations."""

from __future__ import annotations

import re

import pytest

from ingest import settings as model
from ingest.errors import ConfigError
from ingest.ops import config_doc
from tests.paths import ROOT


def test_configuration_md_is_generated_from_the_current_settings() -> None:
    current = config_doc.DOC.read_text()
    assert config_doc.generate(current) == current, (
        "docs/configuration.md is stale: run `python -m ingest.ops.config_doc --write`"
    )


def test_every_setting_has_a_row_that_says_what_it_does() -> None:
    text = config_doc.DOC.read_text()
    rows = dict(re.findall(r"^\| `DICOM_INGEST_(\w+)` \|.*\| ([^|]*) \|$", text, re.MULTILINE))
    assert set(rows) == {name.upper() for name in model.SETTINGS}
    assert all(meaning.strip() for meaning in rows.values())
    assert all("|" not in declared.doc for declared in model.SETTINGS.values())


@pytest.mark.parametrize("name", sorted(model.SETTINGS))
def test_documented_bounds_are_the_parsers(name: str) -> None:
    """The bounds the tables show are the ones the loader enforces, each end included."""
    kind = model.SETTINGS[name].kind
    if kind.low is None or kind.high is None:
        assert config_doc.describe_bounds(name, model.SETTINGS[name]) == ""
        return
    low, high = kind.low, kind.high
    assert model.parse_setting(name, str(low)) == low
    assert model.parse_setting(name, str(high)) == high
    step = 1 if isinstance(low, int) else max(abs(high) * 1e-6, 1e-9)
    for outside in (low - step, high + step):
        with pytest.raises(ConfigError, match=f"^DICOM_INGEST_{name.upper()}: "):
            model.parse_setting(name, str(outside))


def test_the_generator_rewrites_the_tables_and_leaves_the_prose() -> None:
    """A row of a setting no longer declared goes, an edited cell is written back from
    the declaration, and the prose around the tables stays as it is."""
    current = config_doc.DOC.read_text()
    ghost = "| `DICOM_INGEST_NO_SUCH_THING` | text | unset |  | gone |\n"
    edited = current.replace("| `DICOM_INGEST_GROUP_ID` |", ghost + "| `DICOM_INGEST_GROUP_ID` |")
    edited = edited.replace("| consumer group |", "| the consumer group, reworded |")
    edited = edited.replace("# Configuration\n", "# Configuration, by hand\n")
    fresh = config_doc.generate(edited)
    assert "NO_SUCH_THING" not in fresh
    assert fresh == current.replace("# Configuration\n", "# Configuration, by hand\n")


def test_the_deployments_set_only_declared_settings() -> None:
    """A variable the compose file or the Kubernetes manifests set that is not a setting
    would be ignored: a typo there must fail here instead."""
    compose = ROOT / "compose"
    named = {
        match
        for path in [
            compose / "docker-compose.yml",
            *sorted((compose / "k8s").rglob("*.yaml")),
            *sorted((compose / "k8s").rglob("*.env")),
        ]
        for match in re.findall(r"\bDICOM_INGEST_(\w+)", path.read_text())
    }
    assert named
    assert {name.lower() for name in named} <= set(model.SETTINGS)
