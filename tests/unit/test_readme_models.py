"""The README's "Supported models" table against the code that decides what loads.

The table names each family's Hugging Face architecture (``config.architectures[0]``,
resolved by ``quire.models.registry.CORE_MODELS``) and, where there is one, its GGUF
``general.architecture`` (read by ``quire.models.gguf_file``). An architecture added to
either without a README row fails here, and so does a README row that names one the
code lacks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import pytest

from quire.models.gguf_file import SUPPORTED_GGUF_ARCHITECTURES
from quire.models.registry import CORE_MODELS

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## Supported models"
HF_COLUMN = "Hugging Face architecture"
GGUF_COLUMN = "GGUF architecture"
#: What a cell holds when the family has no entry in that column.
NONE = "-"

_CODE = re.compile(r"`([^`]+)`")


def section(text: str, heading: str) -> str:
    """The lines after ``heading`` up to the next heading of the same or a higher level.

    :raises ValueError: when ``heading`` is not a line of ``text``.
    """
    lines = text.splitlines()
    if heading not in lines:
        raise ValueError(f"no {heading!r} heading in the README")
    start = lines.index(heading) + 1
    level = _level(heading)
    end = next((i for i in range(start, len(lines)) if 0 < _level(lines[i]) <= level),
               len(lines))
    return "\n".join(lines[start:end])


def table_rows(text: str) -> list[dict[str, str]]:
    """The rows of the first Markdown table in ``text``, each as {header: cell}.

    :raises ValueError: when there is no table, or a row's cell count is not the header's.
    """
    table = [line.strip() for line in text.splitlines() if line.strip().startswith("|")]
    if len(table) < 2:
        raise ValueError("no table in the README's supported-models section")
    header, rows = _cells(table[0]), table[2:]  # table[1] is the |---| rule
    parsed = []
    for row in rows:
        cells = _cells(row)
        if len(cells) != len(header):
            raise ValueError(f"README row {row!r} has {len(cells)} cells, the header "
                             f"{len(header)}")
        parsed.append(dict(zip(header, cells)))
    return parsed


def listed(rows: list[dict[str, str]], column: str, optional: bool) -> list[str]:
    """The names in ``column``, one code span per row (or ``-`` where ``optional``).

    :raises ValueError: when the column is missing, or a cell holds anything else.
    """
    names = []
    for row in rows:
        if column not in row:
            raise ValueError(f"the README's models table has no {column!r} column")
        cell = row[column]
        spans = _CODE.findall(cell)
        if optional and cell == NONE:
            continue
        if len(spans) != 1 or cell != f"`{spans[0]}`":
            raise ValueError(f"README cell {cell!r} in column {column!r} should be one "
                             f"`name`{' or ' + NONE if optional else ''}")
        names.append(spans[0])
    return names


def differences(names: list[str], actual: Iterable[str], what: str) -> list[str]:
    """Why ``names`` (the README's) is not exactly ``actual`` (the code's); [] if it is."""
    actual = set(actual)
    problems = []
    missing = sorted(actual - set(names))
    if missing:
        problems.append(f"{what} in the code but not in the README: {', '.join(missing)}")
    unknown = sorted(set(names) - actual)
    if unknown:
        problems.append(f"{what} in the README but not in the code: {', '.join(unknown)}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        problems.append(f"{what} named twice in the README: {', '.join(repeated)}")
    return problems


def _level(line: str) -> int:
    """A Markdown heading's level (``##`` is 2); 0 for any other line."""
    marks = line.split(" ", 1)[0]
    return len(marks) if marks and set(marks) == {"#"} and " " in line else 0


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip().strip("|").split("|")]


@pytest.fixture(scope="module")
def rows() -> list[dict[str, str]]:
    return table_rows(section(README.read_text(encoding="utf-8"), SECTION))


def test_readme_names_every_core_architecture(rows: list[dict[str, str]]) -> None:
    names = listed(rows, HF_COLUMN, optional=False)
    assert differences(names, CORE_MODELS, "Hugging Face architectures") == []


def test_readme_names_every_gguf_architecture(rows: list[dict[str, str]]) -> None:
    names = listed(rows, GGUF_COLUMN, optional=True)
    assert differences(names, SUPPORTED_GGUF_ARCHITECTURES, "GGUF architectures") == []


_STALE = """\
# Quire

## Supported models

| family | Hugging Face architecture | GGUF architecture | what differs |
| --- | --- | --- | --- |
| Llama | `LlamaForCausalLM` | `llama` | the base decoder |
| Falcon | `FalconForCausalLM` | - | not in the registry |
| Llama again | `LlamaForCausalLM` | - | a repeat |

## Layout
"""


def test_a_stale_table_is_reported_by_name() -> None:
    names = listed(table_rows(section(_STALE, SECTION)), HF_COLUMN, optional=False)
    problems = differences(names, ["LlamaForCausalLM", "Gemma3ForCausalLM"], "archs")
    assert problems == [
        "archs in the code but not in the README: Gemma3ForCausalLM",
        "archs in the README but not in the code: FalconForCausalLM",
        "archs named twice in the README: LlamaForCausalLM",
    ]


@pytest.mark.parametrize("text, error", [
    ("# Quire\n", "no '## Supported models' heading"),
    ("## Supported models\n\nno table\n", "no table"),
    ("## Supported models\n\n| a | b |\n| --- | --- |\n| 1 |\n", "has 1 cells"),
    ("## Supported models\n\n| family | Hugging Face architecture |\n| --- | --- |\n"
     "| Llama | Llama and `Mistral` |\n", "should be one `name`"),
])
def test_a_malformed_section_fails_loudly(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        listed(table_rows(section(text, SECTION)), HF_COLUMN, optional=False)
