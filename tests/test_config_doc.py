"""docs/configuration.md is what ``ingest/ops/config_doc.py`` makes of the settings model."""

from __future__ import annotations

import dataclasses
import re

import pytest

from ingest import settings as model
from ingest.errors import ConfigError
from ingest.ops import config_doc


def test_configuration_md_is_generated_from_the_current_settings() -> None:
    current = config_doc.DOC.read_text()
    assert config_doc.generate(current) == current, (
        "docs/configuration.md is stale: run `python -m ingest.ops.config_doc --write`"
    )


def test_every_setting_has_a_row_that_says_what_it_does() -> None:
    text = config_doc.DOC.read_text()
    rows = dict(re.findall(r"^\| `DICOM_INGEST_(\w+)` \|.*\| ([^|]*) \|$", text, re.MULTILINE))
    read = {f.name.upper() for f in dataclasses.fields(model.Settings) if f.name in model._PARSERS}
    assert set(rows) == read
    undescribed = sorted(
        name for name, meaning in rows.items() if meaning == config_doc.UNDESCRIBED
    )
    assert undescribed == [], "describe these in docs/configuration.md"


@pytest.mark.parametrize(
    "field", [f for f in dataclasses.fields(model.Settings) if f.name in model._PARSERS],
    ids=lambda f: f.name,
)  # fmt: skip
def test_documented_bounds_are_the_parsers(field: dataclasses.Field[object]) -> None:
    """The closure values the generator reads are the ones the parser enforces."""
    parser = model._PARSERS[field.name]
    bounds = config_doc._closure(parser)
    if "low" not in bounds:
        assert config_doc.describe_bounds(field, parser) == ""
        return
    low, high = bounds["low"], bounds["high"]
    assert parser(str(low)) == low
    assert parser(str(high)) == high
    step = 1 if isinstance(low, int) else max(abs(high) * 1e-6, 1e-9)
    for outside in (low - step, high + step):
        with pytest.raises(ConfigError, match=field.name.upper()):
            parser(str(outside))


def test_the_generator_keeps_prose_and_drops_what_is_gone() -> None:
    """A row of a setting no longer in the model goes; a meaning someone wrote stays."""
    current = config_doc.DOC.read_text()
    ghost = "| `DICOM_INGEST_NO_SUCH_THING` | text | unset |  | gone |\n"
    edited = current.replace("| `DICOM_INGEST_GROUP_ID` |", ghost + "| `DICOM_INGEST_GROUP_ID` |")
    edited = edited.replace("| consumer group |", "| the consumer group, reworded |")
    fresh = config_doc.generate(edited)
    assert "NO_SUCH_THING" not in fresh
    assert "| the consumer group, reworded |" in fresh
    assert fresh.replace("the consumer group, reworded", "consumer group") == current
