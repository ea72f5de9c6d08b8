"""The data other tools read (the events file, the /health JSON) is documented field by field.

docs/events.md has a row per event with every field; docs/health.md shows every key of the
report in its sample and explains the top-level ones. A new field in the code fails here until
the docs name it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path

import pytest

from torchrunx import events
from torchrunx.launcher.state.health import AgentHealth, HealthReport, WorkerHealth

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.name != "time"]


def _event_rows() -> dict[str, str]:
    rows = {}
    for line in (DOCS / "events.md").read_text().splitlines():
        match = re.match(r"\| `(\w+)` \| [^|]* \| (.*) \|$", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


@pytest.mark.parametrize("event", typing.get_args(events.Event), ids=lambda c: c.__name__)
def test_every_event_and_its_fields_are_in_the_events_page(event):
    rows = _event_rows()
    assert event.__name__ in rows, f"docs/events.md has no row for {event.__name__}"
    documented = re.findall(r"(?:^|, )`(\w+)`", rows[event.__name__])
    assert documented == _fields(event), (event.__name__, documented)


def test_every_key_of_the_health_report_is_in_the_health_page():
    page = (DOCS / "health.md").read_text()
    sample = json.loads(
        page[page.index("```json\n") + 8 : page.index("\n```", page.index("```json\n"))]
    )
    assert list(sample) == [f.name for f in dataclasses.fields(HealthReport)]
    assert list(sample["agents"][0]) == [f.name for f in dataclasses.fields(AgentHealth)]
    assert list(sample["workers"][0]) == [f.name for f in dataclasses.fields(WorkerHealth)]
    for name in _fields(HealthReport):
        assert f"| `{name}` |" in page, name
