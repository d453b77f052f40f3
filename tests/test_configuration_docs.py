"""The README's configuration table names every environment variable LiveR reads (issue 34, item 3).

The variables are found in the source, not listed here: every string literal of ``liver/`` that looks
like ``LIVER_*`` or ``NATS_*`` is an environment variable's name, except the JetStream streams' names
(``LIVER_CONTROL``, ...), which are taken from :data:`liver.shared.subjects.STREAMS`. A variable added
to the code without a row in the table fails here, naming it.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path
from typing import Final

from repo_paths import REPO

import liver
from liver.shared import subjects as s

PACKAGE: Final = Path(liver.__file__).parent
NAME: Final = re.compile(r"(?:LIVER|NATS)_[A-Z0-9_]*[A-Z0-9]")

INTERNAL: Final = {
    "LIVER_DEMO_RUN": "the mark `liver demo` and `liver chaos` set on every process they start, to find "
    "leftovers; not a setting",
}
"""Variables the code reads that are not configuration, with the reason."""


@cache
def variables_in_code() -> dict[str, set[str]]:
    """Every ``LIVER_*``/``NATS_*`` name a string literal of ``liver/`` holds, with the modules holding it."""
    streams = {spec.name for spec in s.STREAMS}
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                value = node.value
                if NAME.fullmatch(value) and value not in streams:
                    found.setdefault(value, set()).add(str(path.relative_to(PACKAGE.parent)))
    return found


def configuration_table() -> list[list[str]]:
    """The rows of the table under the README's ``## Configuration``, as cells (header and rule left out)."""
    lines = (REPO / "README.md").read_text().splitlines()
    start = lines.index("## Configuration") + 1
    rows = []
    for line in lines[start:]:
        if line.startswith("## "):
            break
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    assert len(rows) > 2, "README.md: no table under ## Configuration"
    assert rows[0][0] == "variable" and set(rows[1][0]) <= {"-", ":"}
    return rows[2:]


def documented() -> set[str]:
    """The variables the table's first column names in full (a shorthand such as `_HARDWARE` is none)."""
    names = set()
    for row in configuration_table():
        for quoted in re.findall(r"`([^`]*)`", row[0]):
            if NAME.fullmatch(quoted):
                names.add(quoted)
    return names


def test_the_scan_finds_the_variables_it_must() -> None:
    found = variables_in_code()
    for name in ("NATS_URL", "LIVER_JOB_ID", "LIVER_TOPOLOGY_GLOBAL_BATCH", "LIVER_METRICS_PORT"):
        assert name in found, name
    assert not {spec.name for spec in s.STREAMS} & set(found), "stream names are not variables"


def test_every_variable_the_code_reads_is_in_the_readmes_configuration_table() -> None:
    missing = {
        name: sorted(modules)
        for name, modules in variables_in_code().items()
        if name not in documented() and name not in INTERNAL
    }
    assert missing == {}, "add a row to README.md's ## Configuration for each"


def test_the_table_names_no_variable_the_code_does_not_read() -> None:
    assert sorted(documented() - set(variables_in_code())) == []


def test_every_internal_variable_is_still_read() -> None:
    assert sorted(set(INTERNAL) - set(variables_in_code())) == []


def test_each_row_says_who_reads_it_and_what_it_means() -> None:
    for row in configuration_table():
        assert len(row) == 3 and all(row), row


def test_the_global_batch_row_says_it_is_required_and_what_it_must_divide() -> None:
    (row,) = [r for r in configuration_table() if "`LIVER_TOPOLOGY_GLOBAL_BATCH`" in r[0]]
    assert "required" in row[2]
    assert "micro" in row[2], "layouts must split it into micro-batches of every DP replica"
